// The Trainer: a run's batch arithmetic, schedule and setup, evaluation and checkpoints; the
// loop itself is its runner's (train/runners/).
#include "dtrain/train/Trainer.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/Files.h"
#include "dtrain/common/Blas.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/common/Trace.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/SyncBatchNorm.h"
#include "dtrain/optim/Offload.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "dtrain/precision/Precision.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/CheckpointManager.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"
#include "dtrain/train/RunPlan.h"
#include "dtrain/train/Weights.h"
#include "train/runners/Run.h"

namespace dtrain::train {

void validate(const TrainerOptions& o) {
  DTRAIN_CHECK_INPUT(o.epochs >= 1, "epochs must be >= 1, got ", o.epochs);
  DTRAIN_CHECK_INPUT(o.batch_size >= 1, "batch size must be >= 1, got ", o.batch_size);
  DTRAIN_CHECK_INPUT(o.accumulation_steps >= 1, "accumulation steps must be >= 1, got ",
                     o.accumulation_steps);
  DTRAIN_CHECK_INPUT(o.global_batch >= 0, "global batch must be >= 0, got ", o.global_batch);
  DTRAIN_CHECK_INPUT(o.moe_bias_rate >= 0 && std::isfinite(o.moe_bias_rate),
                     "--moe-bias-rate must be >= 0, got ", o.moe_bias_rate);
  DTRAIN_CHECK_INPUT(o.global_batch == 0 || o.accumulation_steps == 1,
                     "give the global batch or the accumulation steps, not both (the global "
                     "batch sets the accumulation steps)");
  DTRAIN_CHECK_INPUT(o.checkpoint_every >= 0, "checkpoint interval must be >= 0, got ",
                     o.checkpoint_every);
  DTRAIN_CHECK_INPUT(o.log_every >= 1, "log interval must be >= 1, got ", o.log_every);
  DTRAIN_CHECK_INPUT(o.peak_tflops >= 0 && std::isfinite(o.peak_tflops),
                     "--peak-tflops must be a positive number of TFLOP/s, got ", o.peak_tflops);
  DTRAIN_CHECK_INPUT(o.max_steps >= 0, "max steps must be >= 0, got ", o.max_steps);
  DTRAIN_CHECK_INPUT(o.stop_at_step >= 0, "stop-at step must be >= 0, got ", o.stop_at_step);
  DTRAIN_CHECK_INPUT(o.eval_batch_size >= 0,
                     "--eval-batch-size must be >= 1 (or 0: by the examples' size), got ",
                     o.eval_batch_size);
  DTRAIN_CHECK_INPUT(o.eval_every >= 0, "--eval-every must be >= 0, got ", o.eval_every);
  DTRAIN_CHECK_INPUT(o.max_nonfinite_steps >= 0, "max non-finite steps must be >= 0, got ",
                     o.max_nonfinite_steps);
  DTRAIN_CHECK_INPUT(o.keep_checkpoints >= 0, "checkpoints to keep must be >= 0, got ",
                     o.keep_checkpoints);
  parse_device(o.strategy_options.device);  // the name; the machine is checked by each rank
  if (!o.stage_replicas.empty()) {
    DTRAIN_CHECK_INPUT(
        o.stage_replicas.size() >= 2, "--stage-replicas names ", o.stage_replicas.size(),
        " stage: a pipeline has at least 2 (one stage replicated is --strategy ddp)");
    for (size_t s = 0; s < o.stage_replicas.size(); ++s) {
      DTRAIN_CHECK_INPUT(o.stage_replicas[s] >= 1, "--stage-replicas: stage ", s, " has ",
                         o.stage_replicas[s], " replicas (at least 1)");
    }
    DTRAIN_CHECK_INPUT(o.pipeline_parallel == 1 ||
                           o.pipeline_parallel == static_cast<int>(o.stage_replicas.size()),
                       "--pipeline-parallel ", o.pipeline_parallel, " but --stage-replicas names ",
                       o.stage_replicas.size(), " stages");
  }
}

BatchPlan plan_batches(const TrainerOptions& options, int64_t dp) {
  BatchPlan plan;
  plan.micro_batch = options.batch_size;
  plan.micro_batches = options.accumulation_steps;
  if (options.global_batch > 0) {
    const int64_t per_micro_batch = options.batch_size * dp;
    DTRAIN_CHECK_INPUT(options.global_batch % per_micro_batch == 0, "global batch ",
                       options.global_batch, " is not a whole number of micro-batches of ",
                       options.batch_size, " x ", dp, " data-parallel ranks (", per_micro_batch,
                       ")");
    plan.micro_batches = options.global_batch / per_micro_batch;
  }
  plan.global_batch = plan.local_step_batch() * dp;
  return plan;
}

Trainer::Trainer(TrainerOptions options, comm::CommunicatorPtr world)
    : options_(std::move(options)), world_(std::move(world)) {
  validate(options_);
  warn_if_blas_slow();  // a generic OpenBLAS kernel: named once, with its fix (common/Blas.h)
  fold_stage_replicas(options_);
  loss_ = options_.loss;
  if (!world_) {
    comm::InitOptions single;
    single.master_port = free_port();
    world_ = comm::init(single);
  }
  torch::manual_seed(options_.seed);
  // The strategy that runs (the pipeline wraps the one chosen for its stages' data
  // parallelism), checked against the layout.
  grid_ = options_.stage_replicas.empty()
              ? std::make_shared<comm::ProcessGrid>(world_, options_.tensor_parallel,
                                                    options_.pipeline_parallel,
                                                    parallel::grid_order(options_.strategy_options))
              : std::make_shared<comm::ProcessGrid>(world_, options_.tensor_parallel,
                                                    options_.stage_replicas);
  grid_->split_context(options_.context_parallel);
  options_.strategy = parallel::resolve_strategy(layout_of(options_, grid_->data_parallel_size()),
                                                 options_.strategy_options);
  grid_->split_experts(options_.expert_parallel);
  loop_ = parallel::strategy_info(options_.strategy).loop;
  // "cuda" becomes this rank's device (LOCAL_RANK under a launcher, as torchrun has it).
  const char* local_rank = std::getenv("LOCAL_RANK");
  device_ = resolve_device(options_.strategy_options.device,
                           local_rank ? std::atoi(local_rank) : world_->rank());
  options_.strategy_options.device = device_.str();
  DTRAIN_CHECK_INPUT(!device_.is_cpu() || world_->backend_name() != "nccl",
                     "backend nccl carries CUDA tensors, and this run trains on the CPU: use "
                     "--device cuda, or --backend gloo");
  DTRAIN_CHECK_INPUT(device_.is_cpu() || loop_ == parallel::Loop::kSteps, "strategy ",
                     options_.strategy,
                     " trains on the CPU only (its parameters travel over "
                     "gRPC); use --device cpu, or a synchronous strategy for ",
                     device_.str());
  strategy_ = parallel::make_strategy(options_.strategy, options_.strategy_options);
  if (world_->rank() == 0) {
    const std::string warning = precision::cost_warning(
        precision::parse_precision(options_.strategy_options.precision), device_);
    if (!warning.empty()) std::fprintf(stderr, "dtrain: warning: %s\n", warning.c_str());
  }
  if (!options_.checkpoint_dir.empty() && world_->rank() == 0) {
    ensure_writable(options_.checkpoint_dir);
  }
}

Trainer::~Trainer() = default;

namespace {

// Examples per evaluation forward: --eval-batch-size, else 256, or for token windows as many as
// hold 16384 tokens, at least --batch-size (what a training step already holds) and at most 256.
int64_t eval_batch(const TrainerOptions& o, const data::TensorDataset& dataset) {
  if (o.eval_batch_size > 0) return o.eval_batch_size;
  constexpr int64_t kExamples = 256, kTokens = 16384;
  const int64_t context = dataset.context();
  if (context <= 0) return kExamples;
  return std::min(kExamples, std::max({int64_t{1}, o.batch_size, kTokens / context}));
}

}  // namespace

EvalResult Trainer::evaluate(const data::TensorDataset& dataset) {
  return evaluate_on(dataset, false);
}

EvalResult Trainer::evaluate_on(const data::TensorDataset& dataset, bool alone) {
  trace::Span span("evaluate", "evaluate");
  auto& model = strategy_->model();
  model.module->eval();
  torch::NoGradGuard no_grad;
  // Each data-parallel replica evaluates a share; within a replica every rank sees the same
  // examples, and the ranks holding the output (a pipeline's last stage) count them.
  const int replica = alone ? 0 : grid_->data_parallel_rank();
  const int replicas = alone ? 1 : grid_->data_parallel_size();
  const bool counts = grid_->coordinates().tp == 0;  // TP ranks compute the same values
  // A context-parallel group's ranks each count the loss of their share of the positions (the
  // same count) and the accuracy of the whole sequence's predictions: each a 1/C share.
  const double share = 1.0 / grid_->cp_size();
  double sums[3] = {0, 0, 0};  // loss * n, correct, n
  const int64_t batch = eval_batch(options_, dataset);
  for (int64_t begin = 0; begin < dataset.size(); begin += batch * replicas) {
    const int64_t mine = begin + replica * batch;
    const int64_t end = std::min(mine + batch, dataset.size());
    // A forward can be collective (ZeRO-3 gathers parameters, a pipeline passes activations):
    // every rank runs as many, a replica without examples left on one example.
    auto batch =
        runners::to_device(mine < end ? dataset.slice(mine, end) : dataset.slice(0, 1), device_);
    at::Tensor output = strategy_->evaluate_forward(batch.inputs);
    if (mine >= end || !output.defined()) continue;
    // A tensor-parallel model's loss and prediction are collective over its TP group.
    const double loss = loss_(output, batch.targets).item<double>();
    // Classes on the last dimension: [B, K] for a classifier, [B, T, V] for a language model
    // (each example's accuracy is then its share of tokens predicted).
    const at::Tensor predicted = predict_ ? predict_(output) : output.argmax(-1);
    if (!counts) continue;
    const auto n = static_cast<double>(end - mine) * share;
    sums[0] += loss * n;
    sums[1] += predicted.eq(batch.targets)
                   .to(at::kDouble)
                   .reshape({output.size(0), -1})
                   .mean(1)
                   .sum()
                   .item<double>() *
               share;
    sums[2] += n;
  }
  at::Tensor totals = at::tensor({sums[0], sums[1], sums[2]}, at::kDouble);
  if (!alone) {
    world_->allreduce(totals)->wait();
  } else if (auto* replicas = parallel::ft::replaceable(*strategy_)) {
    // The leading replica alone (--fault-tolerance replicas): its ranks that counted (a
    // pipeline's last stage; every rank of a replica that shards its state) saw the same
    // examples; the mean over them.
    const comm::CommunicatorPtr group = replicas->replica_group();
    if (group && group->size() > 1) {
      at::Tensor counted =
          at::cat({totals, at::ones({1}, at::kDouble) * (sums[2] > 0 ? 1.0 : 0.0)});
      group->allreduce(counted)->wait();
      totals = counted.narrow(0, 0, 3) / std::max(1.0, counted[3].item<double>());
    }
  }
  EvalResult result;
  result.examples = static_cast<int64_t>(std::llround(totals[2].item<double>()));
  if (result.examples > 0) {
    result.loss = totals[0].item<double>() / result.examples;
    result.accuracy = totals[1].item<double>() / result.examples;
  }
  model.module->train();
  return result;
}

void Trainer::write_trace() {
  // Every rank's spans to every rank (the ranks may be on other hosts), rank 0 writes the file.
  const std::string mine = trace::to_json_events(trace::events(), world_->rank());
  if (trace::dropped() > 0) {
    std::fprintf(stderr, "dtrain: rank %d: the trace kept its first %zu spans and dropped %lld\n",
                 world_->rank(), trace::events().size(), static_cast<long long>(trace::dropped()));
  }
  trace::stop();
  const std::vector<std::string> fragments = comm::allgather_strings(*world_, mine);
  if (world_->rank() != 0) return;
  const std::string text = trace::trace_file(fragments);
  write_file_atomically(options_.trace_file, text.data(), text.size());
}

namespace {

/// The run's last metrics record (rank 0): its steps, time, throughput, this rank's model state
/// as its strategy keeps it (what `dtrain plan` predicts), the final loss and accuracy.
void write_summary(runners::Run& run, int64_t start_step, int world_size,
                   parallel::Strategy& strategy, int64_t setup_peak_bytes) {
  const FitResult& result = run.result;
  MetricRecord summary{{"event", std::string("summary")},
                       {"steps", result.steps},
                       {"start_step", start_step},
                       {"seconds", result.seconds},
                       {"train_seconds", result.train_seconds},
                       {"samples_per_s", result.samples_per_second},
                       {"global_batch", result.global_batch},
                       {"world_size", static_cast<int64_t>(world_size)},
                       {"strategy", strategy.name()}};
  // This rank's model state, as its strategy keeps it (what `dtrain plan` predicts).
  const parallel::MemoryReport memory = strategy.memory_report();
  summary["parameter_bytes"] = memory.parameter_bytes;
  summary["gradient_bytes"] = memory.gradient_bytes;
  summary["optimizer_bytes"] = memory.optimizer_bytes;  // in memory
  if (const auto* offloaded = dynamic_cast<const optim::OffloadedOptimizer*>(&strategy.optimizer());
      offloaded != nullptr && offloaded->file_bytes() > 0) {
    summary["optimizer_file_bytes"] = offloaded->file_bytes();
  }
  // This process's peak resident memory once the model was built and set up, before step 1
  // (the data set's included).
  if (setup_peak_bytes > 0) summary["setup_peak_resident_bytes"] = setup_peak_bytes;
  if (!result.losses.empty()) summary["final_loss"] = result.losses.back();
  if (result.stopped_by != 0)
    summary["stopped_by_signal"] = static_cast<int64_t>(result.stopped_by);
  if (result.validation) summary["val_accuracy"] = result.validation->accuracy;
  run.metrics.write(summary);
}

}  // namespace

void Trainer::set_up(Model model, const data::TensorDataset& train,
                     const optim::OptimizerSpec& spec) {
  // The model's own loss when it has one (a tensor-parallel model's vocab-parallel loss).
  loss_ = model.loss ? parallel::LossFn(model.loss) : options_.loss;
  predict_ = model.predict;
  strategy_->prepare(runners::to_device(
      train.slice(0, std::min<int64_t>(options_.batch_size, train.size())), device_));
  // A checkpoint's pieces, each rank reading only what it keeps: into zero3's placeholders, or
  // into a tensor-parallel rank's blocks (any strategy that reads a checkpoint's values).
  const bool init_from_pieces = keep_placeholders(model, options_.init_from) ||
                                (options_.tensor_parallel > 1 && options_.pipeline_parallel == 1 &&
                                 std::filesystem::is_directory(options_.init_from));
  if (!options_.init_from.empty() && !init_from_pieces) {
    DTRAIN_CHECK_INPUT(options_.tensor_parallel == 1, "--init-from ", options_.init_from,
                       ": a whole-model file; with --tensor-parallel each rank builds blocks of "
                       "the model: give a checkpoint folder (each rank reads its blocks of it)");
    load_model_from(*model.module, options_.init_from);
    if (!options_.allow_non_finite_weights) {
      check_finite_weights(*model.module, "--init-from " + options_.init_from);
    }
  }
  if (!model.deferred || !model.deferred->pending()) model.module->to(device_);
  strategy_->setup(std::move(model), optim::optimizer_factory(spec), grid_);
  if (init_from_pieces) {
    strategy_->load_values(resolve_checkpoint(options_.init_from));
    if (!options_.allow_non_finite_weights) {
      // Shards where the strategy keeps them; else the model's parameters that have memory (a
      // tensor-parallel rank's blocks, a pipeline rank's stages).
      const std::vector<parallel::PieceRef> pieces = strategy_->parameter_pieces();
      const std::string origin = "--init-from " + options_.init_from;
      if (pieces.empty()) {
        check_finite_weights(*strategy_->model().module, origin);
      } else {
        check_finite_weights(pieces, origin);
      }
    }
  }
  if (after_setup_) after_setup_(*strategy_);
  if (options_.sync_batchnorm) {
    DTRAIN_CHECK_INPUT(loop_ == parallel::Loop::kSteps, "--sync-batchnorm: strategy ",
                       options_.strategy, " has no data-parallel group that steps together");
    DTRAIN_CHECK_INPUT(!strategy_->survives_replica_failures(),
                       "--sync-batchnorm with --fault-tolerance replicas: the statistics would be "
                       "a collective no failure may break; leave one out");
    // DiLoCo's islands step together; other strategies' data-parallel ranks do.
    const comm::CommunicatorPtr step_group = strategy_->step_group();
    DTRAIN_CHECK_INPUT(
        nn::set_sync_batchnorm(*strategy_->model().module, step_group ? step_group : grid_->dp()) >
            0,
        "--sync-batchnorm: the model has no SyncBatchNorm layers (dtrain::nn::SyncBatchNorm2d: "
        "dtrain's ResNets have them)");
  }
  if (world_->rank() == 0 && options_.progress) {
    const std::string layout = strategy_->layout();
    if (!layout.empty()) std::printf("%s\n", layout.c_str());
  }
}

FitResult Trainer::fit(Model model, const data::TensorDataset& train,
                       const data::TensorDataset* validation) {
  const int rank = world_->rank();
  const int dp_size = grid_->data_parallel_size();
  const BatchPlan batches = plan_batches(options_, dp_size);
  options_.accumulation_steps = batches.micro_batches;
  options_.global_batch = 0;  // a second fit() derives nothing new from it
  const int64_t local_step_batch = batches.local_step_batch();
  const int64_t global_batch = batches.global_batch;
  // A presampled set's order is its own (Megatron's shuffle over every epoch): read in order.
  const data::DistributedSampler sampler(train.size(), dp_size, grid_->data_parallel_rank(),
                                         {!train.presampled(), options_.seed, true});
  const int64_t steps_per_epoch = sampler.num_samples() / local_step_batch;
  DTRAIN_CHECK_INPUT(steps_per_epoch >= 1, "a step needs ", global_batch, " examples (batch ",
                     options_.batch_size, " x accumulation ", options_.accumulation_steps, " x ",
                     dp_size, " ranks) but the training set has ", train.size());
  const std::unique_ptr<runners::Runner> runner = runners::make_runner(loop_);
  int64_t epoch_steps = steps_per_epoch * (train.presampled() ? 1 : options_.epochs);
  if (options_.max_steps > 0) epoch_steps = std::min(epoch_steps, options_.max_steps);
  const int64_t total_steps = runner->plan_steps(epoch_steps, options_);
  // A warmup as long as the run: the learning rate never reaches --lr (the image models' 100
  // warmup steps in a 50-step trial run).
  if (world_->rank() == 0 && options_.schedule.warmup_steps >= total_steps && total_steps > 1) {
    std::fprintf(stderr,
                 "dtrain: warning: the warmup (--warmup-steps %lld) is not shorter than the run's "
                 "%lld steps: the learning rate never reaches --lr %g; give --warmup-steps %lld "
                 "or fewer\n",
                 static_cast<long long>(options_.schedule.warmup_steps),
                 static_cast<long long>(total_steps), options_.optimizer.lr,
                 static_cast<long long>(std::max<int64_t>(1, total_steps / 10)));
  }

  optim::OptimizerSpec spec = options_.optimizer;
  if (options_.reference_batch > 0) {
    spec.lr = optim::linear_scaled_lr(spec.lr, global_batch, options_.reference_batch);
  }
  if (!options_.trace_file.empty()) trace::start();
  set_up(std::move(model), train, spec);
  const int64_t setup_peak_bytes = peak_resident_bytes();
  torch::manual_seed(options_.seed + 1000003ULL * static_cast<uint64_t>(rank + 1));
  CheckpointManager checkpoints(options_, *world_, *grid_, *strategy_);
  // A replacement replica has its state from a replica that trains, and starts where it is.
  parallel::ft::ReplaceableReplicas* const replicas = parallel::ft::replaceable(*strategy_);
  const int64_t joined_at = replicas ? replicas->joined_at_step() : -1;
  const int64_t start_step =
      joined_at >= 0 ? std::min(joined_at, total_steps) : checkpoints.restore(global_batch);
  if (joined_at == parallel::ft::ReplaceableReplicas::kFinished) {
    std::fprintf(stderr,
                 "dtrain: world rank %d: the job finished before this replacement was admitted\n",
                 rank);
  }

  runners::Run run(options_, *strategy_, *world_, train, validation, start_step, steps_per_epoch);
  run.total_steps = total_steps;
  run.result.total_steps = total_steps;
  run.last_step =
      options_.stop_at_step > 0 ? std::min(total_steps, options_.stop_at_step) : total_steps;
  run.dp_size = dp_size;
  run.dp_rank = grid_->data_parallel_rank();
  run.local_step_batch = local_step_batch;
  run.global_batch = global_batch;
  run.schedule = std::make_unique<optim::LrSchedule>(spec.lr, total_steps, options_.schedule);
  run.weight_decay = spec.weight_decay;
  run.loss = loss_;
  run.needs = strategy_->data_needs();
  run.device = device_;
  run.result.global_batch = global_batch;
  run.result.learning_rate = spec.lr;
  // Where the run starts and what it is, for whoever watches its files (`dtrain status`).
  run.metrics.write(
      {{"event", std::string("start")},
       {"step", start_step},
       {"total_steps", total_steps},
       {"global_batch", global_batch},
       {"world_size", static_cast<int64_t>(world_->size())},
       {"data_parallel", static_cast<int64_t>(dp_size)},
       {"pipeline_parallel", static_cast<int64_t>(options_.pipeline_parallel)},
       {"tensor_parallel", static_cast<int64_t>(options_.tensor_parallel)},
       {"context_parallel", static_cast<int64_t>(options_.context_parallel)},
       {"expert_parallel", static_cast<int64_t>(options_.expert_parallel)},
       {"strategy", strategy_->name()},
       {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                    .count()}});
  run.evaluate = [&](bool alone) { return evaluate_on(*validation, alone); };
  // A mixture of experts: its step's loads summed over the data-parallel ranks (synchronous
  // loops whose groups outlive no failure; else each rank's own), metrics and the bias.
  const bool steps_together =
      loop_ == parallel::Loop::kSteps && !strategy_->survives_replica_failures();
  DTRAIN_CHECK_INPUT(options_.moe_bias_rate <= 0 || steps_together,
                     "--moe-bias-rate moves every rank's bias by the step's load summed over the "
                     "data-parallel ranks: it needs a strategy whose ranks step together (not ",
                     options_.strategy, ")");
  // Summed over the world: a pipeline's ranks route through their own stages' layers (each
  // layer's loads come from its stage's ranks), sequence parallelism's through their part of the
  // sequence, and tensor-parallel ranks without it route the same tokens alike (every figure
  // is a ratio, and the bias moves by a sign: counted T times, they are the same).
  run.experts =
      ExpertBalance::find(*strategy_->model().module, steps_together ? grid_->world() : nullptr,
                          options_.moe_bias_rate);
  checkpoints.on_written = [&](int64_t step, double seconds) {
    if (run.leader) {
      run.metrics.write(
          {{"event", std::string("checkpoint_written")}, {"step", step}, {"seconds", seconds}});
    }
  };
  checkpoints.on_files = [&](int64_t step) { run.failure.maybe_fire_in_checkpoint(step); };
  run.callbacks = &callbacks_;
  run.save = [&](int64_t step, int64_t epoch, bool alone) {
    const auto started = runners::Clock::now();
    checkpoints.save(step, epoch, global_batch, alone);
    if (callbacks_.on_checkpoint) {
      callbacks_.on_checkpoint(step, options_.checkpoint_dir + "/" + checkpoint_name(step));
    }
    // How long training stood still for it (asynchronous: the copy to host memory, and any wait
    // for the previous checkpoint's write).
    if (run.leader) {
      run.metrics.write({{"event", std::string("checkpoint")},
                         {"step", step},
                         {"seconds", runners::seconds_since(started)},
                         {"async", static_cast<int64_t>(options_.async_checkpoint)}});
    }
  };
  runner->run(run);
  checkpoints.wait();  // the last checkpoint is complete (and rank 0's published) when fit returns

  FitResult& result = run.result;
  result.leader = run.leader;
  result.seconds = runners::seconds_since(run.start);
  run.evaluate_snapshots();
  if (!options_.trace_file.empty()) write_trace();
  result.train_seconds = run.train_seconds;
  result.samples_per_second = run.samples / std::max(run.train_seconds, 1e-9);
  if (run.leader) write_summary(run, start_step, world_->size(), *strategy_, setup_peak_bytes);
  return std::move(run.result);
}

bool Trainer::keep_placeholders(Model& model, const std::string& init_from) {
  if (!model.deferred || !model.deferred->pending()) return false;
  const parallel::StrategyInfo& info = parallel::strategy_info(options_.strategy);
  const bool checkpoint = !init_from.empty() && std::filesystem::is_directory(init_from);
  // ZeRO-3 draws its shards (its checkpoint reading without tensor parallelism), a pipeline rank
  // its own stages (any layout's checkpoint).
  if (info.draws_deferred &&
      (init_from.empty() || (checkpoint && (options_.tensor_parallel == 1 || info.pipelines))) &&
      !strategy_->survives_replica_failures()) {
    nn::module_to(*model.module, at::TensorOptions().device(device_));
    return checkpoint;
  }
  model.deferred->materialize_all();
  return false;
}

parallel::Strategy& Trainer::prepare(Model model, const data::Batch& example) {
  strategy_->prepare(runners::to_device(example, device_));
  keep_placeholders(model, "");
  if (!model.deferred || !model.deferred->pending()) model.module->to(device_);
  strategy_->setup(std::move(model), optim::optimizer_factory(options_.optimizer), grid_);
  if (after_setup_) after_setup_(*strategy_);
  return *strategy_;
}

}  // namespace dtrain::train
