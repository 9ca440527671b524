// Context parallelism's memory (issue 82): the peak of live tensor bytes each rank holds while
// its attention runs forward and backward over a sequence split over C ranks (ranks as threads;
// an allocator that charges each tensor to the rank whose thread made it), against C = 1. Prints
// one JSON line per (method, C): the rank's peak above its inputs, the most over ranks.
//
//   cp_memory_bench [--tokens 8192] [--heads 8] [--head-dim 64] [--threads 1]
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <array>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "common/TorchCompat.h"
#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Net.h"
#include "dtrain/nn/context/Attention.h"

namespace {

constexpr int kRanks = 8;
thread_local int current_rank = kRanks;  // the last slot: threads that are no rank's

// Counts each rank's live CPU tensor bytes (the rank of the thread that allocated them; the
// header keeps the size and the rank, so a free on another thread is charged right).
class RankAllocator : public dtrain::compat::Allocator {
 public:
  at::DataPtr allocate_bytes(size_t n) const override {
    void* block = nullptr;
    if (posix_memalign(&block, kHeader, n + kHeader) != 0) throw std::bad_alloc();
    static_cast<int64_t*>(block)[0] = static_cast<int64_t>(n);
    static_cast<int64_t*>(block)[1] = current_rank;
    const int64_t now = in_use()[current_rank] += static_cast<int64_t>(n);
    int64_t high = peak()[current_rank].load();
    while (now > high && !peak()[current_rank].compare_exchange_weak(high, now)) {
    }
    void* data = static_cast<char*>(block) + kHeader;
    return {data, data, &release, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  static std::array<std::atomic<int64_t>, kRanks + 1>& in_use() {
    static std::array<std::atomic<int64_t>, kRanks + 1> bytes{};
    return bytes;
  }
  static std::array<std::atomic<int64_t>, kRanks + 1>& peak() {
    static std::array<std::atomic<int64_t>, kRanks + 1> bytes{};
    return bytes;
  }

 private:
  static constexpr size_t kHeader = 64;
  static void release(void* data) {
    if (!data) return;
    auto* block = reinterpret_cast<int64_t*>(static_cast<char*>(data) - kHeader);
    in_use()[block[1]] -= block[0];
    std::free(block);
  }
};

RankAllocator allocator;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Context parallelism's attention memory per rank"};
  int64_t tokens = 8192, heads = 8, head_dim = 64;
  int threads = 1;
  app.add_option("--tokens", tokens);
  app.add_option("--heads", heads);
  app.add_option("--head-dim", head_dim);
  app.add_option("--threads", threads);
  CLI11_PARSE(app, argc, argv);
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
  torch::set_num_threads(threads);
  for (const std::string method : {"ring", "allgather", "ulysses"}) {
    for (int ranks : {1, 2, 4}) {
      if (ranks == 1 && method != "ring") continue;  // (one rank: the same attention)
      std::vector<int64_t> above(ranks, 0);
      std::vector<double> seconds(ranks, 0);
      const int port = dtrain::free_port();
      std::vector<std::thread> workers;
      for (int rank = 0; rank < ranks; ++rank) {
        workers.emplace_back([&, rank] {
          current_rank = rank;
          dtrain::comm::CommunicatorPtr group;
          if (ranks > 1) {
            dtrain::comm::InitOptions options;
            options.rank = rank;
            options.world_size = ranks;
            options.master_port = port;
            options.timeout = std::chrono::minutes(10);
            options.backend_threads = 1;
            group = dtrain::comm::init(options);
          }
          const at::Tensor positions =
              dtrain::nn::context::split_positions(tokens, ranks, rank, true);
          const int64_t local = tokens / ranks;
          at::Generator g = at::detail::createCPUGenerator(rank + 1);
          auto draw = [&] {
            return at::randn({1, heads, local, head_dim}, g, at::kFloat).requires_grad_(true);
          };
          const at::Tensor q = draw(), k = draw(), v = draw();
          const at::Tensor upstream = at::randn({1, heads, local, head_dim}, g, at::kFloat);
          if (group) group->barrier()->wait();
          const int64_t base = RankAllocator::in_use()[rank].load();
          RankAllocator::peak()[rank] = base;
          const auto start = std::chrono::steady_clock::now();
          {
            const at::Tensor out =
                dtrain::nn::context::causal_attention(q, k, v, positions, group, method);
            out.backward(upstream);
          }
          seconds[rank] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          above[rank] = RankAllocator::peak()[rank].load() - base;
          if (group) group->barrier()->wait();
        });
      }
      for (auto& worker : workers) worker.join();
      int64_t most = 0;
      double slowest = 0;
      for (int r = 0; r < ranks; ++r)
        most = std::max(most, above[r]), slowest = std::max(slowest, seconds[r]);
      std::printf(
          "{\"method\": \"%s\", \"ranks\": %d, \"tokens\": %lld, \"heads\": %lld, \"head_dim\": "
          "%lld, "
          "\"peak_bytes_per_rank\": %lld, \"seconds\": %.3f}\n",
          method.c_str(), ranks, static_cast<long long>(tokens), static_cast<long long>(heads),
          static_cast<long long>(head_dim), static_cast<long long>(most), slowest);
      std::fflush(stdout);
    }
  }
  return 0;
}
