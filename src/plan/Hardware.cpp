#include "dtrain/plan/Hardware.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "dtrain/common/Error.h"

namespace dtrain::plan {

namespace fs = std::filesystem;

double Hardware::peak(const std::string& dtype) const {
  const auto it = peak_flops.find(dtype);
  DTRAIN_CHECK_INPUT(it != peak_flops.end(), "hardware profile '", name, "' gives no peak for ",
                     dtype, " (accelerator.peak_tflops.", dtype, ")");
  return it->second;
}

double Hardware::matmul_rate(const std::string& dtype, double dim) const {
  const auto it = matmul_by_dim.find(dtype);
  if (it == matmul_by_dim.end() || it->second.empty() || dim <= 0) {
    return peak(dtype) * matmul_efficiency;
  }
  const auto& table = it->second;
  if (dim <= table.front().first) return table.front().second;
  if (dim >= table.back().first) return table.back().second;
  for (size_t i = 1; i < table.size(); ++i) {
    if (dim <= table[i].first) {
      const auto& [d0, r0] = table[i - 1];
      const auto& [d1, r1] = table[i];
      const double w = std::log(dim / d0) / std::log(d1 / d0);
      return std::exp(std::log(r0) + w * (std::log(r1) - std::log(r0)));
    }
  }
  return table.back().second;
}

double MatmulTable::rate(const std::string& dtype, double m, double n, double k) const {
  const std::vector<double>& table = flops.at(dtype);
  const size_t count = sizes.size();
  // Each dimension: the two sizes around it and the weight of the upper one (log scale), and
  // the factor a dimension below the smallest size scales the rate by.
  struct Axis {
    size_t low = 0, high = 0;
    double weight = 0, scale = 1;
  };
  auto axis = [&](double x) {
    Axis a;
    if (x <= sizes.front()) {
      a.scale = x > 0 ? x / sizes.front() : 1;
      return a;
    }
    if (x >= sizes.back()) {
      a.low = a.high = count - 1;
      return a;
    }
    a.high = static_cast<size_t>(std::upper_bound(sizes.begin(), sizes.end(), x) - sizes.begin());
    a.low = a.high - 1;
    a.weight = std::log(x / sizes[a.low]) / std::log(sizes[a.high] / sizes[a.low]);
    return a;
  };
  const Axis am = axis(m), an = axis(n), ak = axis(k);
  double log_rate = 0;
  for (int corner = 0; corner < 8; ++corner) {
    const bool hm = corner & 4, hn = corner & 2, hk = corner & 1;
    const double w = (hm ? am.weight : 1 - am.weight) * (hn ? an.weight : 1 - an.weight) *
                     (hk ? ak.weight : 1 - ak.weight);
    if (w == 0) continue;
    const size_t index = ((hm ? am.high : am.low) * count + (hn ? an.high : an.low)) * count +
                         (hk ? ak.high : ak.low);
    log_rate += w * std::log(table[index]);
  }
  return std::exp(log_rate) * am.scale * an.scale * ak.scale;
}

namespace {

/// One profile's fields, each checked where it is read: present, a number, physical.
class Reader {
 public:
  Reader(const toml::table& table, std::string file) : table_(table), file_(std::move(file)) {}

  double positive(const std::string& path, double low = 0, double high = 0) const {
    const toml::node_view<const toml::node> node = table_.at_path(path);
    DTRAIN_CHECK_INPUT(node, file_, ": missing field '", path, "'");
    const auto value = node.value<double>();
    DTRAIN_CHECK_INPUT(value.has_value(), file_, ": field '", path, "' must be a number");
    DTRAIN_CHECK_INPUT(*value > low && (high == 0 || *value <= high), file_, ": field '", path,
                       "' = ", *value, " is not physical (must be > ", low,
                       high > 0 ? concat(" and <= ", high) : std::string(), ")");
    return *value;
  }
  double non_negative(const std::string& path) const {
    const toml::node_view<const toml::node> node = table_.at_path(path);
    DTRAIN_CHECK_INPUT(node, file_, ": missing field '", path, "'");
    const auto value = node.value<double>();
    DTRAIN_CHECK_INPUT(value.has_value() && *value >= 0, file_, ": field '", path,
                       "' must be a number >= 0");
    return *value;
  }
  std::string text(const std::string& path) const {
    const auto value = table_.at_path(path).value<std::string>();
    DTRAIN_CHECK_INPUT(value.has_value() && !value->empty(), file_, ": missing text field '", path,
                       "'");
    return *value;
  }

