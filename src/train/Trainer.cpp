// The Trainer: a run's batch arithmetic, schedule and setup, evaluation and checkpoints; the
// loop itself is its runner's (train/runners/).
#include "dtrain/train/Trainer.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/Files.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/common/Trace.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/nn/tensor/Split.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"
#include "train/runners/Run.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

// "4 ranks (DP 2 x PP 2 x TP 1)": how a run or a checkpoint is laid out.
std::string describe_layout(int world, int dp, int pp, int tp) {
  return concat(world, world == 1 ? " rank" : " ranks", " (DP ", dp, " x PP ", pp, " x TP ", tp,
                ")");
}

std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

}  // namespace

void validate(const TrainerOptions& o) {
  DTRAIN_CHECK_INPUT(o.epochs >= 1, "epochs must be >= 1, got ", o.epochs);
  DTRAIN_CHECK_INPUT(o.batch_size >= 1, "batch size must be >= 1, got ", o.batch_size);
  DTRAIN_CHECK_INPUT(o.accumulation_steps >= 1, "accumulation steps must be >= 1, got ",
                     o.accumulation_steps);
  DTRAIN_CHECK_INPUT(o.global_batch >= 0, "global batch must be >= 0, got ", o.global_batch);
  DTRAIN_CHECK_INPUT(o.global_batch == 0 || o.accumulation_steps == 1,
                     "give the global batch or the accumulation steps, not both (the global "
                     "batch sets the accumulation steps)");
  DTRAIN_CHECK_INPUT(o.checkpoint_every >= 0, "checkpoint interval must be >= 0, got ",
                     o.checkpoint_every);
  DTRAIN_CHECK_INPUT(o.log_every >= 1, "log interval must be >= 1, got ", o.log_every);
  DTRAIN_CHECK_INPUT(o.max_steps >= 0, "max steps must be >= 0, got ", o.max_steps);
  DTRAIN_CHECK_INPUT(o.stop_at_step >= 0, "stop-at step must be >= 0, got ", o.stop_at_step);
  DTRAIN_CHECK_INPUT(o.eval_batch_size >= 1, "eval batch size must be >= 1");
  DTRAIN_CHECK_INPUT(o.eval_every >= 0, "--eval-every must be >= 0, got ", o.eval_every);
  DTRAIN_CHECK_INPUT(o.max_nonfinite_steps >= 0, "max non-finite steps must be >= 0, got ",
                     o.max_nonfinite_steps);
  DTRAIN_CHECK_INPUT(o.keep_checkpoints >= 0, "checkpoints to keep must be >= 0, got ",
                     o.keep_checkpoints);
  parse_device(o.strategy_options.device);  // the name; the machine is checked by each rank
}

Trainer::Trainer(TrainerOptions options, comm::CommunicatorPtr world)
    : options_(std::move(options)), world_(std::move(world)) {
  validate(options_);
  loss_ = options_.loss;
  if (!world_) {
    comm::InitOptions single;
    single.master_port = free_port();
    world_ = comm::init(single);
  }
  torch::manual_seed(options_.seed);
  // The strategy that runs (the pipeline wraps the one chosen for its stages' data
  // parallelism), checked against the layout.
  parallel::Layout layout;
  layout.strategy = options_.strategy;
  layout.pipeline_parallel = options_.pipeline_parallel;
  layout.tensor_parallel = options_.tensor_parallel;
  layout.defer_eval = options_.defer_eval;
  grid_ = std::make_shared<comm::ProcessGrid>(world_, options_.tensor_parallel,
                                              options_.pipeline_parallel);
  const int64_t per_micro_batch = options_.batch_size * grid_->dp_size();
  layout.micro_batches = options_.global_batch > 0
                             ? std::max<int64_t>(1, options_.global_batch / per_micro_batch)
                             : options_.accumulation_steps;
  options_.strategy = parallel::resolve_strategy(layout, options_.strategy_options);
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
  if (!options_.checkpoint_dir.empty() && world_->rank() == 0) {
    ensure_writable(options_.checkpoint_dir);
  }
}

Trainer::~Trainer() = default;

std::vector<TensorInfo> Trainer::model_tensors() const {
  std::vector<TensorInfo> tensors;
  auto& module = *strategy_->model().module;
  // Full shapes: a tensor-parallel rank holds blocks of them.
  const auto splits = tensor::parameter_splits(module);
  for (const auto& item : module.named_parameters()) {
    tensors.push_back({item.key(),
                       tensor::full_shape(splits, item.key(), item.value().sizes().vec()),
                       dtype_name(item.value())});
  }
  for (const auto& item : module.named_buffers()) {
    tensors.push_back({item.key(), item.value().sizes().vec(), dtype_name(item.value()), true});
  }
  return tensors;
}

