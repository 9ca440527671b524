// Progress display for rank 0: a live bar on a terminal, plain periodic lines otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dtrain::train {

/// What one progress line says: the run's units (steps, rounds, iterations) done of its total
/// (--max-steps when set), the epoch, and the step's numbers; NaN or 0 leaves a field out.
struct ProgressLine {
  const char* unit = "step";
  int64_t done = 0;
  int64_t total = 0;
  /// 0-based; shown as "epoch E/EPOCHS" when epochs > 1.
  int64_t epoch = 0;
  int64_t epochs = 1;
  /// The last unit of an epoch: always drawn (and, off a terminal, always printed).
  bool epoch_end = false;
  double loss = 0.0;
  double lr = -1.0;
  double samples_per_s = 0.0;
  /// A language model's tokens per second (0: not one).
  double tokens_per_s = 0.0;
  /// The model's FLOPs per second over all ranks (0: not known).
  double model_flops_per_s = 0.0;
  /// Model FLOPs utilization, 0-1 (negative: not known).
  double mfu = -1.0;
  double step_ms = 0.0;
  double eta_s = -1.0;
  /// The process's peak memory (its resident set on a CPU; 0: not known).
  int64_t peak_bytes = 0;
};

class ProgressBar {
 public:
  /// `interactive`: redraw one line in place (a terminal); else print a line every
  /// `plain_every` units (--log-every: what Megatron and torchtitan print into a log file) and
  /// at the end of each epoch.
  ProgressBar(std::FILE* out, bool interactive, int64_t plain_every);
  /// Whether `out` is a terminal.
  static bool is_terminal(std::FILE* out);

  /// On a terminal: "epoch 2/5 [#####.......] step 120/470 loss 0.5123 1830 samples/s ETA 1:02";
  /// off one: "step 120/470 | epoch 2/5 | loss 0.5123 | lr 0.0495 | 1830 samples/s | 35.0
  /// ms/step | peak memory 312 MiB | ETA 1:02" (a language model: tokens/s, then its model
  /// FLOP/s and MFU where known, "| 3.1 GFLOP/s | MFU 6.1%").
  void update(const ProgressLine& line);
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
