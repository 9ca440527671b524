// Byte counts as the command line prints them (shared by `dtrain plan` and `train --dry-run`).
#pragma once

#include <cstdio>
#include <string>

namespace dtrain::cli {

inline constexpr double kGiB = 1024.0 * 1024 * 1024;

// "12.34": bytes in GiB, two decimals.
inline std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", bytes / kGiB);
  return text;
}

}  // namespace dtrain::cli
