// `dtrain plan calibrate`: measures this machine and writes a hardware profile of it, so the
// planner's predictions can be checked against runs here. What it measures: matrix products
// per dtype and size class, memory bandwidth, one operator's overhead, and Gloo's all-reduce
// latency and bandwidth on loopback. A calibrated profile states achieved rates, so its
// efficiencies are 1.
#pragma once

#include <functional>
#include <string>

namespace dtrain::plan {

struct CalibrateOptions {
  int threads = 1;  ///< LibTorch threads of one rank (each rank of a run here uses this many)
  double probe_seconds = 0.3;  ///< per measurement
  std::string name;            ///< the profile's device description (default: the CPU's model)
  /// Also the disk under this folder (512 MiB written and read past the page cache), for
  /// offload's predictions; empty: not measured.
  std::string disk_dir;
};

/// The profile as TOML text; `progress` hears one line per measurement.
std::string calibrate(const CalibrateOptions& options,
                      const std::function<void(const std::string&)>& progress);

}  // namespace dtrain::plan
