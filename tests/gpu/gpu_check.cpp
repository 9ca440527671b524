// The GPU checks (scripts/gpu-check): what a CPU-only CI cannot run. The NCCL communicator (world
// size 1, and every GPU where there are 2+); bf16 and fp16-mixed training of the GPT, the loss
// scaler skipping the steps that overflow; activation checkpointing's memory cut, read from the
// CUDA caching allocator's peak; DDP, PowerSGD at full rank, the hierarchical allreduce, DiLoCo
// at H = 1 (plain, streaming, zero3 islands), zero1's reduce-scatter, zero2's overlapped
// parameter gathers and quantized zero3 over ranks sharing the GPU through
// Gloo against one process on the same global batch (float64); and the GPT's step time against the
// same model in PyTorch on the same GPU (bench/gpu/gpt_step_reference.py, alternated rounds).
//
// Every check runs in processes of its own, forked before anything touches CUDA, and writes one
// JSON line to --out. --device cpu runs those that need no GPU on the CPU at small sizes (CI runs
// it so that this program stays right between the GPU machine's visits).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "CheckSupport.h"
#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/diloco/DilocoOptions.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"
#include "dtrain/parallel/zero/ZeroQuantizedOptions.h"
#include "dtrain/train/Trainer.h"

using namespace dtrain;
using namespace dtrain::gpu_check;

namespace {

// ---- the checks ----

std::string check_communicator(int rank, int size, int port) {
  const std::string backend = on_gpu() ? "nccl" : "gloo";
  const auto world = world_of(rank, size, port, backend);
  const c10::Device device = resolve_device(settings.device, rank);
  const auto options = at::TensorOptions(at::kFloat).device(device);
  const double n = size;
  // allreduce: sum and average
  at::Tensor x = at::full({1000}, rank + 1.0, options);
  world->allreduce(x)->wait();
  CHECK_THAT(x.eq(n * (n + 1) / 2).all().item<bool>(), "allreduce sum ", x[0].item<double>());
  at::Tensor y = at::full({10}, rank + 1.0, options);
  world->allreduce(y, {comm::ReduceOp::Avg})->wait();
  CHECK_THAT(std::abs(y[0].item<double>() - (n + 1) / 2) < 1e-6, "allreduce avg");
  // broadcast
  at::Tensor b = rank == 0 ? at::arange(100, options) : at::zeros({100}, options);
  world->broadcast(b, {0})->wait();
  CHECK_THAT(b.equal(at::arange(100, options)), "broadcast");
  // uneven allgather and reduce-scatter (ZeRO's shards)
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int r = 0; r < size; ++r) counts.push_back(r + 3), total += r + 3;
  at::Tensor gathered = at::zeros({total}, options);
  world->allgather(gathered, at::full({counts[rank]}, static_cast<double>(rank), options), {counts})
      ->wait();
  int64_t offset = 0;
  for (int r = 0; r < size; ++r) {
    CHECK_THAT(gathered.narrow(0, offset, counts[r]).eq(r).all().item<bool>(), "allgather");
    offset += counts[r];
  }
  at::Tensor mine = at::zeros({counts[rank]}, options);
  comm::ReduceScatterOptions scatter;
  scatter.counts = counts;
  world->reduce_scatter(mine, at::full({total}, rank + 1.0, options), scatter)->wait();
  CHECK_THAT(mine.eq(n * (n + 1) / 2).all().item<bool>(), "reduce_scatter");
  // all-to-all with variable splits (a mixture of experts' dispatch): rank r sends r + j + 1
  // elements of value 100 r + j to rank j
  comm::AllToAllOptions exchange;
  int64_t sent = 0, received = 0;
  for (int j = 0; j < size; ++j) {
    exchange.send_counts.push_back(rank + j + 1);
    exchange.recv_counts.push_back(j + rank + 1);
    sent += rank + j + 1;
    received += j + rank + 1;
  }
  std::vector<at::Tensor> parts;
  for (int j = 0; j < size; ++j)
    parts.push_back(at::full({rank + j + 1}, 100.0 * rank + j, options));
  at::Tensor arrived = at::zeros({received}, options);
  world->all_to_all(arrived, at::cat(parts), exchange)->wait();
  offset = 0;
  for (int i = 0; i < size; ++i) {
    CHECK_THAT(arrived.narrow(0, offset, i + rank + 1).eq(100.0 * i + rank).all().item<bool>(),
               "all_to_all from rank ", i);
    offset += i + rank + 1;
  }
  (void)sent;
  // a CPU tensor on the same communicator (a step's loss): its Gloo side
  at::Tensor loss = at::full({1}, rank + 1.0, at::kDouble);
  world->allreduce(loss)->wait();
  CHECK_THAT(loss.item<double>() == n * (n + 1) / 2, "CPU tensor allreduce");
  world->barrier()->wait();
  return Record()
      .add("check", "communicator")
      .add("backend", backend)
      .add("world_size", n)
      .add("passed", 1.0)
      .json();
}

