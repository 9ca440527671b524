// The training loop.
#include "dtrain/train/Trainer.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/common/Trace.h"
#include "common/Files.h"
#include "common/Straggler.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/nn/tensor/Split.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

// "4 ranks (DP 2 x PP 2 x TP 1)": how a run or a checkpoint is laid out.
std::string describe_layout(int world, int dp, int pp, int tp) {
  return concat(world, world == 1 ? " rank" : " ranks", " (DP ", dp, " x PP ", pp, " x TP ", tp, ")");
}

// "val acc 87.10%" for a classifier; "val 1.62 nats/token (2.34 bits)" for a language model.
std::string describe_eval_as(const EvalResult& eval, bool tokens) {
  char text[96];
  if (tokens) {
    std::snprintf(text, sizeof(text), "val %.4f nats/token (%.3f bits), next-token acc %.1f%%",
                  eval.loss, eval.loss / std::log(2.0), eval.accuracy * 100);
  } else {
    std::snprintf(text, sizeof(text), "val acc %.2f%%", eval.accuracy * 100);
  }
  return text;
}


using Clock = std::chrono::steady_clock;

/// Iterations of a strategy that runs its own loop (Sandblaster L-BFGS) without --max-steps.
constexpr int64_t kDrivenIterations = 100;

// Tells `dtrain launch` (DTRAIN_PROGRESS_FILE) where the run resumed and the step it has reached,
// so a restart can report the steps it cost. One small pwrite per step.
class ProgressReport {
 public:
  ProgressReport(const char* path, int64_t start) : start_(start) {
    if (path != nullptr && *path != '\0') fd_ = ::open(path, O_WRONLY | O_CLOEXEC);
    reached(start);
  }
  ~ProgressReport() {
    if (fd_ >= 0) ::close(fd_);
  }
  void reached(int64_t step) {
    if (fd_ < 0) return;
    char line[64];
    const int n = std::snprintf(line, sizeof(line), "%20lld %20lld\n",
                                static_cast<long long>(start_), static_cast<long long>(step));
    if (::pwrite(fd_, line, n, 0) != n) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_ = -1;
  int64_t start_;
};

// DTRAIN_SIMULATE_FAILURE="RANK:STEP[:ATTEMPTS]": rank RANK kills itself (SIGKILL) when it
// reaches STEP, in the first ATTEMPTS attempts of a launch (default all): for testing restarts
// and failure handling the way a crashed machine would fail.
// DTRAIN_SIMULATE_FAILURE=RANK:STEP[:ATTEMPTS][:node]: RANK kills itself at STEP (in the first
// ATTEMPTS attempts); with ":node" it kills its launcher first (a node lost; the rank follows
// through its parent-death signal). DTRAIN_SIMULATE_SLOW_STEP_MS=N: every rank sleeps N ms after
// each step (to give tests time to act on a running job).
struct SimulatedFailure {
  int slow_ms = 0;
  int rank = -1;
  int64_t step = -1;
  bool armed = false;
  bool node = false;

