// Renders the progress bar.
#include "dtrain/train/Progress.h"

#include <unistd.h>

#include <algorithm>
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

namespace {

std::string fixed(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

std::string bytes_text(int64_t bytes) {
  const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  return mib >= 10240 ? fixed(mib / 1024, 1) + " GiB" : fixed(mib, 0) + " MiB";
}

// 2.5e12 -> "2.50 TFLOP/s", 3.1e10 -> "31.0 GFLOP/s".
std::string flops_text(double flops_per_s) {
  if (flops_per_s >= 1e12) return fixed(flops_per_s / 1e12, 2) + " TFLOP/s";
  return fixed(flops_per_s / 1e9, 1) + " GFLOP/s";
}

}  // namespace

void ProgressBar::update(const ProgressLine& p) {
  const auto now = std::chrono::steady_clock::now();
  if (interactive_) {
    if (!p.epoch_end && now - last_draw_ < std::chrono::milliseconds(100)) return;
  } else if (p.done % plain_every_ != 0 && !p.epoch_end && p.done != p.total) {
    return;
  }
  last_draw_ = now;
  const std::string count =
      std::string(p.unit) + " " + std::to_string(p.done) + "/" + std::to_string(p.total);
  const std::string epoch =
      p.epochs > 1 ? "epoch " + std::to_string(p.epoch + 1) + "/" + std::to_string(p.epochs) : "";
  const std::string rate = p.tokens_per_s > 0 ? fixed(p.tokens_per_s, 0) + " tokens/s"
                                              : fixed(p.samples_per_s, 0) + " samples/s";
  std::string line;
  if (interactive_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * p.done / std::max<int64_t>(1, p.total));
    std::string bar(std::clamp(filled, 0, kWidth), '#');
    bar.append(kWidth - bar.size(), '.');
    line = (epoch.empty() ? "" : epoch + " ") + "[" + bar + "] " + count + " loss " +
           fixed(p.loss, 4) + " " + rate + " ETA " + format_duration(p.eta_s);
    std::fprintf(out_, "\r%s\033[K", line.c_str());
  } else {
    line = count + (epoch.empty() ? "" : " | " + epoch) + " | loss " + fixed(p.loss, 4);
    if (p.lr >= 0) {
      char lr[32];
      std::snprintf(lr, sizeof(lr), "%.4g", p.lr);
      line += std::string(" | lr ") + lr;
    }
    line += " | " + rate;
    if (p.model_flops_per_s > 0) line += " | " + flops_text(p.model_flops_per_s);
    if (p.mfu >= 0) line += " | MFU " + fixed(100 * p.mfu, 1) + "%";
    if (p.step_ms > 0) line += " | " + fixed(p.step_ms, 1) + " ms/" + p.unit;
    if (p.peak_bytes > 0) line += " | peak memory " + bytes_text(p.peak_bytes);
    line += " | ETA " + format_duration(p.eta_s);
    std::fprintf(out_, "%s\n", line.c_str());
  }
  last_line_ = line;
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
