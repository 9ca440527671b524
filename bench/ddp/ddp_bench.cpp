// One rank of the data-parallel benchmarks (start it with `dtrain launch`): times full training
// steps of a strategy (ddp, zero1) on the MLP or CNN with synthetic data, the communication left
// exposed after backward, the same gradient allreduces run alone, and each rank's peak memory.
// Rank 0 prints one JSON line.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "BenchMemory.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/zero/Zero3Options.h"
#include "parallel/ddp/DdpStrategy.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;
using bench::median;

namespace {
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain DDP step benchmark (one rank; start with dtrain launch)"};
  std::string model = "cnn", strategy_name = "ddp", optimizer_name = "sgd";
  std::vector<int64_t> hidden{256, 256};
  int64_t batch = 64, steps = 30, warmup = 5;
  double bucket_cap_mb = 25;
  bool comm_baseline = true;
  app.add_option("--model", model, "mlp, cnn, resnet18 or resnet50")->capture_default_str();
  int64_t image_size = 28;
  app.add_option("--image-size", image_size,
                 "Square images (1 channel; 3 for torchvision's ResNets)")
      ->capture_default_str();
  app.add_option("--batch", batch, "Examples per rank per step")->capture_default_str();
  app.add_option("--steps", steps, "Measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured steps first")->capture_default_str();
  app.add_option("--bucket-cap-mb", bucket_cap_mb, "Gradient bucket cap (MiB)")
      ->capture_default_str();
  app.add_option("--strategy", strategy_name, "ddp, zero1, zero2 or zero3")->capture_default_str();
  app.add_option("--optimizer", optimizer_name, "sgd (momentum 0.9) or adam")
      ->capture_default_str();
  app.add_option("--hidden", hidden, "MLP hidden widths")->capture_default_str();
  int64_t min_unit_params = 0;
  app.add_option("--zero3-min-unit-params", min_unit_params,
                 "zero3: merge stages into units of "
                 "at least this many parameters")
      ->capture_default_str();
  app.add_flag("!--no-comm-baseline", comm_baseline, "Skip timing the allreduces alone");
  CLI11_PARSE(app, argc, argv);

  auto world = launch::init_from_env();
  torch::manual_seed(0);
  models::ModelSpec spec;
  spec.name = model;
  spec.hidden = hidden;
  const int64_t channels = model.rfind("resnet", 0) == 0 && model != "resnet" ? 3 : 1;
  spec.input_shape = {channels, image_size, image_size};
  parallel::StrategyOptions options;
  options.bucket_cap_bytes = static_cast<int64_t>(bucket_cap_mb * 1024 * 1024);
  options.of<dtrain::parallel::zero::Zero3Options>().min_unit_params = min_unit_params;
  auto strategy = parallel::make_strategy(strategy_name, options);
  auto& ddp = dynamic_cast<parallel::ddp::DdpStrategy&>(*strategy);  // ddp and zero1/2/3 all are
  optim::OptimizerSpec optimizer;
  optimizer.name = optimizer_name;
  optimizer.lr = optimizer_name == "adam" ? 1e-4 : 0.01;
  optimizer.momentum = optimizer_name == "sgd" ? 0.9 : 0.0;
  ddp.setup(models::make_model(spec), optim::optimizer_factory(optimizer),
            std::make_shared<comm::ProcessGrid>(world));
  std::vector<data::Batch> batches;
  for (int i = 0; i < 4; ++i) {
    batches.push_back(
        {torch::randn({batch, channels, image_size, image_size}), torch::randint(0, 10, {batch})});
  }
  // exposed_ms: after the LAST rank's backward ends, how long until the gradients are reduced;
  // the earlier ranks wait longer, but that extra wait is load imbalance, reported as skew_ms.
  std::vector<double> step_ms, exposed_ms, skew_ms;
  double transient_mb = 0;  // zero3: most gathered parameters + unsharded gradients at once
  bool peak_reset = false;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup) peak_reset = bench::reset_peak();  // the measured steps' own peak from here
    world->barrier()->wait();  // start every step together, as a synchronized job does
    const auto start = Clock::now();
    auto result = ddp.train_step({batches[i % batches.size()]}, parallel::cross_entropy);
    const double elapsed = ms_since(start);
    if (i >= warmup) {
      step_ms.push_back(elapsed);
      if (result.metrics.count("peak_transient_mb")) {
        transient_mb = std::max(transient_mb, result.metrics.at("peak_transient_mb"));
      }
      const double mine = result.metrics.at("exposed_comm_ms");
      auto low = torch::full({1}, mine, torch::kDouble);
      auto high = low.clone();
      world->allreduce(low, {comm::ReduceOp::Min})->wait();
      world->allreduce(high, {comm::ReduceOp::Max})->wait();
      exposed_ms.push_back(low.item<double>());
      skew_ms.push_back(high.item<double>() - low.item<double>());
    }
  }
  // The same bucket allreduces with nothing to overlap: the communication a step must hide.
  std::vector<double> allreduce_ms;
  comm_baseline = comm_baseline && strategy_name != "zero3";  // zero3 has no parallel::ddp::Reducer
  auto buffers = comm_baseline ? ddp.reducer().bucket_buffers() : std::vector<at::Tensor>{};
  for (int64_t i = 0; comm_baseline && i < warmup + steps; ++i) {
    world->barrier()->wait();
    const auto start = Clock::now();
    std::vector<comm::WorkPtr> works;
    for (auto& buffer : buffers) works.push_back(world->allreduce(buffer));
    comm::wait_all(works);
    if (i >= warmup) allreduce_ms.push_back(ms_since(start));
  }
  // MB, max over ranks: the whole run's peak, and the measured steps' peak.
  auto peak = torch::tensor({bench::peak_rss_mb(), peak_reset ? bench::status_mb("VmHWM:") : -1.0},
                            torch::kDouble);
  world->allreduce(peak, {comm::ReduceOp::Max})->wait();
  const auto report = ddp.memory_report();
  if (world->rank() == 0) {
    const double step = median(step_ms);
    std::printf(
        "{\"impl\": \"dtrain\", \"model\": \"%s\", \"world\": %d, \"batch\": %lld, "
        "\"threads\": %d, \"buckets\": %zu, \"step_ms\": %.3f, \"samples_per_s\": %.1f, "
        "\"exposed_comm_ms\": %.3f, \"skew_ms\": %.3f, \"allreduce_ms\": %.3f, "
        "\"strategy\": \"%s\", \"peak_rss_mb\": %.1f, \"step_peak_rss_mb\": %.1f, "
        "\"param_mb\": %.1f, \"grad_mb\": %.1f, \"optimizer_mb\": %.1f, "
        "\"transient_mb\": %.1f}\n",
        model.c_str(), world->size(), static_cast<long long>(batch), at::get_num_threads(),
        buffers.size(), step, batch * world->size() * 1000.0 / step, median(exposed_ms),
        median(skew_ms), median(allreduce_ms), strategy_name.c_str(), peak[0].item<double>(),
        peak[1].item<double>(), report.parameter_bytes / 1048576.0,
        report.gradient_bytes / 1048576.0, report.optimizer_bytes / 1048576.0, transient_mb);
  }
  return 0;
}
