// A cluster's hardware for `dtrain plan`: one accelerator's datasheet figures (peak flops per
// dtype, memory size and bandwidth), the efficiency its kernels reach (stated once per profile,
// never tuned per prediction), and the links between accelerators (inside a node, between
// nodes), each as latency (alpha) and bandwidth (1/beta). Profiles are TOML files
// (configs/hardware/*.toml); docs/PLAN.md describes every field.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace dtrain::plan {

struct Link {
  double latency_s = 0;      ///< alpha: the fixed cost of one message
  double bandwidth_Bps = 0;  ///< bytes per second, one direction
};

/// Measured matrix-product rates by shape (a profile's [matmul_table]): the flop/s of an
/// (m x k) by (k x n) product for m, n and k each one of `sizes`, per dtype.
struct MatmulTable {
  std::string source;
  std::vector<double> sizes;  ///< ascending
  /// Per dtype: sizes^3 rates, m slowest, then n, then k.
  std::map<std::string, std::vector<double>> flops;
  bool has(const std::string& dtype) const { return flops.count(dtype) > 0; }
  /// Interpolated log-linearly in log m, log n and log k between the sizes; above the largest
  /// size held (the rate has saturated); below the smallest, the smallest's time (a narrower
  /// product is no faster: its rate falls with the dimension).
  double rate(const std::string& dtype, double m, double n, double k) const;
};

struct Hardware {
  std::string name;    ///< the profile's name (file stem)
  std::string device;  ///< "NVIDIA A100 80GB SXM4"
  std::string source;  ///< where the figures come from
  /// Peak dense flop/s per compute dtype: "fp32", "tf32", "fp16", "bf16" (those given).
  std::map<std::string, double> peak_flops;
  double memory_bytes = 0;
  double memory_bandwidth_Bps = 0;
  /// The rate of activations' element-wise kernels (GELU, softmax, norms) in bytes touched
  /// per second, where it differs from memory bandwidth (a CPU thread: the transcendental ones
  /// are bound by arithmetic); 0: memory bandwidth x memory efficiency, as on a GPU.
  double elementwise_Bps = 0;
  /// Share of peak that large matrix products reach, and of memory bandwidth that element-wise
  /// kernels reach (each justified in the profile), and the fixed cost of one kernel.
  double matmul_efficiency = 0;
  double memory_efficiency = 0;
  double kernel_overhead_s = 0;
  /// Measured rates (calibrated profiles): matrix-product flop/s by dtype and size class n
  /// (n x n x n), sorted by n; empty: peak x matmul_efficiency for every size.
  std::map<std::string, std::vector<std::pair<double, double>>> matmul_by_dim;
  /// Measured rates by shape (m, n, k): the planner times a layer's linear layers by them, for
  /// the dtypes the table gives, and everything else by matmul_rate.
  MatmulTable matmul_table;
  int gpus_per_node = 1;
  /// CPU profiles (node.cores given): accelerators are ranks sharing the node's cores, so a
  /// node running more ranks than `gpus_per_node` gives each a share of them.
  bool shared_cores = false;
  /// Offload (optional; 0: not given, and layouts offloading there are refused): the node's
  /// host memory, its bandwidth (the CPU's optimizer step), each accelerator's link to it
  /// (PCIe), and the node's disk.
  double host_memory_bytes = 0;
  double host_memory_bandwidth_Bps = 0;
  double host_link_Bps = 0;
  double disk_read_Bps = 0, disk_write_Bps = 0;
  Link intra_node;  ///< per accelerator, to the others of its node (NVLink, PCIe, loopback)
  Link inter_node;  ///< per node, to the network (all its NICs together)
  /// Peak flop/s in `dtype` (InputError naming the profile when it has none).
  double peak(const std::string& dtype) const;
  /// The flop/s a matrix product of size class `dim` reaches in `dtype`: the measured table,
  /// interpolated log-log between sizes and held at its ends, or peak x matmul_efficiency.
  double matmul_rate(const std::string& dtype, double dim) const;
};

/// Reads a profile: `name_or_path` is a file ("x.toml", or with a '/') or the name of one of
/// the profiles found in `search_dirs` (then `<dir>/<name>.toml`). InputError naming the file
/// and the field for a missing field, a wrong type or a non-physical value (zero, negative,
/// an efficiency above 1), and listing the known profiles for an unknown name.
Hardware load_hardware(const std::string& name_or_path,
                       const std::vector<std::string>& search_dirs);

/// The profiles' names in `search_dirs`, sorted.
std::vector<std::string> known_profiles(const std::vector<std::string>& search_dirs);

}  // namespace dtrain::plan