  static SimulatedFailure from_env(int my_rank) {
    SimulatedFailure f;
    if (const char* slow = std::getenv("DTRAIN_SIMULATE_SLOW_STEP_MS")) {
      f.slow_ms = std::max(0, std::atoi(slow));
    }
    const char* spec = std::getenv("DTRAIN_SIMULATE_FAILURE");
    if (spec == nullptr || *spec == '\0') return f;
    long long rank = -1, step = -1, attempts = -1;
    const int fields = std::sscanf(spec, "%lld:%lld:%lld", &rank, &step, &attempts);
    const std::string text = spec;
    f.node = text.size() > 5 && text.compare(text.size() - 5, 5, ":node") == 0;
    DTRAIN_CHECK_INPUT(fields >= 2 && rank >= 0 && step >= 1,
                       "DTRAIN_SIMULATE_FAILURE='", spec, "' is not RANK:STEP[:ATTEMPTS][:node]");
    const char* restart = std::getenv("DTRAIN_RESTART_COUNT");
    const long long attempt = restart ? std::atoll(restart) : 0;
    f.rank = static_cast<int>(rank);
    f.step = step;
    f.armed = rank == my_rank && (fields < 3 || attempt < attempts);
    return f;
  }
  void maybe_fire(int64_t reached) const {
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
    if (armed && reached == step) {
      std::fprintf(stderr, "dtrain: DTRAIN_SIMULATE_FAILURE: rank %d kills %s at step %lld\n",
                   rank, node ? "its launcher and itself" : "itself",
                   static_cast<long long>(step));
      std::fflush(stderr);
      if (node) ::kill(::getppid(), SIGKILL);
      ::raise(SIGKILL);
    }
  }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

}  // namespace

void validate(const TrainerOptions& o) {
  DTRAIN_CHECK_INPUT(o.epochs >= 1, "epochs must be >= 1, got ", o.epochs);
  DTRAIN_CHECK_INPUT(!o.defer_eval || (o.strategy != "zero3" && o.strategy != "pipeline" &&
                                       o.pipeline_parallel <= 1 && o.tensor_parallel <= 1),
                     "--defer-eval copies the whole model on rank 0: not with zero3, pipeline or "
                     "tensor parallelism");
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
  if (options_.pipeline_parallel > 1 || options_.strategy == "pipeline") {
    // The pipeline wraps the data-parallel strategy the user chose for its stages.
    if (options_.strategy != "pipeline") {
      options_.strategy_options.pipeline_data_parallel = options_.strategy;
    }
    options_.strategy = "pipeline";
  }
  grid_ = std::make_shared<comm::ProcessGrid>(world_, options_.tensor_parallel,
                                              options_.pipeline_parallel);
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
      std::fprintf(stderr, "dtrain: warning: %s/latest names checkpoint '%s', which does not exist; "
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
          std::fprintf(stderr, "dtrain: warning: checkpoint %s has no checksums (an older "
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
        std::fprintf(stderr, "dtrain: kept it as %s; resuming from the newest checkpoint that "
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
    DTRAIN_THROW(InputError, rng, " is not a random-generator state: ",
                 first_line(e.what_without_backtrace()));
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
  // What happened, whatever the progress display: batch logs run with --no-progress.
  if (world_->rank() == 0) {
    std::printf("dtrain: resumed from step %lld of %s (saved by %s on %s; now %s on %s)\n",
                static_cast<long long>(meta.step), directory.c_str(), meta.strategy.c_str(),
                describe_layout(meta.world_size, meta.dp, meta.pp, meta.tp).c_str(),
                strategy_->name().c_str(),
                describe_layout(world_->size(), grid_->dp_size(), grid_->pp_size(), grid_->tp_size()).c_str());
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
  double sums[3] = {0, 0, 0};  // loss * n, correct, n
  for (int64_t begin = 0; begin < dataset.size();
       begin += options_.eval_batch_size * replicas) {
    const int64_t mine = begin + replica * options_.eval_batch_size;
    const int64_t end = std::min(mine + options_.eval_batch_size, dataset.size());
    // A forward can be collective (ZeRO-3 gathers parameters, a pipeline passes activations):
    // every rank runs as many, a replica without examples left on one example.
    auto batch = mine < end ? dataset.slice(mine, end) : dataset.slice(0, 1);
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
    sums[1] += predicted.eq(batch.targets).to(at::kDouble).reshape({output.size(0), -1})
                   .mean(1).sum().item<double>();
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
  data::DistributedSampler sampler(train.size(), dp_size, grid_->coordinates().dp,
                                   {true, options_.seed, true});
  const int64_t steps_per_epoch = sampler.num_samples() / local_step_batch;
  DTRAIN_CHECK_INPUT(steps_per_epoch >= 1, "a step needs ", global_batch,
                     " examples (batch ", options_.batch_size, " x accumulation ",
                     options_.accumulation_steps, " x ", dp_size,
                     " ranks) but the training set has ", train.size());
  int64_t total_steps = steps_per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  // A strategy running its own loop (Sandblaster L-BFGS) counts its iterations as steps:
  // --max-steps of them, else kDrivenIterations.
  const bool driven = strategy_->drives_loop();
  if (driven) total_steps = options_.max_steps > 0 ? options_.max_steps : kDrivenIterations;

  optim::OptimizerSpec spec = options_.optimizer;
  if (options_.reference_batch > 0) {
    spec.lr = optim::linear_scaled_lr(spec.lr, global_batch, options_.reference_batch);
  }
  const optim::LrSchedule schedule(spec.lr, total_steps, options_.schedule);
  if (!options_.trace_file.empty()) trace::start();
  // The model's own loss when it has one (a tensor-parallel model's vocab-parallel loss).
  loss_ = model.loss ? parallel::LossFn(model.loss) : options_.loss;
  predict_ = model.predict;
  strategy_->prepare(train.slice(0, std::min<int64_t>(options_.batch_size, train.size())));
  strategy_->setup(std::move(model), optim::optimizer_factory(spec), grid_);
  const parallel::DataNeeds needs = strategy_->data_needs();
  if (rank == 0 && options_.progress) {
    const std::string layout = strategy_->layout();
    if (!layout.empty()) std::printf("%s\n", layout.c_str());
  }
  torch::manual_seed(options_.seed + 1000003ULL * static_cast<uint64_t>(rank + 1));

  FitResult result;
  result.global_batch = global_batch;
  result.learning_rate = spec.lr;
  const int64_t start_step = restore_checkpoint(global_batch);
  result.start_step = start_step;
  result.steps = start_step;

  const bool leader = rank == 0;
  ProgressReport report(leader ? std::getenv("DTRAIN_PROGRESS_FILE") : nullptr, start_step);
  const auto simulated_failure = SimulatedFailure::from_env(rank);
  MetricsWriter metrics(leader ? options_.metrics_file : "", start_step > 0);
  ProgressBar progress(stdout, ProgressBar::is_terminal(stdout),
                       std::max<int64_t>(1, steps_per_epoch / 10));

  const auto start = Clock::now();
  double train_seconds = 0.0;
  // --defer-eval: the parameters (and buffers) at each evaluation point, evaluated at the end.
  struct Snapshot {
    int64_t step = 0, epoch = 0;
    double seconds = 0, train_seconds = 0;
    std::vector<at::Tensor> state;
  };
  std::vector<Snapshot> snapshots;
  auto model_tensors_now = [&] {
    std::vector<at::Tensor> out;
    for (const auto& p : strategy_->model().module->parameters()) out.push_back(p.detach());
    for (const auto& b : strategy_->model().module->buffers()) out.push_back(b.detach());
    return out;
  };
  auto model_state = [&] {
    std::vector<at::Tensor> copy;
    for (const auto& t : model_tensors_now()) copy.push_back(t.clone());
    return copy;
  };
  auto set_model_state = [&](const std::vector<at::Tensor>& state) {
    torch::NoGradGuard no_grad;
    const std::vector<at::Tensor> now = model_tensors_now();
    for (size_t i = 0; i < now.size(); ++i) now[i].copy_(state[i]);
  };
  int64_t samples = 0;
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  int64_t nonfinite_steps = 0;
  const int64_t last_step = options_.stop_at_step > 0 ? std::min(total_steps, options_.stop_at_step)
                                                      : total_steps;
  // Asynchronous workers (a parameter server's) each run through their own share of the data as
  // fast as they can, with no per-step collective; the run ends when all of them together have
  // made the worker steps of the synchronous run (steps x replicas), however they were shared
  // out. One worker left alone would make them all: that bounds its loop.
  const bool async = !strategy_->synchronous();
  const int64_t loop_end = driven ? start_step
                           : async ? start_step + (last_step - start_step) * dp_size
                                   : last_step;
  auto global_step = [&](int64_t local) {
    return async ? start_step + strategy_->global_steps() / dp_size : local;
  };
  for (int64_t step = start_step; step < loop_end; ++step) {
    const int64_t epoch = step / steps_per_epoch;
    const int64_t in_epoch = step % steps_per_epoch;
    if (epoch != order_epoch) {
      sampler.set_epoch(epoch);
      order = sampler.indices();
      order_epoch = epoch;
    }
    const double lr = schedule.at(step);
    optim::set_learning_rate(strategy_->optimizer(), lr);
    std::vector<data::Batch> micro_batches;
    for (int64_t m = 0; m < options_.accumulation_steps; ++m) {
      const int64_t begin = in_epoch * local_step_batch + m * options_.batch_size;
      const std::vector<int64_t> indices(order.begin() + begin,
                                         order.begin() + begin + options_.batch_size);
      if (needs.inputs) {
        micro_batches.push_back(train.get(indices));
      } else if (needs.targets) {
        micro_batches.push_back({at::Tensor(), train.get_targets(indices)});
      } else {
        micro_batches.emplace_back();
      }
    }
    trace::Span step_span("step", concat("step ", step + 1));
    const auto step_start = Clock::now();
    parallel::StepResult step_result = strategy_->train_step(micro_batches, loss_);
    // The loss every rank reports is the mean over ranks; the sum is non-finite when any
    // rank's is, so all ranks agree on stopping. (Asynchronous workers report their own.)
    if (!async) {
      at::Tensor loss_sum = at::tensor({step_result.loss}, at::kDouble);
      world_->allreduce(loss_sum)->wait();
      step_result.loss = loss_sum.item<double>() / world_->size();
    }
    const int64_t reached = global_step(step + 1);
    const bool done = async && reached >= last_step;
    if (rank == options_.slowdown_rank && options_.slowdown_factor > 1.0) {
      straggle((options_.slowdown_factor - 1.0) * seconds_since(step_start), options_.slowdown_spin);
    }
    const double step_seconds = seconds_since(step_start);
    const auto skipped = step_result.metrics.find("step_skipped");
    const bool finite = std::isfinite(step_result.loss) &&
                        (step_result.grad_norm < 0 || std::isfinite(step_result.grad_norm));
    if (!finite && !(skipped != step_result.metrics.end() && skipped->second > 0)) {
      ++nonfinite_steps;
    } else if (finite) {
      nonfinite_steps = 0;
    }
    if (options_.max_nonfinite_steps > 0 && nonfinite_steps >= options_.max_nonfinite_steps) {
      if (leader && options_.progress) progress.finish_epoch("stopped");
      DTRAIN_THROW(Error, "training diverged: the loss (", step_result.loss, ")",
                   step_result.grad_norm >= 0 ? concat(" or gradient norm (", step_result.grad_norm, ")")
                                              : std::string(),
                   " was not finite for ", nonfinite_steps, " consecutive steps, the last at step ",
                   step + 1, " (limit --max-nonfinite-steps ", options_.max_nonfinite_steps,
                   "); no checkpoint was written since; try a lower --lr, --max-grad-norm or "
                   "--precision fp32");
    }
    train_seconds += step_seconds;
    samples += step_result.samples * (async ? 1 : dp_size);
    result.losses.push_back(step_result.loss);
    result.steps = reached;
    report.reached(reached);
    const double throughput = samples / std::max(train_seconds, 1e-9);

    if (leader && ((step + 1) % options_.log_every == 0 || step + 1 == total_steps)) {
      MetricRecord record{{"event", std::string("step")},
                          {"step", reached},
                          {"epoch", epoch},
                          {"loss", step_result.loss},
                          {"lr", lr},
                          {"step_ms", step_seconds * 1e3},
                          {"samples_per_s", throughput}};
      if (step_result.grad_norm >= 0) record["grad_norm"] = step_result.grad_norm;
      if (async) record["worker_step"] = step + 1;
      for (const auto& [key, value] : step_result.metrics) record[key] = value;
      metrics.write(record);
    }
    if (leader && options_.progress) {
      const double eta = (total_steps - step - 1) * train_seconds / (step + 1 - start_step);
      progress.update(epoch, options_.epochs, in_epoch + 1, steps_per_epoch, step_result.loss,
                      throughput, eta);
    }
    const bool epoch_end = in_epoch + 1 == steps_per_epoch || step + 1 == total_steps;
    const bool halting = async ? done : step + 1 == last_step;
    const bool eval_due = options_.eval_every > 0 && (step + 1) % options_.eval_every == 0;
    // Deferred: rank 0 keeps a copy of the parameters, evaluated after training.
    if ((epoch_end || eval_due) && validation != nullptr && options_.defer_eval) {
      if (leader && (!async || !halting)) {
        snapshots.push_back({reached, epoch, seconds_since(start), train_seconds, model_state()});
      }
    } else if ((epoch_end || eval_due) && validation != nullptr && (!async || (leader && !halting))) {
      // Asynchronous: rank 0 alone evaluates, and the final evaluation comes after the loop.
      result.validation = evaluate_on(*validation, async);
      if (leader) {
        MetricRecord record{{"event", std::string("eval")},
                            {"step", reached},
                            {"epoch", epoch},
                            {"seconds", seconds_since(start)},
                            {"train_seconds", train_seconds},
                            {"val_loss", result.validation->loss},
                            {"val_accuracy", result.validation->accuracy}};
        if (options_.token_loss) record["val_bits_per_token"] = result.validation->loss / std::log(2.0);
        metrics.write(record);
        if (options_.progress && !epoch_end) {
          progress.note(concat("step ", step + 1, ": ", describe_eval_as(*result.validation, options_.token_loss)));
        }
      }
    }
    if (leader && options_.progress && epoch_end) {
      progress.finish_epoch(result.validation ? describe_eval_as(*result.validation, options_.token_loss) : "");
    }
    const bool periodic = options_.checkpoint_every > 0 && (step + 1) % options_.checkpoint_every == 0;
    if (!options_.checkpoint_dir.empty() && (periodic || epoch_end || halting) &&
        nonfinite_steps == 0 && (!async || (leader && !halting))) {
      trace::Span checkpoint_span("checkpoint", concat("checkpoint ", reached));
      save_checkpoint(reached, epoch, global_batch, async);
    }
    simulated_failure.maybe_fire(step + 1);
    if (done) break;
  }
  // Asynchronous strategies at the end, on rank 0 alone: the strategy's run record, the final
  // evaluation (of the newest parameters) and checkpoint at `steps`.
  auto finish_alone = [&](int64_t steps, int64_t epoch) {
    MetricRecord run{{"event", std::string("strategy")}};
    for (const auto& [key, value] : strategy_->run_metrics()) run[key] = value;
    if (run.size() > 1) metrics.write(run);
    result.steps = steps;
    report.reached(steps);
    if (validation != nullptr) {
      result.validation = evaluate_on(*validation, true);
      metrics.write({{"event", std::string("eval")},
                     {"step", steps},
                     {"seconds", seconds_since(start)},
                     {"train_seconds", train_seconds},
                     {"val_loss", result.validation->loss},
                     {"val_accuracy", result.validation->accuracy}});
      if (options_.progress) progress.note(describe_eval_as(*result.validation, options_.token_loss));
    }
    if (!options_.checkpoint_dir.empty() && nonfinite_steps == 0) {
      save_checkpoint(steps, epoch, global_batch, true);
    }
  };
  if (driven) {
    parallel::LoopContext context;
    context.train = &train;
    context.loss = loss_;
    context.max_iterations = std::max<int64_t>(0, last_step - start_step);
    context.chunk = options_.eval_batch_size;
    context.slowdown = rank == options_.slowdown_rank ? options_.slowdown_factor : 1.0;
    context.slowdown_spin = options_.slowdown_spin;
    context.weight_decay = spec.weight_decay;
    context.stall_ms = world_->timeout().count();
    context.on_iteration = [&](const parallel::IterationReport& iteration) {
      const int64_t reached = start_step + iteration.iteration;
      train_seconds += iteration.seconds;
      samples += iteration.evaluations * train.size();
      result.losses.push_back(iteration.loss);
      result.steps = reached;
      report.reached(reached);
      const double throughput = samples / std::max(train_seconds, 1e-9);
      MetricRecord record{{"event", std::string("step")},
                          {"step", reached},
                          {"epoch", int64_t{0}},
                          {"loss", iteration.loss},
                          {"step_ms", iteration.seconds * 1e3},
                          {"samples_per_s", throughput}};
      if (iteration.grad_norm >= 0) record["grad_norm"] = iteration.grad_norm;
      for (const auto& [key, value] : iteration.metrics) record[key] = value;
      metrics.write(record);
      if (options_.progress) {
        const double eta = (last_step - reached) * train_seconds / std::max<int64_t>(1, reached - start_step);
        progress.update(0, 1, reached, total_steps, iteration.loss, throughput, eta);
      }
      const bool eval_due = validation != nullptr && options_.eval_every > 0 &&
                            reached % options_.eval_every == 0;
      if (eval_due && options_.defer_eval) {
        snapshots.push_back({reached, 0, seconds_since(start), train_seconds, model_state()});
      } else if (eval_due) {
        result.validation = evaluate_on(*validation, true);
        metrics.write({{"event", std::string("eval")},
                       {"step", reached},
                       {"seconds", seconds_since(start)},
                       {"train_seconds", train_seconds},
                       {"val_loss", result.validation->loss},
                       {"val_accuracy", result.validation->accuracy}});
        if (options_.progress) {
          progress.note(concat("iteration ", reached, ": ",
                               describe_eval_as(*result.validation, options_.token_loss)));
        }
      }
      if (!options_.checkpoint_dir.empty() && options_.checkpoint_every > 0 &&
          reached % options_.checkpoint_every == 0) {
        save_checkpoint(reached, 0, global_batch, true);
      }
    };
    // A simulated failure (DTRAIN_SIMULATE_FAILURE=RANK:N) fires after the rank's N-th unit
    // of work, computed and sent but not yet reported.
    context.on_work = [&](int64_t done) { simulated_failure.maybe_fire(done); };
    const int64_t iterations = strategy_->run_loop(context);
    if (leader) {
      if (options_.progress) progress.finish_epoch("");
      finish_alone(start_step + iterations, 0);
    }
  }
  if (driven) result.global_batch = train.size();  // every iteration uses the whole set
  if (async && !driven) {
    // Every worker sends what it holds and leaves (no collective: a worker that died must not
    // stop the others); rank 0 waits for the others' last updates, then takes the newest
    // parameters for the final evaluation and checkpoint.
    strategy_->finish();
    if (leader) {
      const std::string missing = strategy_->await_workers();
      if (!missing.empty()) std::fprintf(stderr, "%s\n", missing.c_str());
      const int64_t steps = global_step(result.steps);
      finish_alone(steps, steps / std::max<int64_t>(1, steps_per_epoch));
    }
  }
  result.seconds = seconds_since(start);
  if (leader && !snapshots.empty()) {
    // The deferred evaluations, on the clock of the moment each copy was taken.
    const std::vector<at::Tensor> final_state = model_state();
    std::optional<EvalResult> last;
    for (const Snapshot& snapshot : snapshots) {
      set_model_state(snapshot.state);
      last = evaluate_on(*validation, true);
      metrics.write({{"event", std::string("eval")},
                     {"step", snapshot.step},
                     {"epoch", snapshot.epoch},
                     {"seconds", snapshot.seconds},
                     {"train_seconds", snapshot.train_seconds},
                     {"deferred", int64_t{1}},
                     {"val_loss", last->loss},
                     {"val_accuracy", last->accuracy}});
    }
    set_model_state(final_state);
    if (!result.validation) result.validation = last;
  }
  if (!options_.trace_file.empty()) write_trace();
  result.samples_per_second = samples / std::max(train_seconds, 1e-9);
  if (leader) {
    MetricRecord summary{{"event", std::string("summary")},
                         {"steps", result.steps},
                         {"start_step", start_step},
                         {"seconds", result.seconds},
                         {"samples_per_s", result.samples_per_second},
                         {"global_batch", result.global_batch},
                         {"world_size", static_cast<int64_t>(world_->size())},
                         {"strategy", strategy_->name()}};
    if (!result.losses.empty()) summary["final_loss"] = result.losses.back();
    if (result.validation) summary["val_accuracy"] = result.validation->accuracy;
    metrics.write(summary);
  }
  return result;
}

}  // namespace dtrain::train