void Trainer::save_checkpoint(int64_t step, int64_t epoch, int64_t global_batch, bool alone) {
  const std::string root = options_.checkpoint_dir;
  const std::string name = checkpoint_name(step);
  const std::string staging = root + "/" + name + ".tmp";
  const bool leader = world_->rank() == 0;
  if (leader) {
    fs::remove_all(staging);
    fs::create_directories(staging);
  }
  if (!alone) world_->barrier()->wait();
  strategy_->save(staging);
  torch::save(at::detail::getDefaultCPUGenerator().get_state(),
              concat(staging, "/rng-rank", world_->rank(), ".pt"));
  if (!alone) world_->barrier()->wait();  // every rank's files are in place
  if (leader) {
    CheckpointMeta meta;
    meta.strategy = strategy_->name();
    meta.world_size = world_->size();
    meta.dp = grid_->dp_size();
    meta.pp = grid_->pp_size();
    meta.tp = grid_->tp_size();
    meta.step = step;
    meta.epoch = epoch;
    meta.seed = options_.seed;
    meta.global_batch = global_batch;
    meta.tensors = model_tensors();
    meta.extras = options_.checkpoint_extras;
    // Digests read back from the files on disk, so the checkpoint that replaces older ones has
    // been verified as written.
    record_files(staging, meta);
    write_meta(staging, meta);
    const std::string final_dir = root + "/" + name;
    fs::remove_all(final_dir);
    fs::rename(staging, final_dir);
    set_latest(root, name);
    prune_checkpoints(root, options_.keep_checkpoints, name);
  }
  if (!alone) world_->barrier()->wait();
}

std::string Trainer::choose_checkpoint() {
  const std::string& root = options_.checkpoint_dir;
  // Rank 0 verifies; everyone loads what it chose. Candidates: the one `latest` names, then
  // older ones, newest first.
  int64_t chosen = -1;  // index into `names`; -1 none; -2 some exist, none verifies
  std::vector<std::string> names = list_checkpoints(root);
  std::string newest_problem;
  if (world_->rank() == 0 && !names.empty()) {
    std::string latest_name;
    if (const auto latest = latest_checkpoint_name(root)) latest_name = *latest;
    if (!latest_name.empty() && std::find(names.begin(), names.end(), latest_name) == names.end()) {
      std::fprintf(stderr,
                   "dtrain: warning: %s/latest names checkpoint '%s', which does not exist; "
                   "resuming from the newest checkpoint that verifies\n",
                   root.c_str(), latest_name.c_str());
      latest_name.clear();
    }
    int damaged = 0;
    std::vector<std::string> set_aside;
    for (int64_t i = static_cast<int64_t>(names.size()) - 1; i >= 0; --i) {
      if (!latest_name.empty() && names[i] > latest_name) continue;  // another run's, newer
      const std::string directory = root + "/" + names[i];
      bool unverifiable = false;
      const std::string problem = verify_checkpoint(directory, &unverifiable);
      if (problem.empty()) {
        if (unverifiable) {
          std::fprintf(stderr,
                       "dtrain: warning: checkpoint %s has no checksums (an older "
                       "dtrain wrote it); resuming from it unverified\n",
                       directory.c_str());
        }
        chosen = i;
        break;
      }
      if (damaged++ == 0) newest_problem = problem;
      std::fprintf(stderr, "dtrain: checkpoint %s does not verify: %s\n", directory.c_str(),
                   problem.c_str());
      set_aside.push_back(directory);
    }
    if (chosen >= 0) {
      // Damaged newer checkpoints move aside (kept, never loaded or counted by pruning again).
      for (const auto& directory : set_aside) {
        const std::string moved = set_aside_damaged(directory);
        std::fprintf(stderr,
                     "dtrain: kept it as %s; resuming from the newest checkpoint that "
                     "verifies, %s\n",
                     moved.c_str(), names[chosen].c_str());
      }
      if (!set_aside.empty()) set_latest(root, names[chosen]);
    } else if (damaged > 0) {
      chosen = -2;
    }
  }
  at::Tensor decision = at::tensor({chosen}, at::kLong);
  world_->broadcast(decision, {0})->wait();
  chosen = decision.item<int64_t>();
  DTRAIN_CHECK_INPUT(chosen != -2, "no checkpoint under ", root, " verifies (",
                     newest_problem.empty() ? "rank 0 names the damage" : newest_problem,
                     "; nothing was changed): repair or move them, or start fresh with "
                     "--no-resume");
  if (chosen < 0) return "";
  return root + "/" + names[chosen];
}

