// One fit() as its runner sees it: what the Trainer prepared (the strategy set up, the batch
// arithmetic, the schedule, the resumed step), the outputs every runner writes (metrics,
// progress, the launcher's progress file, the result), and the Trainer's collective services
// (evaluation, checkpoints). Private to src/train.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/optim/LrSchedule.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"
#include "dtrain/train/Trainer.h"
#include "train/ExpertBalance.h"

namespace dtrain::train::runners {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start);

/// Tells `dtrain launch` (DTRAIN_PROGRESS_FILE) where the run resumed and the step it has
/// reached, so a restart can report the steps it cost. One small pwrite per step.
class ProgressReport {
 public:
  ProgressReport(const char* path, int64_t start);
  ~ProgressReport();
  ProgressReport(const ProgressReport&) = delete;
  ProgressReport& operator=(const ProgressReport&) = delete;
  void reached(int64_t step);
  /// Starts reporting to `path` (a rank that takes the lead mid-run).
  void open(const char* path);

 private:
  int fd_ = -1;
  int64_t start_;
};

/// DTRAIN_SIMULATE_FAILURE=RANK:STEP[:ATTEMPTS][:node|:stop]: RANK kills itself (SIGKILL) when
/// it reaches STEP, in the first ATTEMPTS attempts of a launch (default all); with ":node" it
/// kills its launcher first (a node lost; the rank follows through its parent-death signal);
/// with ":stop" it stops itself instead (SIGSTOP: a hung machine; ":stop-in-store" halfway
/// through a request to the rendezvous store, as a machine frozen mid-heartbeat): for testing
/// restarts and
/// fault tolerance the way machines fail; with ":input" it stops with bad input instead (an
/// InputError: exit 2, as a damaged file found mid-training). DTRAIN_SIMULATE_SLOW_STEP_MS=N:
/// every rank sleeps N ms after each step (to give tests time to act on a running job).
struct SimulatedFailure {
  int slow_ms = 0;
  int rank = -1;
  int64_t step = -1;
  bool armed = false;
  bool node = false;
  bool stop = false;
  /// RANK:STEP:stop-in-store: it stops halfway through a request to the rendezvous store.
  bool stop_in_store = false;
  bool input = false;
  /// RANK:STEP:checkpoint: killed while step STEP's checkpoint is written (its files written,
  /// or staged when asynchronous; before the other ranks hear of them).
  bool in_checkpoint = false;

  static SimulatedFailure from_env(int my_rank);
  void maybe_fire(int64_t reached) const;
  void maybe_fire_in_checkpoint(int64_t step) const;
  /// Connects to MASTER_ADDR:MASTER_PORT and sends the first byte of a request, no more.
  static void begin_store_request();
};

/// The batch's tensors on `device` (dtrain/common/Device.h's to_device).
data::Batch to_device(const data::Batch& batch, c10::Device device);

/// "val acc 87.10%" for a classifier; "val 1.62 nats/token (2.34 bits)" for a language model.
std::string describe_eval_as(const EvalResult& eval, bool tokens);

struct Run {
  Run(const TrainerOptions& options, parallel::Strategy& strategy, comm::Communicator& world,
      const data::TensorDataset& train, const data::TensorDataset* validation, int64_t start_step,
      int64_t steps_per_epoch);

  const TrainerOptions& options;
  parallel::Strategy& strategy;
  comm::Communicator& world;
  const data::TensorDataset& train;
  const data::TensorDataset* validation;
  /// This rank writes the run's outputs (rank 0; --fault-tolerance replicas: the leading
  /// replica's first rank, which changes when that replica fails: take_lead()).
  bool leader;
  /// The step this run resumed from, and where it ends: the schedule's length, the step it
  /// halts at (--stop-at-step) and the epochs' length.
  const int64_t start_step;
  int64_t total_steps = 0;
  int64_t last_step = 0;
  const int64_t steps_per_epoch;
  int dp_size = 1;
  int dp_rank = 0;
  int64_t local_step_batch = 0;
  int64_t global_batch = 0;
  std::unique_ptr<optim::LrSchedule> schedule;
  double weight_decay = 0.0;
  parallel::LossFn loss;
  parallel::DataNeeds needs;
  /// A mixture of experts' loads, bias and metrics after each step (null: no MoE layers).
  std::unique_ptr<ExpertBalance> experts;
  /// Where batches go (the model's device).
  c10::Device device{c10::DeviceType::CPU};

  // Outputs.
  ProgressReport report;
  const SimulatedFailure failure;
  MetricsWriter metrics;
  ProgressBar progress;
  const Clock::time_point start = Clock::now();
  double train_seconds = 0.0;
  int64_t samples = 0;
  /// Consecutive steps whose loss or gradient norm was not finite.
  int64_t nonfinite_steps = 0;
  FitResult result;

  /// The Trainer's collective services: evaluation on `validation` (`alone`: this rank by
  /// itself, not collective) and a checkpoint (`alone`: rank 0 saving by itself).
  std::function<EvalResult(bool alone)> evaluate;
  std::function<void(int64_t step, int64_t epoch, bool alone)> save;
  /// The user's hooks (Trainer::set_callbacks); nullptr: none.
  const TrainCallbacks* callbacks = nullptr;
  /// Calls callbacks->on_step when there is one.
  void step_done(const StepEvent& event) const {
    if (callbacks != nullptr && callbacks->on_step) callbacks->on_step(event);
  }

  /// This rank leads from now on (the replica that led failed): it appends to the metrics file
  /// and reports progress to the launcher.
  void take_lead();
  /// Evaluates (see `evaluate`) and records it in the metrics file (rank 0).
  void evaluate_and_record(int64_t step, std::optional<int64_t> epoch, bool alone);
  /// --defer-eval: rank 0 keeps a copy of the parameters (and buffers) for the end.
  void snapshot(int64_t step, int64_t epoch);
  /// After training (rank 0): the deferred evaluations, on the clock of each copy's moment.
  void evaluate_snapshots();
  /// Counts a step's finiteness; Error once --max-nonfinite-steps consecutive steps were not.
  void check_finite(const parallel::StepResult& step, int64_t step_number);
  /// Asynchronous strategies at the end, on rank 0 alone: the strategy's run record, the final
  /// evaluation (of the newest parameters) and checkpoint at `steps`.
  void finish_alone(const std::map<std::string, double>& run_metrics, int64_t steps, int64_t epoch);

 private:
  struct Snapshot {
    int64_t step = 0, epoch = 0;
    double seconds = 0, train_seconds = 0;
    std::vector<at::Tensor> state;
  };
  std::vector<at::Tensor> model_tensors() const;
  std::vector<Snapshot> snapshots_;
};

/// Drives a strategy through a run: the synchronous step loop, the asynchronous workers' loop,
/// or a strategy's own loop (parallel::Loop).
class Runner {
 public:
  virtual ~Runner() = default;
  /// The steps the run makes, given those its epochs make (capped by --max-steps).
  virtual int64_t plan_steps(int64_t epoch_steps, const TrainerOptions& options) const {
    (void)options;
    return epoch_steps;
  }
  virtual void run(Run& run) = 0;
};

std::unique_ptr<Runner> make_runner(parallel::Loop loop);
/// The runners (StepRunner.cpp, DrivenRunner.cpp); make_runner picks one.
std::unique_ptr<Runner> make_step_runner();
std::unique_ptr<Runner> make_asynchronous_runner();
std::unique_ptr<Runner> make_driven_runner();

}  // namespace dtrain::train::runners