 private:
  const toml::table& table_;
  std::string file_;
};

/// [matmul_table]: source, sizes (ascending, positive) and per dtype of peak_tflops a list of
/// sizes^3 positive rates in TFLOP/s.
void read_matmul_table(const toml::table& table, const std::string& file, Hardware& hw) {
  MatmulTable& out = hw.matmul_table;
  const Reader read(table, file);
  out.source = read.text("source");
  const auto* sizes = table.get_as<toml::array>("sizes");
  DTRAIN_CHECK_INPUT(sizes != nullptr && !sizes->empty(), file,
                     ": matmul_table.sizes must be a list of sizes");
  for (const auto& size : *sizes) {
    const auto value = size.value<double>();
    DTRAIN_CHECK_INPUT(value && *value > 0 && (out.sizes.empty() || *value > out.sizes.back()),
                       file, ": matmul_table.sizes must be positive and ascending");
    out.sizes.push_back(*value);
  }
  const size_t expected = out.sizes.size() * out.sizes.size() * out.sizes.size();
  for (const auto& [key, node] : table) {
    const std::string dtype(key.str());
    if (dtype == "source" || dtype == "sizes") continue;
    const auto* rates = node.as_array();
    DTRAIN_CHECK_INPUT(hw.peak_flops.count(dtype) && rates != nullptr, file, ": matmul_table.",
                       dtype, " must be a list of rates for a dtype of accelerator.peak_tflops");
    DTRAIN_CHECK_INPUT(rates->size() == expected, file, ": matmul_table.", dtype, " has ",
                       rates->size(), " rates; ", out.sizes.size(), " sizes need ", expected,
                       " (m, then n, then k)");
    std::vector<double>& flops = out.flops[dtype];
    for (const auto& rate : *rates) {
      const auto value = rate.value<double>();
      DTRAIN_CHECK_INPUT(value && *value > 0, file, ": matmul_table.", dtype,
                         " must hold positive TFLOP/s");
      flops.push_back(*value * 1e12);
    }
  }
  DTRAIN_CHECK_INPUT(!out.flops.empty(), file, ": matmul_table gives no dtype's rates");
}

}  // namespace

std::vector<std::string> known_profiles(const std::vector<std::string>& search_dirs) {
  std::vector<std::string> names;
  for (const auto& dir : search_dirs) {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      if (entry.path().extension() == ".toml") names.push_back(entry.path().stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

Hardware load_hardware(const std::string& name_or_path,
                       const std::vector<std::string>& search_dirs) {
  std::string file = name_or_path;
  const bool is_path =
      name_or_path.find('/') != std::string::npos || fs::path(name_or_path).extension() == ".toml";
  if (!is_path) {
    file.clear();
    for (const auto& dir : search_dirs) {
      const fs::path candidate = fs::path(dir) / (name_or_path + ".toml");
      if (fs::exists(candidate)) {
        file = candidate.string();
        break;
      }
    }
    if (file.empty()) {
      std::string known;
      for (const auto& name : known_profiles(search_dirs))
        known += (known.empty() ? "" : ", ") + name;
      DTRAIN_THROW(InputError, "unknown hardware profile '", name_or_path,
                   "' (known: ", known.empty() ? "none found" : known, "; or give a .toml file)");
    }
  }
  DTRAIN_CHECK_INPUT(fs::exists(file), "hardware profile file '", file, "' does not exist");
  toml::table table;
  try {
    table = toml::parse_file(file);
  } catch (const toml::parse_error& e) {
    DTRAIN_THROW(InputError, file, ":", e.source().begin.line, ": ", e.description());
  }
  const Reader read(table, file);
  Hardware hw;
  hw.name = fs::path(file).stem().string();
  hw.device = read.text("accelerator.device");
  hw.source = read.text("source");
  const auto* peaks = table.at_path("accelerator.peak_tflops").as_table();
  DTRAIN_CHECK_INPUT(peaks != nullptr && !peaks->empty(), file,
                     ": missing table 'accelerator.peak_tflops' (fp32 = ..., bf16 = ...)");
  for (const auto& [key, node] : *peaks) {
    const std::string dtype(key.str());
    DTRAIN_CHECK_INPUT(dtype == "fp32" || dtype == "tf32" || dtype == "fp16" || dtype == "bf16",
                       file, ": accelerator.peak_tflops.", dtype,
                       " is not a dtype the planner knows (fp32, tf32, fp16, bf16)");
    hw.peak_flops[dtype] = read.positive("accelerator.peak_tflops." + dtype) * 1e12;
  }
  DTRAIN_CHECK_INPUT(hw.peak_flops.count("fp32"), file,
                     ": missing field 'accelerator.peak_tflops.fp32'");
  if (const auto* by_dim = table.at_path("accelerator.matmul_tflops_by_dim").as_table()) {
    for (const auto& [key, rates] : *by_dim) {
      const std::string dtype(key.str());
      DTRAIN_CHECK_INPUT(hw.peak_flops.count(dtype) && rates.is_table(), file,
                         ": accelerator.matmul_tflops_by_dim.", dtype,
                         " must be a table of sizes for a dtype of peak_tflops");
      for (const auto& [size, rate] : *rates.as_table()) {
        const std::string path =
            concat("accelerator.matmul_tflops_by_dim.", dtype, ".\"", size.str(), "\"");
        double n = 0;
        try {
          n = std::stod(std::string(size.str()));
        } catch (const std::exception&) {
        }
        const auto value = rate.value<double>();
        DTRAIN_CHECK_INPUT(n > 0 && value.has_value() && *value > 0, file, ": ", path,
                           " must be a positive rate keyed by a positive size");
        hw.matmul_by_dim[dtype].emplace_back(n, *value * 1e12);
      }
      std::sort(hw.matmul_by_dim[dtype].begin(), hw.matmul_by_dim[dtype].end());
    }
  }
  if (const auto* measured = table.at_path("matmul_table").as_table()) {
    read_matmul_table(*measured, file, hw);
  }
  hw.memory_bytes = read.positive("accelerator.memory_gib") * (1LL << 30);
  hw.memory_bandwidth_Bps = read.positive("accelerator.memory_bandwidth_gb_s") * 1e9;
  if (table.at_path("accelerator.elementwise_gb_s")) {
    hw.elementwise_Bps = read.positive("accelerator.elementwise_gb_s") * 1e9;
  }
  hw.matmul_efficiency = read.positive("efficiency.matmul", 0, 1);
  hw.memory_efficiency = read.positive("efficiency.memory", 0, 1);
  hw.kernel_overhead_s = read.non_negative("efficiency.kernel_overhead_us") * 1e-6;
  const double gpus = read.positive("node.gpus");
  DTRAIN_CHECK_INPUT(gpus == static_cast<int>(gpus), file,
                     ": field 'node.gpus' must be an integer");
  hw.gpus_per_node = static_cast<int>(gpus);
  hw.shared_cores = static_cast<bool>(table.at_path("node.cores"));
  if (hw.shared_cores) read.positive("node.cores");
  const auto optional_rate = [&](const char* path, double scale) {
    return table.at_path(path) ? read.positive(path) * scale : 0.0;
  };
  hw.host_memory_bytes = optional_rate("node.host_memory_gib", 1LL << 30);
  hw.host_memory_bandwidth_Bps = optional_rate("node.host_memory_bandwidth_gb_s", 1e9);
  hw.host_link_Bps = optional_rate("node.host_link_gb_s", 1e9);
  hw.disk_read_Bps = optional_rate("node.disk_read_gb_s", 1e9);
  hw.disk_write_Bps = optional_rate("node.disk_write_gb_s", 1e9);
  // Links as collectives see them: the rate times the share NCCL's rings reach.
  const double link = read.positive("efficiency.link", 0, 1);
  hw.intra_node = {read.non_negative("node.link_latency_us") * 1e-6,
                   read.positive("node.link_gb_s") * 1e9 * link};
  hw.inter_node = {read.non_negative("network.latency_us") * 1e-6,
                   read.positive("network.node_gbit_s") * 1e9 / 8 * link};
  return hw;
}

}  // namespace dtrain::plan
