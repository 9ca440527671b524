// Process memory probes shared by the benchmarks (Linux /proc): current and peak resident set,
// and resetting the peak so a phase (e.g. the measured steps) can be measured on its own.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <string>

namespace dtrain::bench {

/// A /proc/self/status field in MB ("VmRSS:", "VmHWM:"), 0 when absent.
inline double status_mb(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) / 1024.0;
  }
  return 0;
}

inline double rss_mb() { return status_mb("VmRSS:"); }

inline double& peak_before_reset() {
  static double peak = 0;
  return peak;
}

inline double current_maxrss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

/// Peak resident set of the whole process life, MB (across reset_peak() calls).
inline double peak_rss_mb() { return std::max(peak_before_reset(), current_maxrss_mb()); }

/// Resets the kernel's peak-RSS counter (VmHWM, which getrusage's maxrss follows) to the current
/// RSS, so status_mb("VmHWM:") measures from now on; false where not allowed.
inline bool reset_peak() {
  peak_before_reset() = peak_rss_mb();
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.close();
  return clear.good();
}

}  // namespace dtrain::bench
