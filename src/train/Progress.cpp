// Renders the progress bar.
#include "dtrain/train/Progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <string>

namespace dtrain::train {

ProgressBar::ProgressBar(std::FILE* out, bool interactive, int64_t plain_every)
    : out_(out), interactive_(interactive), plain_every_(std::max<int64_t>(1, plain_every)) {}

bool ProgressBar::is_terminal(std::FILE* out) {
  // Under `dtrain launch` rank 0 writes into a pipe; the launcher redraws its bar in place.
  const char* forced = std::getenv("DTRAIN_PROGRESS_TTY");
  if (forced && std::string(forced) == "1") return true;
  return ::isatty(::fileno(out)) == 1;
}

std::string ProgressBar::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto total = static_cast<int64_t>(seconds + 0.5);
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof(text), "%lld:%02lld:%02lld", static_cast<long long>(total / 3600),
                  static_cast<long long>(total / 60 % 60), static_cast<long long>(total % 60));
  } else {
    std::snprintf(text, sizeof(text), "%lld:%02lld", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  }
  return text;
}

void ProgressBar::update(int64_t epoch, int64_t epochs, int64_t step_in_epoch,
                         int64_t steps_per_epoch, double loss, double samples_per_second,
                         double eta_seconds) {
  const bool epoch_done = step_in_epoch == steps_per_epoch;
  const auto now = std::chrono::steady_clock::now();
  if (interactive_) {
    if (!epoch_done && now - last_draw_ < std::chrono::milliseconds(100)) return;
  } else if (step_in_epoch % plain_every_ != 0 && !epoch_done) {
    return;
  }
  last_draw_ = now;
  constexpr int kWidth = 24;
  const int filled =
      static_cast<int>(kWidth * step_in_epoch / std::max<int64_t>(1, steps_per_epoch));
  std::string bar(filled, '#');
  bar.append(kWidth - filled, '.');
  char line[256];
  std::snprintf(line, sizeof(line),
                "epoch %lld/%lld [%s] %lld/%lld loss %.4f %.0f samples/s ETA %s",
                static_cast<long long>(epoch + 1), static_cast<long long>(epochs), bar.c_str(),
                static_cast<long long>(step_in_epoch), static_cast<long long>(steps_per_epoch),
                loss, samples_per_second, format_duration(eta_seconds).c_str());
  last_line_ = line;
  if (interactive_) {
    std::fprintf(out_, "\r%s\033[K", line);
  } else {
    std::fprintf(out_, "%s\n", line);
  }
  std::fflush(out_);
}

void ProgressBar::note(const std::string& text) {
  if (interactive_) {
    std::fprintf(out_, "\r%s\033[K\n%s", text.c_str(), last_line_.c_str());
  } else {
    std::fprintf(out_, "%s\n", text.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::finish_epoch(const std::string& note) {
  if (interactive_) {
    std::fprintf(out_, "\r%s%s%s\033[K\n", last_line_.c_str(), note.empty() ? "" : "  ",
                 note.c_str());
  } else if (!note.empty()) {
    std::fprintf(out_, "%s\n", note.c_str());
  }
  std::fflush(out_);
}

}  // namespace dtrain::train