int64_t Trainer::restore_checkpoint(int64_t global_batch) {
  if (options_.checkpoint_dir.empty() || !options_.resume) return 0;
  const std::string directory = choose_checkpoint();
  if (directory.empty()) return 0;
  const CheckpointMeta meta = read_meta(directory);
  check_compatible(meta, model_tensors(), directory);
  DTRAIN_CHECK_INPUT(meta.global_batch == global_batch, "checkpoint ", directory,
                     " was trained with global batch ", meta.global_batch,
                     "; resuming with global batch ", global_batch,
                     " would change the data order (match the batch or disable resume)");
  strategy_->load(directory);
  std::string rng = concat(directory, "/rng-rank", world_->rank(), ".pt");
  if (!fs::exists(rng)) rng = directory + "/rng-rank0.pt";  // world grew: reuse rank 0's
  at::Tensor state;
  try {
    torch::load(state, rng);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, rng,
                 " is not a random-generator state: ", first_line(e.what_without_backtrace()));
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
  // What happened, whatever the progress display: batch logs run with --no-progress.
  if (world_->rank() == 0) {
    std::printf(
        "dtrain: resumed from step %lld of %s (saved by %s on %s; now %s on %s)\n",
        static_cast<long long>(meta.step), directory.c_str(), meta.strategy.c_str(),
        describe_layout(meta.world_size, meta.dp, meta.pp, meta.tp).c_str(),
        strategy_->name().c_str(),
        describe_layout(world_->size(), grid_->dp_size(), grid_->pp_size(), grid_->tp_size())
            .c_str());
    std::fflush(stdout);
  }
  return meta.step;
}

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
  const int replica = alone ? 0 : grid_->coordinates().dp;
  const int replicas = alone ? 1 : grid_->dp_size();
  const bool counts = grid_->coordinates().tp == 0;  // TP ranks compute the same values
  double sums[3] = {0, 0, 0};                        // loss * n, correct, n
  for (int64_t begin = 0; begin < dataset.size(); begin += options_.eval_batch_size * replicas) {
    const int64_t mine = begin + replica * options_.eval_batch_size;
    const int64_t end = std::min(mine + options_.eval_batch_size, dataset.size());
    // A forward can be collective (ZeRO-3 gathers parameters, a pipeline passes activations):
    // every rank runs as many, a replica without examples left on one example.
    auto batch = to_device(mine < end ? dataset.slice(mine, end) : dataset.slice(0, 1), device_);
    at::Tensor output = strategy_->evaluate_forward(batch.inputs);
    if (mine >= end || !output.defined()) continue;
    // A tensor-parallel model's loss and prediction are collective over its TP group.
    const double loss = loss_(output, batch.targets).item<double>();
    // Classes on the last dimension: [B, K] for a classifier, [B, T, V] for a language model
    // (each example's accuracy is then its share of tokens predicted).
    const at::Tensor predicted = predict_ ? predict_(output) : output.argmax(-1);
    if (!counts) continue;
    const auto n = static_cast<double>(end - mine);
    sums[0] += loss * n;
    sums[1] += predicted.eq(batch.targets)
                   .to(at::kDouble)
                   .reshape({output.size(0), -1})
                   .mean(1)
                   .sum()
                   .item<double>();
    sums[2] += n;
  }
  at::Tensor totals = at::tensor({sums[0], sums[1], sums[2]}, at::kDouble);
  if (!alone) world_->allreduce(totals)->wait();
  EvalResult result;
  result.examples = static_cast<int64_t>(totals[2].item<double>());
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