// bf16-mixed, bf16-master or fp16-mixed training of a small GPT: the loss falls; under fp16 a
// huge first loss scale overflows, the scaler skips those steps (parameters untouched) and backs
// off.
std::string check_precision(const std::string& precision) {
  const auto world = world_of(0, 1, free_port(), "gloo");
  const c10::Device device = resolve_device(settings.device, 0);
  const int64_t context = 32, vocab = 64;
  parallel::StrategyOptions options;
  options.precision = precision;
  options.loss_scale_init = std::ldexp(1.0, 40);  // overflows fp16 gradients at once
  options.loss_scale_growth_interval = 1000;
  Trained t = make_trained(gpt_spec(2, 128, 4, context, vocab), options, world);
  const auto data = token_data(2048, context, vocab, 7);
  std::vector<double> losses;
  double skipped = 0, scale = 0;
  bool checked_skip = false;
  for (int64_t step = 0; step < 150; ++step) {
    std::vector<at::Tensor> before;
    if (!checked_skip) {
      for (const auto& p : t.strategy->model().module->parameters()) before.push_back(p.clone());
    }
    const auto result = t.strategy->train_step(batch_of(data, step, 32, device), t.loss);
    const bool skipped_now =
        result.metrics.count("step_skipped") && result.metrics.at("step_skipped") > 0;
    if (skipped_now && !checked_skip) {  // a skipped step leaves every parameter as it was
      const auto after = t.strategy->model().module->parameters();
      for (size_t i = 0; i < after.size(); ++i) {
        CHECK_THAT(after[i].equal(before[i]), "a skipped step changed parameter ", i);
      }
      checked_skip = true;
    }
    if (!skipped_now) losses.push_back(result.loss);
    if (result.metrics.count("skipped_steps")) skipped = result.metrics.at("skipped_steps");
    if (result.metrics.count("loss_scale")) scale = result.metrics.at("loss_scale");
  }
  CHECK_THAT(losses.size() >= 20, "only ", losses.size(), " steps were not skipped");
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += losses[i] / 5, last += losses[losses.size() - 1 - i] / 5;
  CHECK_THAT(std::isfinite(last) && last < 0.5 * first, "loss ", first, " -> ", last);
  if (precision == "fp16-mixed") {
    CHECK_THAT(skipped >= 1 && checked_skip, "fp16-mixed skipped no step at loss scale 2^40");
    CHECK_THAT(scale < std::ldexp(1.0, 40), "the loss scale did not back off: ", scale);
  }
  return Record()
      .add("check", "precision")
      .add("precision", precision)
      .add("first_loss", first)
      .add("last_loss", last)
      .add("skipped_steps", skipped)
      .add("final_loss_scale", scale)
      .add("passed", 1.0)
      .json();
}

