#include "dtrain/plan/Calibrate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <exception>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"

namespace dtrain::plan {

namespace {

using Clock = std::chrono::steady_clock;

/// Median seconds of `body` over `count` repetitions (after one to warm up): the ranks of a
/// collective or a send/recv must all make the same number.
template <typename Body>
double median_of(int count, Body&& body) {
  body();
  std::vector<double> times;
  for (int i = 0; i < count; ++i) {
    const auto t0 = Clock::now();
    body();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

/// Median seconds of `body` over repetitions filling about `seconds` (at least 5).
template <typename Body>
double median_seconds(double seconds, Body&& body) {
  body();  // warm up
  std::vector<double> times;
  const auto start = Clock::now();
  while (times.size() < 5 ||
         std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
    const auto t0 = Clock::now();
    body();
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (times.size() >= 2000) break;
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "CPU";
}

double memory_gib() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  in >> key >> kib;
  return kib / (1024.0 * 1024.0);
}

std::string number(double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

/// What `dtrain plan calibrate` measured of this machine.
struct Measured {
  /// The [accelerator.matmul_tflops_by_dim] table's lines, and the best rate of each dtype.
  std::string by_dim;
  double best_fp32 = 0, best_bf16 = 0;
  double memory_Bps = 0, elementwise_Bps = 0, operator_s = 0;
  /// Gloo on loopback: the all-reduce's latency and bandwidth, point-to-point by size.
  double latency_s = 0, link_Bps = 0;
  std::vector<int64_t> p2p_elements;
  std::vector<double> p2p_seconds;
  double disk_read_Bps = 0, disk_write_Bps = 0;  // 0: not measured
};

using Progress = std::function<void(const std::string&)>;

void measure_matmuls(double t, const Progress& progress, Measured& out) {
  // Matrix products as a linear layer makes them, forward and backward: 2048 rows (a batch's
  // tokens) and an n x n weight, per dtype; the rate by the weight's size n is what the planner
  // looks up by a layer's width.
  const std::vector<int64_t> dims = {32, 64, 128, 256, 512, 1024};
  const int64_t rows = 2048;
  std::ostringstream by_dim;
  for (const auto& [dtype, name] :
       {std::pair<at::ScalarType, const char*>{at::kFloat, "fp32"}, {at::kBFloat16, "bf16"}}) {
    by_dim << name << " = { ";
    for (size_t i = 0; i < dims.size(); ++i) {
      const int64_t n = dims[i];
      // The three products of a linear layer: forward x W^T, backward dy W and dy^T x.
      const auto x = at::randn({rows, n}).to(dtype), w = at::randn({n, n}).to(dtype);
      const double s = (median_seconds(t, [&] { (void)at::linear(x, w); }) +
                        median_seconds(t, [&] { (void)at::mm(x, w); }) +
                        median_seconds(t, [&] { (void)at::mm(x.t(), x); })) /
                       3;
      const double tflops = 2.0 * rows * n * n / s / 1e12;
      double& best = dtype == at::kFloat ? out.best_fp32 : out.best_bf16;
      best = std::max(best, tflops);
      by_dim << (i ? ", " : "") << '"' << n << "\" = " << number(tflops);
      progress(concat("matmul ", name, " ", rows, " x ", n, " x ", n, ": ", number(tflops * 1e3),
                      " GFLOP/s"));
    }
    by_dim << " }\n";
  }
  out.by_dim = by_dim.str();
}

/// The 64 MiB tensors of the memory and loopback measurements, in elements.
constexpr int64_t kLargeElements = 16 << 20;

void measure_memory(double t, const Progress& progress, Measured& out) {
  // Memory bandwidth as simple element-wise arithmetic sees it (the optimizer's, the casts'):
  // c = a + b over 64 MiB tensors (read 2, write 1).
  const int64_t elements = kLargeElements;
  const auto big_a = at::randn({elements}), big_b = at::randn({elements});
  auto big_c = at::empty({elements});
  const double add_s = median_seconds(t, [&] { at::add_out(big_c, big_a, big_b); });
  out.memory_Bps = 3.0 * elements * 4 / add_s;
  progress(concat("memory bandwidth: ", number(out.memory_Bps / 1e9), " GB/s"));
}

void measure_kernels(double t, const Progress& progress, Measured& out) {
  // Activations' element-wise throughput, in bytes of the elements each kernel reads and
  // writes per second: the mean time of the kernels a layer runs (an add, GELU, softmax, layer
  // norm) over 2M elements. On a GPU these are bound by memory bandwidth; on a CPU thread the
  // transcendental ones are bound by arithmetic, which the mix measures.
  const int64_t mixed = 2 << 20;
  const auto u = at::randn({mixed / 256, 256}), v = at::randn({mixed / 256, 256});
  const auto gamma = at::ones({256}), beta = at::zeros({256});
  const double kernel_s =
      (median_seconds(t, [&] { (void)at::add(u, v); }) +
       median_seconds(t, [&] { (void)at::gelu(u); }) +
       median_seconds(t, [&] { (void)at::softmax(u, -1); }) +
       median_seconds(t, [&] { (void)at::layer_norm(u, {256}, gamma, beta); })) /
      4;
  // Elements touched: add reads 2 and writes 1, the others read 1 and write 1.
  out.elementwise_Bps = (3.0 + 2 + 2 + 2) / 4 * mixed * 4 / kernel_s;
  progress(concat("activation kernels: ", number(out.elementwise_Bps / 1e9), " GB/s"));

  // One operator's fixed cost as training pays it: a one-element multiply that autograd
  // records (dispatch, the graph node), as every layer's operators are.
  const auto x = at::ones({1}).set_requires_grad(true), y = at::ones({1});
  out.operator_s = median_seconds(t, [&] { (void)at::mul(x, y); });
  progress(concat("one operator: ", number(out.operator_s * 1e6), " us"));
}

void measure_gloo(const Progress& progress, Measured& out) {
  const int64_t elements = kLargeElements;
  // Gloo on loopback: two ranks as threads of this process (the same TCP path as two
  // processes); latency from a 1-element all-reduce (2 (n-1) = 2 messages), bandwidth from
  // 64 MiB (each rank sends and receives 2 (n-1)/n = 1 of the bytes).
  double latency = 0, link = 0;
  // Point-to-point by message size (a ping-pong: half the round trip), summarized as
  // alpha + bytes / beta; the all-reduce's figures are what the profile uses for collectives,
  // the point-to-point ones are recorded beside them.
  const std::vector<int64_t> p2p_sizes = {1, 1 << 10, 1 << 16, 1 << 20, 1 << 24};
  std::vector<double> p2p_seconds(p2p_sizes.size());
  {
    const int port = free_port();
    std::vector<std::exception_ptr> errors(2);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        try {
          comm::InitOptions init;
          init.rank = rank;
          init.world_size = 2;
          init.master_port = port;
          init.backend_threads = 1;
          auto world = comm::init(init);
          auto small = at::ones({1});
          auto large = at::ones({elements});
          const double small_s = median_of(200, [&] { world->allreduce(small)->wait(); });
          const double large_s = median_of(9, [&] { world->allreduce(large)->wait(); });
          if (rank == 0) {
            latency = small_s / 2;
            link = elements * 4.0 / std::max(1e-9, large_s - small_s);
          }
          for (size_t i = 0; i < p2p_sizes.size(); ++i) {
            auto message = at::ones({p2p_sizes[i]});
            const double round_trip = median_of(p2p_sizes[i] < (1 << 20) ? 100 : 9, [&] {
              if (rank == 0) {
                world->send(message, 1)->wait();
                world->recv(message, 1)->wait();
              } else {
                world->recv(message, 0)->wait();
                world->send(message, 0)->wait();
              }
            });
            if (rank == 0) p2p_seconds[i] = round_trip / 2;
          }
        } catch (...) {
          errors[rank] = std::current_exception();
        }
      });
    }
    for (auto& thread : ranks) thread.join();
    for (const auto& error : errors) {
      if (error) std::rethrow_exception(error);
    }
  }
  progress(concat("gloo all-reduce on loopback: latency ", number(latency * 1e6), " us, ",
                  number(link / 1e9), " GB/s"));
  for (size_t i = 0; i < p2p_sizes.size(); ++i) {
    progress(concat("gloo send/recv ", p2p_sizes[i] * 4, " bytes: ", number(p2p_seconds[i] * 1e6),
                    " us"));
  }
  out.latency_s = latency;
  out.link_Bps = link;
  out.p2p_elements = p2p_sizes;
  out.p2p_seconds = p2p_seconds;
}

/// The hardware profile (TOML) of what was measured.
// The disk as offload sees it: a 512 MiB file written in 64 MiB blocks and read back, both
// with O_DIRECT (past the page cache), the file removed after.
void measure_disk(const std::string& dir, const Progress& progress, Measured& out) {
  constexpr size_t kBlock = 64 << 20;
  constexpr int kBlocks = 8;
  const std::string path = dir + "/dtrain-calibrate-disk";
  void* buffer = nullptr;
  DTRAIN_CHECK(::posix_memalign(&buffer, 4096, kBlock) == 0, "calibrate: no memory for the disk");
  std::memset(buffer, 1, kBlock);
  const auto timed = [&](int flags, bool write) {
    const int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd < 0) std::free(buffer);
    DTRAIN_CHECK_INPUT(fd >= 0, "calibrate: --disk-dir ", dir, ": cannot ",
                       write ? "write" : "read", " ", path, " (", std::strerror(errno), ")");
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kBlocks; ++i) {
      const ssize_t n = write ? ::write(fd, buffer, kBlock) : ::read(fd, buffer, kBlock);
      if (n != static_cast<ssize_t>(kBlock)) {
        ::close(fd);
        ::unlink(path.c_str());
        std::free(buffer);
        DTRAIN_THROW(InputError, "calibrate: --disk-dir ", dir, ": ", write ? "writing" : "reading",
                     " ", path, " failed (", std::strerror(errno), ")");
      }
    }
    if (write) ::fsync(fd);
    ::close(fd);
    return kBlock * kBlocks /
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  out.disk_write_Bps = timed(O_WRONLY | O_CREAT | O_TRUNC, true);
  out.disk_read_Bps = timed(O_RDONLY, false);
  ::unlink(path.c_str());
  std::free(buffer);
  progress(concat("disk under ", dir, ": write ", number(out.disk_write_Bps / 1e9), " GB/s, read ",
                  number(out.disk_read_Bps / 1e9), " GB/s"));
}

std::string profile_of(const CalibrateOptions& options, const Measured& m) {
  const std::vector<int64_t>& p2p_sizes = m.p2p_elements;
  const std::vector<double>& p2p_seconds = m.p2p_seconds;
  const double latency = m.latency_s, link = m.link_Bps;
  // alpha: the faster of the two smallest messages; beta: the slope between the two largest.
  std::ostringstream p2p_table;
  for (size_t i = 0; i < p2p_sizes.size(); ++i) {
    p2p_table << (i ? ", " : "") << p2p_sizes[i] * 4 << " B " << number(p2p_seconds[i] * 1e6)
              << " us";
  }
  const size_t last = p2p_sizes.size() - 1;
  const double p2p_latency = std::min(p2p_seconds[0], p2p_seconds[1]);
  const double p2p_bandwidth = (p2p_sizes[last] - p2p_sizes[last - 1]) * 4.0 /
                               std::max(1e-9, p2p_seconds[last] - p2p_seconds[last - 1]);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  std::ostringstream toml;
  toml << "# Measured by `dtrain plan calibrate --threads " << options.threads << "` on " << host
       << ", " << date << ".\n"
       << "# Achieved rates, so every efficiency is 1. One accelerator = one rank of "
       << options.threads << " thread(s);\n# ranks beyond the cores share them.\n"
       << "source = \"dtrain plan calibrate on " << host << ", " << date << "\"\n\n"
       << "[accelerator]\n"
       << "device = \"" << (options.name.empty() ? cpu_model() : options.name) << ", "
       << options.threads << " thread(s) per rank\"\n"
       << "memory_gib = " << number(memory_gib()) << "\n"
       << "memory_bandwidth_gb_s = " << number(m.memory_Bps / 1e9) << "\n"
       << "# activations' element-wise kernels (add, GELU, softmax, layer norm)\n"
       << "elementwise_gb_s = " << number(m.elementwise_Bps / 1e9) << "\n"
       << "peak_tflops = { fp32 = " << number(m.best_fp32) << ", bf16 = " << number(m.best_bf16)
       << " }\n\n"
       << "# Measured matrix-product rates (TFLOP/s): 2048 rows times an n x n weight, by n.\n"
       << "[accelerator.matmul_tflops_by_dim]\n"
       << m.by_dim << "\n"
       << "[efficiency]\nmatmul = 1\nmemory = 1\nlink = 1\nkernel_overhead_us = "
       << number(m.operator_s * 1e6) << "\n\n"
       << "[node]\n"
       << "# Gloo send/recv on loopback, one way: " << p2p_table.str() << ";\n"
       << "# that is about " << number(p2p_latency * 1e6) << " us + bytes / "
       << number(p2p_bandwidth / 1e9) << " GB/s. The link below is the all-reduce's.\n"
       << "gpus = " << std::max(1u, cores / options.threads) << "\n"
       << "cores = " << cores << "\n"
       << "link_gb_s = " << number(link / 1e9) << "\n"
       << "link_latency_us = " << number(latency * 1e6) << "\n";
  if (m.disk_read_Bps > 0) {
    toml << "# The disk under " << options.disk_dir << " (O_DIRECT, 64 MiB blocks): offload's\n"
         << "disk_read_gb_s = " << number(m.disk_read_Bps / 1e9) << "\n"
         << "disk_write_gb_s = " << number(m.disk_write_Bps / 1e9) << "\n";
  }
  toml << "\n"
       << "# One machine: \"across nodes\" is the same loopback.\n"
       << "[network]\n"
       << "node_gbit_s = " << number(link * 8 / 1e9 * std::max(1u, cores / options.threads))
       << "\nlatency_us = " << number(latency * 1e6) << "\n";
  return toml.str();
}

}  // namespace

std::string calibrate(const CalibrateOptions& options, const Progress& progress) {
  DTRAIN_CHECK_INPUT(options.threads >= 1, "calibrate: --threads must be >= 1");
  at::set_num_threads(options.threads);
  Measured measured;
  measure_matmuls(options.probe_seconds, progress, measured);
  measure_memory(options.probe_seconds, progress, measured);
  measure_kernels(options.probe_seconds, progress, measured);
  measure_gloo(progress, measured);
  if (!options.disk_dir.empty()) measure_disk(options.disk_dir, progress, measured);
  return profile_of(options, measured);
}

}  // namespace dtrain::plan
