// Memory probes and small helpers shared by the benchmarks: current and peak resident set
// (Linux /proc), resetting the peak so a phase (e.g. the measured steps) can be measured on its
// own, an allocator that counts the bytes of live CPU tensors, and the median.
#pragma once

#include <c10/core/Allocator.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "common/TorchCompat.h"

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

/// Counts the bytes of live CPU tensors; install with
/// `c10::SetCPUAllocator(&allocator, /*priority=*/100)` before any tensor is made. Data and
/// context are the same pointer (some kernels allocate raw buffers through raw_deleter(), which
/// LibTorch requires of an allocator): a 64-byte header before the data keeps the size.
class CountingAllocator : public compat::Allocator {
 public:
  at::DataPtr allocate_bytes(size_t n) const override {
    void* block = nullptr;
    if (posix_memalign(&block, kHeader, n + kHeader) != 0) throw std::bad_alloc();
    *static_cast<size_t*>(block) = n;
    const int64_t now = in_use() += static_cast<int64_t>(n);
    int64_t high = peak().load();
    while (now > high && !peak().compare_exchange_weak(high, now)) {
    }
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &release, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  /// Bytes of live tensors now.
  static int64_t bytes_in_use() { return in_use().load(); }
  /// The most bytes live at once since the last reset_peak().
  static int64_t peak_bytes() { return peak().load(); }
  static void reset_peak() { peak() = in_use().load(); }

 private:
  static constexpr size_t kHeader = 64;
  static std::atomic<int64_t>& in_use() {
    static std::atomic<int64_t> bytes{0};
    return bytes;
  }
  static std::atomic<int64_t>& peak() {
    static std::atomic<int64_t> bytes{0};
    return bytes;
  }
  static void release(void* data) {
    if (!data) return;
    void* block = static_cast<char*>(data) - kHeader;
    in_use() -= static_cast<int64_t>(*static_cast<size_t*>(block));
    std::free(block);
  }
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace dtrain::bench