// The peak of the caching allocator over one training step, with and without checkpointing.
std::string check_checkpointing_memory() {
  const auto world = world_of(0, 1, free_port(), "gloo");
  const c10::Device device = resolve_device(settings.device, 0);
  const int64_t layers = 8, width = 512, heads = 8, context = 256, vocab = 256, batch = 16;
  const auto data = token_data(256, context, vocab, 3);
  std::map<std::string, double> peak_mb;
  for (const std::string mode : {"none", "sqrt"}) {
    Trained t = make_trained(gpt_spec(layers, width, heads, context, vocab, mode), {}, world);
    for (int step = 0; step < 2; ++step)
      t.strategy->train_step(batch_of(data, step, batch, device), t.loss);
    synchronize();
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    const double resident = static_cast<double>(
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
            .allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
            .current);
    t.strategy->train_step(batch_of(data, 2, batch, device), t.loss);
    synchronize();
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const double peak = static_cast<double>(
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
            .peak);
    peak_mb[mode] = (peak - resident) / (1 << 20);  // what the step adds to the resident state
  }
  const double ratio = peak_mb["sqrt"] / peak_mb["none"];
  CHECK_THAT(ratio < 0.7, "checkpointing cut the step's peak only to ", ratio, " of it");
  return Record()
      .add("check", "checkpointing_memory")
      .add("gpt", std::to_string(layers) + "x" + std::to_string(width) + ", context " +
                      std::to_string(context) + ", batch " + std::to_string(batch))
      .add("step_peak_mb_none", peak_mb["none"])
      .add("step_peak_mb_sqrt", peak_mb["sqrt"])
      .add("ratio", ratio)
      .add("passed", 1.0)
      .json();
}

// `strategy` over `ranks` ranks (Gloo, all on this device) through the Trainer, in float64: the
// losses of 8 steps of the GPT on a global batch of 16.
using Configure = std::function<void(train::TrainerOptions&)>;
std::vector<double> distributed_losses(int rank, int ranks, int port, const Configure& configure) {
  const auto world = world_of(rank, ranks, port, "gloo");
  train::TrainerOptions o;
  o.strategy = "ddp";
  o.strategy_options.device = settings.device == "cpu" ? "cpu" : "cuda:0";  // shared
  o.batch_size = 16 / ranks;
  o.max_steps = 8;
  o.optimizer.name = "adamw";
  o.optimizer.lr = 1e-3;
  o.seed = 5;
  o.progress = false;
  if (configure) configure(o);
  const auto data = token_data(256, 16, 32, 11);  // token ids; the model is float64
  train::Trainer trainer(o, world);
  torch::manual_seed(2);
  Model model = models::make_model(gpt_spec(2, 64, 4, 16, 32));
  model.module->to(at::kDouble);
  // The mean over the ranks: DiLoCo's islands each report their own half of the batch.
  const std::vector<double> losses = trainer.fit(model, data).losses;
  at::Tensor mean = at::tensor(losses, at::kDouble);
  world->allreduce(mean, {comm::ReduceOp::Avg})->wait();
  return std::vector<double>(mean.data_ptr<double>(), mean.data_ptr<double>() + mean.numel());
}

std::string losses_text(const std::vector<double>& losses) {
  std::ostringstream s;
  s.precision(17);
  for (double l : losses) s << l << " ";
  return s.str();
}

// The one-process DDP run's losses (the oracle) with `optimizer`, once per program.
const std::string& oracle_losses(const std::string& optimizer) {
  static std::map<std::string, std::string> runs;
  std::string& one = runs[optimizer];
  if (one.empty()) {
    CHECK_THAT(
        in_processes(
            1,
            [&](int r, int port) {
              return losses_text(distributed_losses(
                  r, 1, port, [&](train::TrainerOptions& o) { o.optimizer.name = optimizer; }));
            },
            &one),
        "the one-process run failed");
  }
  return one;
}

// `ranks` ranks configured by `configure` against the one-process run: the largest relative loss
// difference over the 8 steps must stay under `bound`.
std::string check_against_one_process(const std::string& name, int ranks,
                                      const Configure& configure, double bound,
                                      const std::string& optimizer = "adamw") {
  std::string many;
  CHECK_THAT(in_processes(
                 ranks,
                 [&](int r, int port) {
                   return losses_text(distributed_losses(r, ranks, port, [&](auto& o) {
                     o.optimizer.name = optimizer;
                     if (configure) configure(o);
                   }));
                 },
                 &many),
             "the ", ranks, "-rank run failed");
  std::istringstream a(oracle_losses(optimizer)), b(many);
  double x = 0, y = 0, worst = 0;
  int steps = 0;
  while (a >> x && b >> y) worst = std::max(worst, std::abs(x - y) / std::abs(x)), ++steps;
  CHECK_THAT(steps == 8 && worst < bound, steps, " steps, largest relative loss difference ", worst,
             " (bound ", bound, ")");
  return Record()
      .add("check", name)
      .add("device", settings.device == "cpu" ? "cpu" : "cuda:0 (every rank)")
      .add("ranks", ranks)
      .add("steps", steps)
      .add("max_relative_loss_difference", worst)
      .add("bound", bound)
      .add("optimizer", optimizer)
      .add("passed", 1.0)
      .json();
}