FitResult Trainer::fit(Model model, const data::TensorDataset& train,
                       const data::TensorDataset* validation) {
  const int rank = world_->rank();
  const int dp_size = grid_->dp_size();
  if (options_.global_batch > 0) {
    const int64_t per_micro_batch = options_.batch_size * dp_size;
    DTRAIN_CHECK_INPUT(options_.global_batch % per_micro_batch == 0, "global batch ",
                       options_.global_batch, " is not a whole number of micro-batches of ",
                       options_.batch_size, " x ", dp_size, " data-parallel ranks (",
                       per_micro_batch, ")");
    options_.accumulation_steps = options_.global_batch / per_micro_batch;
    options_.global_batch = 0;  // a second fit() derives nothing new from it
  }
  const int64_t local_step_batch = options_.batch_size * options_.accumulation_steps;
  const int64_t global_batch = local_step_batch * dp_size;
  const data::DistributedSampler sampler(train.size(), dp_size, grid_->coordinates().dp,
                                         {true, options_.seed, true});
  const int64_t steps_per_epoch = sampler.num_samples() / local_step_batch;
  DTRAIN_CHECK_INPUT(steps_per_epoch >= 1, "a step needs ", global_batch, " examples (batch ",
                     options_.batch_size, " x accumulation ", options_.accumulation_steps, " x ",
                     dp_size, " ranks) but the training set has ", train.size());
  const std::unique_ptr<Runner> runner = make_runner(loop_);
  int64_t epoch_steps = steps_per_epoch * options_.epochs;
  if (options_.max_steps > 0) epoch_steps = std::min(epoch_steps, options_.max_steps);
  const int64_t total_steps = runner->plan_steps(epoch_steps, options_);

  optim::OptimizerSpec spec = options_.optimizer;
  if (options_.reference_batch > 0) {
    spec.lr = optim::linear_scaled_lr(spec.lr, global_batch, options_.reference_batch);
  }
  if (!options_.trace_file.empty()) trace::start();
  // The model's own loss when it has one (a tensor-parallel model's vocab-parallel loss).
  loss_ = model.loss ? parallel::LossFn(model.loss) : options_.loss;
  predict_ = model.predict;
  strategy_->prepare(
      to_device(train.slice(0, std::min<int64_t>(options_.batch_size, train.size())), device_));
  if (!options_.init_from.empty()) {
    DTRAIN_CHECK_INPUT(options_.tensor_parallel == 1,
                       "--init-from loads the full model; with "
                       "--tensor-parallel each rank builds blocks of it: start the tensor-"
                       "parallel run from a checkpoint in --checkpoint-dir instead");
    load_model_from(*model.module, options_.init_from);
  }
  model.module->to(device_);
  strategy_->setup(std::move(model), optim::optimizer_factory(spec), grid_);
  if (rank == 0 && options_.progress) {
    const std::string layout = strategy_->layout();
    if (!layout.empty()) std::printf("%s\n", layout.c_str());
  }
  torch::manual_seed(options_.seed + 1000003ULL * static_cast<uint64_t>(rank + 1));
  const int64_t start_step = restore_checkpoint(global_batch);

  Run run(options_, *strategy_, *world_, train, validation, start_step, steps_per_epoch);
  run.total_steps = total_steps;
  run.last_step =
      options_.stop_at_step > 0 ? std::min(total_steps, options_.stop_at_step) : total_steps;
  run.dp_size = dp_size;
  run.dp_rank = grid_->coordinates().dp;
  run.local_step_batch = local_step_batch;
  run.global_batch = global_batch;
  run.schedule = std::make_unique<optim::LrSchedule>(spec.lr, total_steps, options_.schedule);
  run.weight_decay = spec.weight_decay;
  run.loss = loss_;
  run.needs = strategy_->data_needs();
  run.device = device_;
  run.result.global_batch = global_batch;
  run.result.learning_rate = spec.lr;
  run.evaluate = [&](bool alone) { return evaluate_on(*validation, alone); };
  run.save = [&](int64_t step, int64_t epoch, bool alone) {
    save_checkpoint(step, epoch, global_batch, alone);
  };
  runner->run(run);

  FitResult& result = run.result;
  result.seconds = seconds_since(run.start);
  run.evaluate_snapshots();
  if (!options_.trace_file.empty()) write_trace();
  result.samples_per_second = run.samples / std::max(run.train_seconds, 1e-9);
  if (run.leader) {
    MetricRecord summary{{"event", std::string("summary")},
                         {"steps", result.steps},
                         {"start_step", start_step},
                         {"seconds", result.seconds},
                         {"samples_per_s", result.samples_per_second},
                         {"global_batch", result.global_batch},
                         {"world_size", static_cast<int64_t>(world_->size())},
                         {"strategy", strategy_->name()}};
    // This rank's model state, as its strategy keeps it (what `dtrain plan` predicts).
    const parallel::MemoryReport memory = strategy_->memory_report();
    summary["parameter_bytes"] = memory.parameter_bytes;
    summary["gradient_bytes"] = memory.gradient_bytes;
    summary["optimizer_bytes"] = memory.optimizer_bytes;
    if (!result.losses.empty()) summary["final_loss"] = result.losses.back();
    if (result.validation) summary["val_accuracy"] = result.validation->accuracy;
    run.metrics.write(summary);
  }
  return std::move(run.result);
}

}  // namespace dtrain::train
