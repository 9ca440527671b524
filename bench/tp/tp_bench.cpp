// One rank of the tensor-parallel benchmark (start it with `dtrain launch`; T = the world size),
// or with --single one process training the same model at T = 1 (set --threads). The model: a
// stack of GPT blocks (--width, --heads, --context, --layers) with a small vocabulary, trained
// with Adam on random tokens. Per step: wall time (slowest rank); the communication share (the
// time inside the tensor-parallel collectives, from the trace, over the step); per-rank
// parameter + gradient + Adam-state bytes; and the activation peak: bytes of live tensors after
// the forward (loss computed), above the step's start (counted by a wrapper around LibTorch's
// CPU allocator). Rank 0 prints one JSON line.
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "BenchMemory.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Trace.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/optim/StateSize.h"
#include "parallel/StrategySupport.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;
using bench::median;

int main(int argc, char** argv) {
  CLI::App app{
      "dtrain tensor-parallel benchmark (one rank; start with dtrain launch, or --single)"};
  models::GptConfig config;
  config.vocab = 128;
  config.layers = 2;
  config.heads = 16;
  config.width = 1024;
  config.context = 256;
  int64_t batch = 4;
  int steps = 3, warmup = 1, threads = 1;
  bool single = false;
  app.add_option("--layers", config.layers, "GPT blocks")->capture_default_str();
  app.add_option("--width", config.width, "Model width")->capture_default_str();
  app.add_option("--heads", config.heads, "Attention heads")->capture_default_str();
  app.add_option("--context", config.context, "Sequence length")->capture_default_str();
  app.add_option("--batch", batch, "Sequences per step")->capture_default_str();
  app.add_option("--steps", steps, "Measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured steps first")->capture_default_str();
  app.add_flag("--sequence-parallel", config.sequence_parallel, "Megatron's sequence parallelism");
  app.add_flag("--tp-comm-overlap", config.tp_comm_overlap,
               "Backward's input-gradient collectives beside the weight gradients");
  app.add_flag("--single", single, "One process, T = 1 (the baseline)");
  app.add_option("--threads", threads, "--single: intra-op threads")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  static bench::CountingAllocator counting;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  comm::CommunicatorPtr world;
  if (single) {
    launch::tune_allocator();  // as launch::init_from_env does for the ranks
    at::set_num_threads(threads);
    config.sequence_parallel = false;
  } else {
    world = launch::init_from_env();
  }
  auto grid = world ? std::make_shared<comm::ProcessGrid>(world, world->size(), 1) : nullptr;
  const int T = grid ? grid->tp_size() : 1;
  torch::manual_seed(0);
  Model model = models::make_gpt(config, grid ? grid->tp() : nullptr);
  std::vector<at::Tensor> parameters;
  std::vector<std::string> names;
  for (const auto& item : model.module->named_parameters()) {
    parameters.push_back(item.value());
    names.push_back(item.key());
  }
  parallel::TensorParallelLayout layout;
  if (grid) layout = parallel::tensor_parallel_layout(*model.module, *grid);
  optim::OptimizerSpec adam;
  adam.name = "adam";
  adam.lr = 1e-4;
  auto optimizer = optim::make_optimizer(parameters, adam);
  at::Generator generator = at::detail::createCPUGenerator(1);
  const at::Tensor ids = at::randint(config.vocab, {batch, config.context}, generator, at::kLong);
  const at::Tensor targets =
      at::randint(config.vocab, {batch, config.context}, generator, at::kLong);
  auto loss_of = [&](const at::Tensor& out) {
    return model.loss ? model.loss(out, targets) : parallel::cross_entropy(out, targets);
  };

  std::vector<double> times, shares, peaks;
  bool peak_reset = false;
  for (int step = 0; step < warmup + steps; ++step) {
    const bool measured = step >= warmup;
    if (step == warmup) peak_reset = bench::reset_peak();  // the measured steps' own RSS peak
    if (world) world->barrier()->wait();
    if (measured) trace::start();
    const int64_t base = bench::CountingAllocator::bytes_in_use();
    const auto start = Clock::now();
    optimizer->zero_grad();
    at::Tensor loss = loss_of(model(ids));
    const double peak_mb =
        static_cast<double>(bench::CountingAllocator::bytes_in_use() - base) / (1 << 20);
    loss.backward();
    layout.sum_partial_gradients(parameters, names);
    optimizer->step();
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!measured) continue;
    trace::stop();
    double comm_us = 0;
    for (const auto& e : trace::events()) {
      if (e.category == "comm") comm_us += static_cast<double>(e.duration_us);
    }
    double share = comm_us / 1e3 / ms;
    if (world) {
      at::Tensor slowest = at::tensor({ms}, at::kDouble);
      world->allreduce(slowest, {comm::ReduceOp::Max})->wait();
      ms = slowest.item<double>();
      at::Tensor mean_share = at::tensor({share}, at::kDouble);
      world->allreduce(mean_share, {comm::ReduceOp::Avg})->wait();
      share = mean_share.item<double>();
    }
    times.push_back(ms);
    shares.push_back(share);
    peaks.push_back(peak_mb);
  }
  int64_t parameter_bytes = 0;
  for (const auto& p : parameters) parameter_bytes += p.numel() * p.element_size();
  const int64_t optimizer_bytes = optim::optimizer_state_bytes(*optimizer);
  at::Tensor step_rss = at::tensor({peak_reset ? bench::status_mb("VmHWM:") : -1.0}, at::kDouble);
  if (world) world->allreduce(step_rss, {comm::ReduceOp::Max})->wait();  // the largest rank's
  if (!world || world->rank() == 0) {
    const double ms = median(times);
    std::printf(
        "{\"T\": %d, \"threads\": %d, \"sequence_parallel\": %s, \"tp_comm_overlap\": %s, "
        "\"step_ms\": %.1f, "
        "\"tokens_per_s\": %.1f, \"comm_share\": %.4f, \"param_mb\": %.2f, "
        "\"grad_mb\": %.2f, \"adam_mb\": %.2f, \"model_state_mb\": %.2f, "
        "\"activation_peak_mb\": %.2f, \"step_peak_rss_mb\": %.1f}\n",
        T, single ? threads : 1, config.sequence_parallel ? "true" : "false",
        config.tp_comm_overlap ? "true" : "false", ms,
        static_cast<double>(batch * config.context) / ms * 1e3, median(shares),
        parameter_bytes / 1048576.0, parameter_bytes / 1048576.0, optimizer_bytes / 1048576.0,
        (2.0 * parameter_bytes + optimizer_bytes) / 1048576.0, median(peaks),
        step_rss.item<double>());
  }
  return 0;
}