struct StepConfig {
  int64_t layers, width, heads, context, vocab, batch;
  int warmup, steps;
};

StepConfig step_config() {
  if (on_gpu()) return {12, 768, 12, 512, 512, 16, 5, 30};
  return {2, 64, 4, 32, 64, 8, 2, 5};
}

// Median step time of dtrain's ddp (one rank) on the GPT, synchronized at every step's end.
double dtrain_step_ms(const std::string& precision) {
  const StepConfig c = step_config();
  if (!on_gpu()) at::set_num_threads(1);  // as the PyTorch side in the CPU mode
  const auto world = world_of(0, 1, free_port(), "gloo");
  const c10::Device device = resolve_device(settings.device, 0);
  parallel::StrategyOptions options;
  options.precision = precision;
  options.broadcast_buffers = false;
  Trained t =
      make_trained(gpt_spec(c.layers, c.width, c.heads, c.context, c.vocab), options, world, 3e-4);
  const auto data = token_data(c.batch * 4, c.context, c.vocab, 13);
  std::vector<double> times;
  for (int i = 0; i < c.warmup + c.steps; ++i) {
    const auto batches = batch_of(data, i, c.batch, device);
    synchronize();
    const auto start = std::chrono::steady_clock::now();
    t.strategy->train_step(batches, t.loss);
    synchronize();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= c.warmup) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double pytorch_step_ms(const std::string& precision) {
  const StepConfig c = step_config();
  const std::string command =
      settings.python + " " + settings.source_dir + "/bench/gpu/gpt_step_reference.py --device " +
      (on_gpu() ? "cuda" : "cpu") + " --precision " + precision + " --layers " +
      std::to_string(c.layers) + " --width " + std::to_string(c.width) + " --heads " +
      std::to_string(c.heads) + " --context " + std::to_string(c.context) + " --vocab " +
      std::to_string(c.vocab) + " --batch " + std::to_string(c.batch) + " --warmup " +
      std::to_string(c.warmup) + " --steps " + std::to_string(c.steps);
  FILE* pipe = popen(command.c_str(), "r");
  CHECK_THAT(pipe != nullptr, "cannot run ", command);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
  const int status = pclose(pipe);
  CHECK_THAT(status == 0, command, " failed: ", output);
  const auto at = output.rfind("\"step_ms\": ");
  CHECK_THAT(at != std::string::npos, command, " printed no step_ms: ", output);
  return std::atof(output.c_str() + at + 11);
}

std::string check_step_time(const std::string& precision) {
  std::vector<double> ratios, ours, theirs;
  for (int round = 0; round < settings.rounds; ++round) {
    std::string text;
    CHECK_THAT(in_processes(
                   1, [&](int, int) { return std::to_string(dtrain_step_ms(precision)); }, &text),
               "dtrain's timed run failed");
    ours.push_back(std::atof(text.c_str()));
    theirs.push_back(pytorch_step_ms(precision));
    ratios.push_back(ours.back() / theirs.back());
    std::printf("  round %d: dtrain %.2f ms, PyTorch %.2f ms, ratio %.3f\n", round + 1, ours.back(),
                theirs.back(), ratios.back());
    std::fflush(stdout);  // else the next forked process prints it again
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const StepConfig c = step_config();
  std::ostringstream raw;
  for (size_t i = 0; i < ratios.size(); ++i) {
    raw << (i ? "; " : "") << ours[i] << "/" << theirs[i];
  }
  return Record()
      .add("check", "gpt_step_time")
      .add("precision", precision)
      .add("gpt", std::to_string(c.layers) + "x" + std::to_string(c.width) + ", heads " +
                      std::to_string(c.heads) + ", context " + std::to_string(c.context) +
                      ", vocab " + std::to_string(c.vocab) + ", batch " + std::to_string(c.batch))
      .add("dtrain_ms_median", median(ours))
      .add("pytorch_ms_median", median(theirs))
      .add("ratio_median", median(ratios))
      .add("rounds_dtrain_over_pytorch_ms", raw.str())
      .add("passed", 1.0)
      .json();
}

std::string device_name() {
  if (!on_gpu()) return "cpu";
  std::string name;
  in_processes(
      1, [](int, int) { return std::string(at::cuda::getDeviceProperties(0)->name); }, &name);
  return name;
}

int gpu_count() {
  if (!on_gpu()) return 0;
  std::string text;
  in_processes(
      1, [](int, int) { return std::to_string(cuda_device_count()); }, &text);
  return std::atoi(text.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--device")
      settings.device = value;
    else if (flag == "--out")
      settings.out = value;
    else if (flag == "--python")
      settings.python = value;
    else if (flag == "--source-dir")
      settings.source_dir = value;
    else if (flag == "--rounds")
      settings.rounds = std::atoi(value.c_str());
    else if (flag == "--only")
      settings.only = value;
    else {
      std::fprintf(stderr,
                   "dtrain_gpu_check: unknown flag %s (--device cuda|cpu, --out FILE, "
                   "--python PY, --source-dir DIR, --rounds N, --only CHECK)\n",
                   flag.c_str());
      return 2;
    }
  }
  if (settings.device != "cpu" && settings.device != "cuda") {
    std::fprintf(stderr, "dtrain_gpu_check: --device must be cuda or cpu\n");
    return 2;
  }
  const int gpus = gpu_count();
  if (on_gpu() && gpus == 0) {
    std::fprintf(stderr,
                 "dtrain_gpu_check: no CUDA device is visible (--device cpu runs the "
                 "checks that need none)\n");
    return 2;
  }
  const std::string card = device_name();
  std::deque<std::pair<std::string, std::function<std::string()>>> checks;
  checks.emplace_back("communicator", [] {
    std::string text;
    CHECK_THAT(in_processes(
                   1, [](int r, int port) { return check_communicator(r, 1, port); }, &text),
               "world size 1 failed");
    return text;
  });
  if (gpus >= 2 || !on_gpu()) {
    const int size = on_gpu() ? std::min(gpus, 8) : 2;
    checks.emplace_back("communicator_multi", [size] {
      std::string text;
      CHECK_THAT(
          in_processes(
              size, [size](int r, int port) { return check_communicator(r, size, port); }, &text),
          "world size ", size, " failed");
      return text;
    });
  }
  std::vector<std::string> precisions = {"bf16-mixed", "bf16-master"};
  if (on_gpu()) precisions.push_back("fp16-mixed");
  for (const auto& p : precisions) {
    checks.emplace_back("precision_" + p, [p] {
      std::string text;
      CHECK_THAT(in_processes(
                     1, [p](int, int) { return check_precision(p); }, &text),
                 p, " training failed");
      return text;
    });
  }
  if (on_gpu()) {
    checks.emplace_back("checkpointing_memory", [] {
      std::string text;
      CHECK_THAT(in_processes(
                     1, [](int, int) { return check_checkpointing_memory(); }, &text),
                 "the memory check failed");
      return text;
    });
  }
  checks.emplace_back("ddp_gloo_2_ranks",
                      [] { return check_against_one_process("ddp_gloo_2_ranks", 2, {}, 1e-9); });
  // ZeRO over 2 ranks sharing the device (issue 54): zero1 reduce-scatters the gradients
  // (Megatron's distributed optimizer), zero2 with small buckets leaves each bucket's parameter
  // all-gather running into the next forward (--overlap-param-gather).
  checks.emplace_back("zero1_reduce_scatter_2_ranks", [] {
    return check_against_one_process(
        "zero1_reduce_scatter_2_ranks", 2, [](train::TrainerOptions& o) { o.strategy = "zero1"; },
        1e-9);
  });
  checks.emplace_back("zero2_overlap_param_gather_2_ranks", [] {
    return check_against_one_process(
        "zero2_overlap_param_gather_2_ranks", 2,
        [](train::TrainerOptions& o) {
          o.strategy = "zero2";
          o.strategy_options.bucket_cap_bytes = 64 << 10;
          o.strategy_options.first_bucket_cap_bytes = 16 << 10;
          o.strategy_options.of<parallel::zero::ZeroOverlapOptions>().param_gather = true;
        },
        1e-9);
  });
  // PowerSGD at full rank (every matrix compressed, from the first step) is the exact allreduce:
  // Householder QR and the low-rank products on this device.
  checks.emplace_back("powersgd_full_rank_2_ranks", [] {
    return check_against_one_process(
        "powersgd_full_rank_2_ranks", 2,
        [](train::TrainerOptions& o) {
          o.strategy_options.grad_compression = "powersgd:100000:0:0";
        },
        1e-9);
  });
  // 2 hosts x 2 ranks: reduce-scatter inside the host, allreduce across, allgather inside.
  checks.emplace_back("hierarchical_allreduce_4_ranks", [] {
    return check_against_one_process(
        "hierarchical_allreduce_4_ranks", 4,
        [](train::TrainerOptions& o) {
          o.strategy_options.hierarchical_allreduce = true;
          o.strategy_options.ranks_per_host = 2;
        },
        1e-9);
  });
  // DiLoCo with H = 1 and outer SGD at lr 1 without momentum is DDP: 2 islands (inner SGD: each
  // island's AdamW would normalize its own gradient); streaming too, with 3 fragments each
  // exchanged every step; and islands of 2 zero3 ranks, averaging shard by shard.
  struct Diloco {
    std::string name, inner;
    int fragments, ranks;
  };
  for (const Diloco& c : {Diloco{"diloco_h1_2_islands", "ddp", 1, 2},
                          Diloco{"diloco_streaming_h1_2_islands", "ddp", 3, 2},
                          Diloco{"diloco_zero3_h1_2_islands_of_2", "zero3", 1, 4}}) {
    checks.emplace_back(c.name, [c] {
      return check_against_one_process(
          c.name, c.ranks,
          [c](train::TrainerOptions& o) {
            o.strategy = "diloco";
            auto& d = o.strategy_options.of<parallel::diloco::DilocoOptions>();
            d.inner_strategy = c.inner;
            d.island_size = c.ranks / 2;
            d.outer_steps = 1;
            d.outer_optimizer = "sgd";
            d.outer_lr = 1.0;
            d.outer_momentum = 0.0;
            d.fragments = c.fragments;
          },
          1e-9, "sgd");
    });
  }
  // ZeRO++'s quantized collectives: exact with the quantization turned to identity; with int8
  // blocks, the losses of 8 AdamW steps within 2% of exact's.
  for (const bool identity : {true, false}) {
    const std::string name = identity ? "zero3_quantized_identity_2_ranks" : "zero3_int8_2_ranks";
    checks.emplace_back(name, [name, identity] {
      return check_against_one_process(
          name, 2,
          [identity](train::TrainerOptions& o) {
            o.strategy = "zero3";
            o.strategy_options.of<parallel::zero::ZeroQuantizedOptions>() = {true, 256, identity};
          },
          identity ? 1e-9 : 0.02);
    });
  }
  for (const std::string p : {"fp32", "bf16-mixed"}) {
    checks.emplace_back("gpt_step_time_" + p, [p] { return check_step_time(p); });
  }

  std::ofstream out(settings.out, std::ios::app);
  if (!out) {
    std::fprintf(stderr, "dtrain_gpu_check: cannot write %s\n", settings.out.c_str());
    return 2;
  }
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  int failed = 0;
  for (const auto& [name, run] : checks) {
    if (!settings.only.empty() && name != settings.only) continue;
    std::printf("%s ...\n", name.c_str());
    std::fflush(stdout);
    std::string line;
    try {
      line = run();
      std::printf("  ok: %s\n", line.c_str());
    } catch (const std::exception& e) {
      ++failed;
      line = Record().add("check", name).add("passed", 0.0).add("error", "see the log").json();
      std::printf("  FAILED: %s\n", e.what());
    }
    line.insert(1, "\"date\": \"" + std::string(stamp) + "\", \"device\": \"" + card + "\", ");
    out << line << "\n";
    out.flush();
  }
  std::printf("%s: %d check(s) failed\n", failed ? "FAILED" : "passed", failed);
  return failed ? 1 : 0;
}
