// One rank of the pipeline benchmark (start it with `dtrain launch`; P = the world size), or with
// --single one process training the same model without a pipeline. The model: `--layers` equal
// Linear(width, width) + ReLU layers, so compute dominates. Per step: wall time; the bubble from
// the trace (each rank's idle share between the first and last forward or backward of the step
// on any rank), next to (P-1)/(VM+P-1); and each rank's activation peak: bytes in use (counted
// by a wrapper around LibTorch's CPU allocator) after a forward, above the step's start. Rank 0
// prints one JSON line.
#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include "BenchMemory.h"
#include "dtrain/common/Model.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/WeightGrad.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "parallel/pipeline/PipelineStrategy.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;
using bench::median;

namespace {

Model wide_mlp(int64_t width, int layers) {
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::Functional(torch::relu));
  }
  // One stage per Linear + ReLU pair.
  Model model = sequential_model(net);
  std::vector<Stage> stages;
  for (size_t i = 0; i + 1 < model.stages.size(); i += 2) {
    Stage stage;
    stage.name = model.stages[i].name;
    stage.modules = model.stages[i].modules;
    // Through nn::linear, as the Zoo's models: zero-bubble schedules defer its weight gradient.
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(model.stages[i].modules[0]);
    auto relu = model.stages[i + 1].forward;
    stage.forward = [linear, relu](const at::Tensor& x) {
      return relu(dtrain::nn::linear(x, linear->weight, linear->bias));
    };
    stages.push_back(stage);
  }
  model.stages = stages;
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain pipeline benchmark (one rank; start with dtrain launch, or --single)"};
  std::string schedule = "1f1b";
  int micro = 8, chunks = 1, layers = 8, steps = 6, warmup = 2, threads = 1;
  int64_t width = 2048, global_batch = 128;
  bool single = false;
  std::string trace_path;
  std::string transport = "auto";
  bool input_grad = true;
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v")->capture_default_str();
  app.add_option("--micro-batches", micro, "M")->capture_default_str();
  app.add_option("--virtual-stages", chunks, "V (interleaved)")->capture_default_str();
  app.add_option("--layers", layers, "Linear layers")->capture_default_str();
  app.add_option("--width", width, "Layer width")->capture_default_str();
  app.add_option("--global-batch", global_batch, "Examples per step")->capture_default_str();
  app.add_option("--steps", steps, "Measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured steps first")->capture_default_str();
  app.add_flag("--single", single, "One process, no pipeline (the baseline)");
  app.add_option("--threads", threads, "--single: intra-op threads")->capture_default_str();
  app.add_flag("--input-grad,!--no-input-grad", input_grad,
               "Inputs require a gradient, so every stage does equal work (default on)");
  app.add_option("--pipeline-transport", transport,
                 "auto (shared memory between the two local ranks) or comm (Gloo)")
      ->capture_default_str();
  app.add_option("--trace", trace_path, "Write the last measured step's trace (Chrome JSON)");
  std::string sync = "flush";
  bool continuous = false;
  app.add_option("--pipeline-sync", sync, "flush, 2bw (PipeDream-2BW), eager or async")
      ->capture_default_str();
  app.add_flag("--continuous", continuous,
               "Time the measured steps back to back (no barrier or collective between them: "
               "a pipeline without a flush overlaps one step with the next); the bubble and "
               "the activation peak over the whole run");
  CLI11_PARSE(app, argc, argv);

  static bench::CountingAllocator counting;
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  torch::manual_seed(0);
  Model model = wide_mlp(width, layers);
  // The inputs ask for a gradient so that every layer does the same backward work (else the first
  // stage skips one of its layers' input gradients, ~8% of its work at 8 layers on 2 stages: an
  // imbalance the bubble formula does not model); --no-input-grad measures the plain model.
  const auto inputs = torch::randn({global_batch, width});
  const auto targets = torch::randint(width, {global_batch});
  std::vector<data::Batch> micro_batches;
  const int64_t each = global_batch / micro;
  for (int m = 0; m < micro; ++m) {
    micro_batches.push_back({inputs.narrow(0, m * each, each).clone().requires_grad_(input_grad),
                             targets.narrow(0, m * each, each)});
  }
  optim::OptimizerSpec sgd;
  sgd.name = "sgd";
  sgd.lr = 1e-4;  // plain SGD: no optimizer temporaries in the memory figures

  if (single) {
    launch::tune_allocator();  // as launch::init_from_env does for the pipeline's ranks
    at::set_num_threads(threads);
    auto optimizer = optim::make_optimizer(model.module->parameters(), sgd);
    std::vector<double> times;
    for (int step = 0; step < warmup + steps; ++step) {
      const auto start = Clock::now();
      optimizer->zero_grad();
      for (const auto& batch : micro_batches) {
        (parallel::cross_entropy(model(batch.inputs), batch.targets) / micro).backward();
      }
      optimizer->step();
      if (step >= warmup) {
        times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      }
    }
    const double ms = median(times);
    std::printf(
        "{\"mode\": \"single\", \"threads\": %d, \"M\": %d, \"step_ms\": %.3f, "
        "\"samples_per_s\": %.1f}\n",
        threads, micro, ms, global_batch / ms * 1e3);
    return 0;
  }

  auto world = launch::init_from_env();
  const int P = world->size();
  auto grid = std::make_shared<comm::ProcessGrid>(world, 1, P);
  parallel::StrategyOptions options;
  options.of<dtrain::parallel::pipeline::PipelineOptions>().schedule = schedule;
  options.of<dtrain::parallel::pipeline::PipelineOptions>().virtual_stages = chunks;
  options.of<dtrain::parallel::pipeline::PipelineOptions>().transport = transport;
  options.of<dtrain::parallel::pipeline::PipelineOptions>().sync = sync;
  parallel::pipeline::PipelineStrategy strategy(options);
  strategy.setup(model, optim::optimizer_factory(sgd), grid);
  int64_t base = 0, peak = 0;
  // After every action (under 1F1B and GPipe the peak follows a forward; under zero bubble
  // the W's inputs and output gradients are held past their B).
  strategy.set_action_observer([&](const parallel::pipeline::Action&) {
    peak = std::max(peak, bench::CountingAllocator::bytes_in_use() - base);
  });

  // The traced compute window over all ranks (first to last compute span) and each rank's busy
  // time in it: the ranks' mean idle share; and each stage's activation peak (MB).
  auto measured_window = [&](at::Tensor& peaks_all) {
    double first = 1e300, last = -1e300, busy = 0;
    for (const auto& e : trace::events()) {
      if (e.category != "forward" && e.category != "backward" && e.category != "weight") continue;
      first = std::min(first, static_cast<double>(e.start_us));
      last = std::max(last, static_cast<double>(e.start_us + e.duration_us));
      busy += static_cast<double>(e.duration_us);
    }
    at::Tensor lo = at::tensor({first}, at::kDouble), hi = at::tensor({last}, at::kDouble);
    world->allreduce(lo, {comm::ReduceOp::Min})->wait();
    world->allreduce(hi, {comm::ReduceOp::Max})->wait();
    at::Tensor idle =
        at::tensor({1.0 - busy / (hi.item<double>() - lo.item<double>())}, at::kDouble);
    world->allreduce(idle, {comm::ReduceOp::Avg})->wait();
    peaks_all = at::zeros({P}, at::kDouble);
    peaks_all[grid->coordinates().pp] = static_cast<double>(peak) / (1 << 20);
    world->allreduce(peaks_all)->wait();
    return idle;
  };

  if (continuous) {
    for (int step = 0; step < warmup; ++step) {
      strategy.train_step(micro_batches, parallel::cross_entropy);
    }
    world->barrier()->wait();
    base = bench::CountingAllocator::bytes_in_use();
    peak = 0;
    trace::start();
    const auto start = Clock::now();
    for (int step = 0; step < steps; ++step) {
      strategy.train_step(micro_batches, parallel::cross_entropy);
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    trace::stop();
    at::Tensor peaks_all;
    const at::Tensor idle = measured_window(peaks_all);
    // Everything the rank holds at its fullest (weights, their versions, gradients, optimizer
    // state, activations): the relative peak above misses memory freed and taken again.
    at::Tensor held = at::zeros({P}, at::kDouble);
    held[grid->coordinates().pp] = static_cast<double>(base + peak) / (1 << 20);
    world->allreduce(held)->wait();
    at::Tensor total = at::tensor({ms}, at::kDouble);
    world->allreduce(total, {comm::ReduceOp::Max})->wait();
    parallel::StepResult last_step;
    strategy.finish_training(last_step);
    if (world->rank() == 0) {
      const double per_step = total.item<double>() / steps;
      std::printf(
          "{\"mode\": \"pipeline\", \"schedule\": \"%s\", \"sync\": \"%s\", "
          "\"continuous\": true, \"P\": %d, \"M\": %d, \"step_ms\": %.3f, "
          "\"samples_per_s\": %.1f, \"bubble\": %.4f, \"act_peak_mb_first\": %.3f, "
          "\"act_peak_mb_last\": %.3f, \"held_peak_mb_first\": %.1f, "
          "\"held_peak_mb_last\": %.1f}\n",
          schedule.c_str(), sync.c_str(), P, micro, per_step, global_batch / per_step * 1e3,
          idle.item<double>(), peaks_all[0].item<double>(), peaks_all[P - 1].item<double>(),
          held[0].item<double>(), held[P - 1].item<double>());
    }
    return 0;
  }

  std::vector<double> times, bubbles, peaks;
  bool peak_reset = false;
  for (int step = 0; step < warmup + steps; ++step) {
    const bool measured = step >= warmup;
    if (step == warmup) peak_reset = bench::reset_peak();  // the measured steps' own RSS peak
    if (measured) trace::start();
    world->barrier()->wait();
    base = bench::CountingAllocator::bytes_in_use();
    peak = 0;
    const auto start = Clock::now();
    strategy.train_step(micro_batches, parallel::cross_entropy);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    if (!measured) continue;
    trace::stop();
    at::Tensor peaks_all;
    const at::Tensor idle = measured_window(peaks_all);
    at::Tensor step_ms = at::tensor({ms}, at::kDouble);
    world->allreduce(step_ms, {comm::ReduceOp::Max})->wait();
    times.push_back(step_ms.item<double>());
    bubbles.push_back(idle.item<double>());
    peaks.push_back(peaks_all[0].item<double>());
    peaks.push_back(peaks_all[P - 1].item<double>());
  }
  at::Tensor step_rss = at::tensor({peak_reset ? bench::status_mb("VmHWM:") : -1.0}, at::kDouble);
  world->allreduce(step_rss, {comm::ReduceOp::Max})->wait();  // the largest rank's
  if (!trace_path.empty()) {
    const auto fragments =
        comm::allgather_strings(*world, trace::to_json_events(trace::events(), world->rank()));
    if (world->rank() == 0) {
      std::ofstream(trace_path) << trace::trace_file(fragments);
    }
  }
  if (world->rank() == 0) {
    std::vector<double> first_stage, last_stage;
    for (size_t i = 0; i < peaks.size(); i += 2) {
      first_stage.push_back(peaks[i]);
      last_stage.push_back(peaks[i + 1]);
    }
    // The ideal timeline's bubble (equal stages, backward = 2 forwards; split: B = W = F):
    // (P-1)/(VM+P-1) for GPipe and the 1F1Bs, the simulated lists' for zero bubble.
    const parallel::pipeline::ScheduleSpec spec{schedule, P, micro,
                                                parallel::pipeline::chunks_of(schedule, chunks)};
    std::vector<std::vector<parallel::pipeline::Action>> lists;
    for (int r = 0; r < P; ++r) lists.push_back(parallel::pipeline::build_schedule(spec, r));
    const double formula = parallel::pipeline::simulate(spec, lists).bubble();
    const double ms = median(times);
    std::printf(
        "{\"mode\": \"pipeline\", \"schedule\": \"%s\", \"P\": %d, \"M\": %d, \"V\": %d, "
        "\"step_ms\": %.3f, \"samples_per_s\": %.1f, \"bubble\": %.4f, "
        "\"bubble_formula\": %.4f, \"act_peak_mb_first\": %.3f, "
        "\"act_peak_mb_last\": %.3f, \"step_peak_rss_mb\": %.1f}\n",
        schedule.c_str(), P, micro, spec.chunks, ms, global_batch / ms * 1e3, median(bubbles), formula,
        median(first_stage), median(last_stage), step_rss.item<double>());
  }
  return 0;
}
