// One rank of the setup-memory benchmark (start it with `dtrain launch`): builds a decoder whole
// or as placeholders (nn/DeferredInit.h), sets a layout up over the ranks (ZeRO-3 by default;
// --tp, --pp and --strategy for tensor and pipeline parallelism and their data parallelism), and
// writes this rank's peak resident memory during the build and setup (from the resident memory
// just before it; with --load, the checkpoint's reading included), what it keeps afterwards, and
// the model's, the largest parameter's and the rank's parameters' sizes, as one JSON line to
// --out.RANK. bench/zero/run_setup_memory.py and run_layout_setup_memory.py run it.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "BenchMemory.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"

using namespace dtrain;
using namespace dtrain::bench;

int main(int argc, char** argv) {
  CLI::App app{"dtrain setup-memory benchmark (one rank; start with dtrain launch)"};
  models::ModelSpec spec;
  spec.name = "llama";
  // llama-1b's shape (configs/llama-1b.toml) unless told.
  spec.gpt.vocab = 128256;
  spec.gpt.width = 2048;
  spec.gpt.layers = 16;
  spec.gpt.heads = 32;
  spec.gpt.kv_heads = 8;
  spec.gpt.ffn_width = 8192;
  spec.gpt.context = 2048;
  std::string mode = "placeholders", out;
  int threads = 1;
  int64_t step_tokens = 128;
  int steps = 1;
  std::string offload = "none";
  int64_t offload_bucket_mb = 64;
  app.add_option("--mode", mode, "whole (every rank builds the model) or placeholders")
      ->check(CLI::IsMember({"whole", "placeholders"}));
  app.add_option("--layers", spec.gpt.layers)->capture_default_str();
  app.add_option("--width", spec.gpt.width)->capture_default_str();
  app.add_option("--heads", spec.gpt.heads)->capture_default_str();
  app.add_option("--kv-heads", spec.gpt.kv_heads)->capture_default_str();
  app.add_option("--ffn-width", spec.gpt.ffn_width)->capture_default_str();
  app.add_option("--vocab", spec.gpt.vocab)->capture_default_str();
  app.add_option("--threads", threads)->capture_default_str();
  app.add_option("--step-tokens", step_tokens,
                 "Then one Adam step on a sequence of this many tokens (0: none)")
      ->capture_default_str();
  app.add_option("--steps", steps, "Adam steps (the peak covers them all)")->capture_default_str();
  app.add_option("--offload", offload, "none, optimizer or optimizer:DIR (dtrain train's flag)")
      ->capture_default_str();
  app.add_option("--offload-bucket-mb", offload_bucket_mb)->capture_default_str();
  std::string precision = "fp32";
  app.add_option("--precision", precision, "dtrain train's --precision (fp32, bf16-master, ...)")
      ->capture_default_str();
  int tp = 1, pp = 1;
  std::string strategy_name = "zero3", load, load_how = "resume", save;
  app.add_option("--tp", tp, "Tensor-parallel ranks")->capture_default_str();
  app.add_option("--pp", pp, "Pipeline stages (each rank's data parallelism: --strategy)")
      ->capture_default_str();
  app.add_option("--strategy", strategy_name, "zero3, ddp or zero1")->capture_default_str();
  app.add_option("--load", load, "After setup, read this checkpoint (counted in the setup peak)");
  app.add_option("--load-how", load_how,
                 "resume (Strategy::load: values and optimizer state) or init (--init-from: "
                 "the values alone)")
      ->check(CLI::IsMember({"resume", "init"}))
      ->capture_default_str();
  app.add_option("--save", save, "After the steps, write a checkpoint here");
  app.add_option("--out", out, "Write this rank's JSON line to OUT.RANK")->required();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);

  auto world = launch::init_from_env();
  const auto grid = std::make_shared<comm::ProcessGrid>(world, tp, pp);
  parallel::StrategyOptions options;
  options.precision = precision;
  if (pp > 1) {
    options.of<parallel::pipeline::PipelineOptions>().data_parallel = strategy_name;
    // (one micro-batch per step: the step is not what is measured here)
    options.of<parallel::pipeline::PipelineOptions>().schedule = "gpipe";
  }
  const std::string running = pp > 1 ? "pipeline" : strategy_name;
  const auto strategy = parallel::make_strategy(running, options);
  spec.deferred = mode == "placeholders";
  world->barrier()->wait();
  reset_peak();
  const double before_mb = rss_mb();
  const auto started = std::chrono::steady_clock::now();
  torch::manual_seed(1);
  Model model = models::make_model(spec, grid->tp());
  const int64_t largest = model.deferred ? model.deferred->largest_numel() : [&] {
    int64_t most = 0;
    for (const auto& p : model.module->parameters()) most = std::max(most, p.numel());
    return most;
  }();
  // As the Trainer does: a strategy that draws what it keeps gets the placeholders, any other
  // the whole model (a tensor-parallel rank's blocks of it).
  if (model.deferred && !parallel::strategy_info(running).draws_deferred) {
    model.deferred->materialize_all();
  }
  const parallel::LossFn loss = model.loss ? parallel::LossFn(model.loss) : parallel::cross_entropy;
  optim::OptimizerSpec adam;
  adam.name = "adam";
  adam.offload = offload;
  adam.offload_bucket_mb = offload_bucket_mb;
  strategy->setup(std::move(model), optim::optimizer_factory(adam), grid);
  if (!load.empty()) {
    if (load_how == "resume") {
      strategy->load(load);
    } else {
      strategy->load_values(load);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const double peak_mb = status_mb("VmHWM:") - before_mb;
  const double kept_mb = rss_mb() - before_mb;
  // One training step (Adam's state appears; gradients get their memory): its peak, from the
  // same starting point.
  double step_peak_mb = 0;
  std::string losses, step_seconds;
  if (step_tokens > 0) {
    reset_peak();
    at::Generator generator = at::detail::createCPUGenerator(world->rank() + 1);
    for (int step = 0; step < steps; ++step) {
      const at::Tensor ids =
          at::randint(spec.gpt.vocab, {1, step_tokens + 1}, generator, at::kLong);
      const data::Batch batch{ids.narrow(1, 0, step_tokens), ids.narrow(1, 1, step_tokens)};
      const auto begun = std::chrono::steady_clock::now();
      const parallel::StepResult result = strategy->train_step({batch}, loss);
      char value[64];
      std::snprintf(value, sizeof value, "%s%.9g", losses.empty() ? "" : ", ", result.loss);
      losses += value;
      std::snprintf(
          value, sizeof value, "%s%.3f", step_seconds.empty() ? "" : ", ",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begun).count());
      step_seconds += value;
    }
    step_peak_mb = status_mb("VmHWM:") - before_mb;
  }
  if (!save.empty()) {
    world->barrier()->wait();
    strategy->save(save);
    world->barrier()->wait();
  }
  const parallel::MemoryReport memory = strategy->memory_report();
  const double model_mb =
      static_cast<double>(models::gpt_parameter_count(models::decoder_config(spec))) * 4 / 1048576;
  std::ofstream file(out + "." + std::to_string(world->rank()));
  char line[1024];
  std::snprintf(line, sizeof line,
                "{\"rank\": %d, \"world\": %d, \"mode\": \"%s\", \"layers\": %lld, \"setup_s\": "
                "%.2f, \"peak_mb\": %.1f, \"kept_mb\": %.1f, \"model_mb\": %.1f, "
                "\"largest_parameter_mb\": %.1f, \"shard_mb\": %.1f, \"gradient_shard_mb\": "
                "%.1f, \"step_peak_mb\": %.1f, \"offload\": \"%s\", \"width\": %lld, "
                "\"parameters\": %lld, \"optimizer_resident_mb\": %.1f, \"tp\": %d, \"pp\": "
                "%d, \"strategy\": \"%s\", \"load\": \"%s\", \"precision\": \"%s\"",
                world->rank(), world->size(), mode.c_str(), static_cast<long long>(spec.gpt.layers),
                seconds, peak_mb, kept_mb, model_mb, static_cast<double>(largest) * 4 / 1048576,
                memory.parameter_bytes / 1048576.0, memory.gradient_bytes / 1048576.0, step_peak_mb,
                offload.c_str(), static_cast<long long>(spec.gpt.width),
                static_cast<long long>(models::gpt_parameter_count(models::decoder_config(spec))),
                memory.optimizer_bytes / 1048576.0, tp, pp, strategy_name.c_str(),
                load.empty() ? "" : load_how.c_str(), precision.c_str());
  file << line << ", \"losses\": [" << losses << "], \"step_s\": [" << step_seconds << "]}\n";
  world->barrier()->wait();
  return 0;
}
