// Progress display for rank 0: a live bar on a terminal, plain periodic lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dtrain::train {

class ProgressBar {
 public:
  /// `interactive`: redraw one line in place (a terminal); else print a line every
  /// `plain_every` steps and at the end of each epoch.
  ProgressBar(std::FILE* out, bool interactive, int64_t plain_every);
  /// Whether `out` is a terminal.
  static bool is_terminal(std::FILE* out);

  void update(int64_t epoch, int64_t epochs, int64_t step_in_epoch, int64_t steps_per_epoch,
              double loss, double samples_per_second, double eta_seconds);
  /// Ends the current line (epoch finished) with an optional note (e.g. validation accuracy).
  void finish_epoch(const std::string& note);
  /// Prints `text` on its own line (above the live bar on a terminal).
  void note(const std::string& text);

  /// "1:02:03" / "4:05".
  static std::string format_duration(double seconds);

 private:
  std::FILE* out_;
  bool interactive_;
  int64_t plain_every_;
  std::chrono::steady_clock::time_point last_draw_{};
  std::string last_line_;
};

}  // namespace dtrain::train
