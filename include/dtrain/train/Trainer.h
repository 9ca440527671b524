// Trainer: training shared by every strategy - sampling, gradient accumulation, the
// learning-rate schedule, evaluation, checkpoints (atomic, resumable), JSONL metrics and a
// progress bar on rank 0. The strategy is a single option; the registry says which runner
// (synchronous steps, asynchronous workers, the strategy's own loop) drives it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Model.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"

namespace dtrain::train {

struct TrainerOptions {
  /// A registered strategy name (parallel::strategy_names()).
  std::string strategy = "ddp";
  parallel::StrategyOptions strategy_options;
  int64_t epochs = 1;
  /// Examples per rank per micro-batch.
  int64_t batch_size = 64;
  /// Micro-batches per optimizer step (gradients are synchronized once per step).
  int64_t accumulation_steps = 1;
  /// > 0: keep this global batch at any world size (DeepSpeed's train_batch_size): the
  /// micro-batches per step become global_batch / (batch_size x data-parallel ranks), which
  /// must be whole. Elastic jobs use it so a restart at another world size keeps the step, the
  /// data order and the learning rate. It replaces accumulation_steps.
  int64_t global_batch = 0;
  optim::OptimizerSpec optimizer;
  optim::LrScheduleSpec schedule;
  /// > 0: the linear scaling rule, lr = optimizer.lr * global batch / reference_batch.
  int64_t reference_batch = 0;
  uint64_t seed = 0;
  /// Where checkpoints go ("" = none). Saved at the end of every epoch and every
  /// `checkpoint_every` steps (0 = epoch ends only).
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  /// Write checkpoints in the background: a save copies the state to host memory and training
  /// goes on while a thread writes it (CheckpointManager::save).
  bool async_checkpoint = false;
  /// Continue from the newest checkpoint in checkpoint_dir when there is one.
  bool resume = true;
  /// Start from these weights (a checkpoint of any strategy and world size, or a consolidated
  /// file such as `dtrain fl --save-model` writes); a resumed checkpoint takes precedence.
  std::string init_from;
  /// Load init_from's weights even where they hold NaN or Inf (refused otherwise, naming the
  /// first such tensor).
  bool allow_non_finite_weights = false;
  /// JSONL metrics file written by rank 0 ("" = none).
  std::string metrics_file;
  /// TensorBoard events written by rank 0 in this folder ("" = none): metrics_file's numbers,
  /// exactly, and the run's configuration as text (checkpoint_extras' "config" and "plan").
  std::string tensorboard_dir;
  int64_t log_every = 10;
  /// Progress bar on rank 0.
  bool progress = true;
  /// Train for this many optimizer steps in total (0 = all epochs); the schedule spans them.
  int64_t max_steps = 0;
  /// Halt when this step is reached (0 = never) without changing the schedule or the run's
  /// length: for time-sliced jobs that resume from their checkpoint later.
  int64_t stop_at_step = 0;
  /// --simulate-slowdown RANK:FACTOR[:spin]: rank `slowdown_rank` takes `slowdown_factor` times
  /// as long per step (it sleeps the difference after each step, or with `slowdown_spin` keeps
  /// its core busy for it, as a slow machine's capacity is lost): a straggler, for tests and
  /// benchmarks. -1 = none.
  int slowdown_rank = -1;
  double slowdown_factor = 1.0;
  bool slowdown_spin = false;
  /// Examples per evaluation forward (--eval-batch-size); 0: 256, or for token windows as many
  /// as hold 16384 tokens, at least `batch_size` (attention's scores grow with the square of the
  /// window: 256 windows of 4096 tokens were a 64 GiB product). 256 keeps the CNN's activations
  /// (~25 MB a layer) under the 32 MB mmap threshold the ranks set: at 1000 every batch's 100 MB
  /// activations were fresh mappings, page-faulted in, and evaluating the test set took 7x
  /// longer.
  int64_t eval_batch_size = 0;
  /// > 0: also evaluate every N steps (else at epoch ends only).
  int64_t eval_every = 0;
  /// Evaluate after training instead: rank 0 copies the parameters at each evaluation point
  /// and evaluates the copies at the end, each recorded with the clock of its moment - the
  /// run's time leaves evaluation out (time-to-accuracy measurements). Strategies whose rank 0
  /// holds the whole model only (not zero3, pipeline or tensor parallelism).
  bool defer_eval = false;
  /// BatchNorm statistics over the data-parallel group (torch.nn.SyncBatchNorm): every
  /// nn::SyncBatchNorm2d layer of the model gets the group, so N ranks train as one process on
  /// the global batch. Synchronous strategies; the model needs such layers (dtrain's ResNets).
  bool sync_batchnorm = false;
  /// The outputs are per-token predictions (a language model): validation loss is reported in
  /// nats and bits per token, accuracy as the share of next tokens predicted.
  bool token_loss = false;
  /// A language model's training FLOPs per token (models::gpt_training_flops_per_token; 0 = not
  /// known): the progress lines and step records then show the model FLOP/s, and with
  /// peak_tflops the model FLOPs utilization (MFU).
  double flops_per_token = 0.0;
  /// One rank's device peak in TFLOP/s at the run's precision (0 = not known: no MFU).
  double peak_tflops = 0.0;
  /// Written into every checkpoint's meta.json (CheckpointMeta::extras).
  std::map<std::string, std::string> checkpoint_extras;
  /// Stop with an error after this many consecutive steps whose loss (averaged over ranks) or
  /// gradient norm is not finite (0 = never). Steps the loss scaler skipped do not count. No
  /// checkpoint is written while the latest step was non-finite.
  int64_t max_nonfinite_steps = 3;
  int tensor_parallel = 1;
  /// A mixture of experts: DeepSeek-V3's auxiliary-loss-free balancing, each layer's bias moved
  /// by this after every step from the step's load summed over the data-parallel ranks (0: off).
  double moe_bias_rate = 0.0;
  /// > 1: a mixture of experts' experts split over this many data-parallel ranks
  /// (ProcessGrid::split_experts; the model built over grid()->ep()).
  int expert_parallel = 1;
  /// > 1: each sequence split over this many data-parallel ranks (context parallelism,
  /// ProcessGrid::split_context; the model built over grid()->cp()), which read the same
  /// examples: the data is cut into data-parallel size / this shares.
  int context_parallel = 1;
  /// > 1: pipeline parallelism over this many ranks (the "pipeline" strategy, its stages made
  /// data-parallel by `strategy`: ddp or zero1); the accumulation steps are its micro-batches.
  int pipeline_parallel = 1;
  /// Non-empty: a pipeline whose stage s runs on stage_replicas[s] ranks (PipeDream's
  /// replicated stages; --stage-replicas); the world is their sum (x tensor_parallel) and
  /// pipeline_parallel their count. The step's micro-batches are the whole pipeline's, dealt to
  /// each stage's replicas in turn.
  std::vector<int> stage_replicas;
  /// Chrome / Perfetto trace of every rank's spans, written at the end of fit() ("" = none).
  std::string trace_file;
  parallel::LossFn loss = parallel::cross_entropy;
};

/// InputError naming the first option out of range.
void validate(const TrainerOptions& options);

struct EvalResult {
  double loss = 0.0;
  double accuracy = 0.0;
  int64_t examples = 0;
};

struct FitResult {
  /// Optimizer steps done in total, and the step this run started from (> 0 when resumed).
  int64_t steps = 0;
  int64_t start_step = 0;
  /// The steps the run's schedule has (its epochs, or --max-steps).
  int64_t total_steps = 0;
  /// This rank's loss at every step this run did.
  std::vector<double> losses;
  std::optional<EvalResult> validation;
  /// The whole fit, evaluations and checkpoints included.
  double seconds = 0.0;
  /// The steps alone (what samples_per_second divides by).
  double train_seconds = 0.0;
  double samples_per_second = 0.0;
  int64_t global_batch = 0;
  double learning_rate = 0.0;
  /// This rank wrote the run's outputs at the end (rank 0; --fault-tolerance replicas: the
  /// leading replica's first rank): it prints the summary.
  bool leader = false;
  /// The signal of a stop on request (dtrain/train/Stop.h): the run stopped after step `steps`
  /// (and saved a checkpoint there with a checkpoint folder); 0 when it ran to its end.
  int stopped_by = 0;
};

/// How a step's examples divide over `dp` data-parallel replicas: each rank's micro-batch
/// (batch_size), the micro-batches it accumulates per step, and the global batch they make.
struct BatchPlan {
  int64_t micro_batch = 0;
  int64_t micro_batches = 1;
  int64_t global_batch = 0;
  /// The examples one rank consumes per step.
  int64_t local_step_batch() const { return micro_batch * micro_batches; }
};

/// options.global_batch (> 0) fixes the global batch and derives the micro-batches;
/// otherwise options.accumulation_steps are the micro-batches. InputError when the global batch
/// is not a whole number of micro-batches of batch_size x dp.
BatchPlan plan_batches(const TrainerOptions& options, int64_t dp);

/// One step as the callbacks see it (TrainCallbacks::on_step).
struct StepEvent {
  /// Steps done in total (this one included), and the run's total.
  int64_t step = 0;
  int64_t total_steps = 0;
  int64_t epoch = 0;
  /// The step's loss: the mean over the ranks that agree on it (an asynchronous worker's own).
  double loss = 0.0;
  double lr = 0.0;
  double seconds = 0.0;
  /// Examples per second over the run so far (every rank's).
  double samples_per_second = 0.0;
  /// The step's result: grad_norm (< 0 when not computed) and the strategy's own metrics.
  double grad_norm = -1.0;
  std::map<std::string, double> metrics;
};

/// Hooks into fit(), called on every rank that does the thing (a step: every rank; an
/// evaluation or a checkpoint: the ranks that take part, rank 0 alone for an asynchronous run).
/// They run on the training thread between steps: keep them short. To stop the run from one
/// (early stopping), call dtrain::train::request_stop(SIGTERM) (dtrain/train/Stop.h): the ranks
/// agree to stop after the next step, save a checkpoint, and fit() returns with stopped_by set.
struct TrainCallbacks {
  std::function<void(const StepEvent&)> on_step;
  /// After an evaluation at `step` (validation loss and accuracy).
  std::function<void(int64_t step, const EvalResult&)> on_evaluation;
  /// After a checkpoint at `step` was saved (or, with --async-checkpoint, handed to its writer).
  std::function<void(int64_t step, const std::string& directory)> on_checkpoint;
};

class Trainer {
 public:
  /// `world` = nullptr: a 1-rank world. Seeds LibTorch's RNG with options.seed, so a model
  /// built after the Trainer is reproducible.
  explicit Trainer(TrainerOptions options, comm::CommunicatorPtr world = nullptr);
  ~Trainer();

  /// Collective. Trains `model` on `train`, evaluating on `validation` (if given) after every
  /// epoch.
  FitResult fit(Model model, const data::TensorDataset& train,
                const data::TensorDataset* validation = nullptr);
  /// Collective. Loss and accuracy over `dataset`, each rank evaluating a share.
  EvalResult evaluate(const data::TensorDataset& dataset);

  /// Called by fit() right after the strategy's setup, before a checkpoint is restored: sets
  /// initial weights into what the strategy holds (a ZeRO-3 rank's shards cut from a file).
  void set_after_setup(std::function<void(parallel::Strategy&)> fn) {
    after_setup_ = std::move(fn);
  }

  /// Hooks into the next fit() calls (TrainCallbacks).
  void set_callbacks(TrainCallbacks callbacks) { callbacks_ = std::move(callbacks); }

  /// Your own training loop with dtrain's strategy (as Hugging Face accelerate's prepare()):
  /// moves `model` to the run's device and sets the strategy up with it and the options'
  /// optimizer (`example`: one micro-batch, for strategies that trace shapes). Then call
  /// strategy().train_step({batch}, loss) on each rank's share of the data (data/
  /// DistributedSampler.h, at grid()->data_parallel_rank()); set the learning rate with
  /// optim::set_learning_rate. Instead of fit(), not with it.
  parallel::Strategy& prepare(Model model, const data::Batch& example);

  parallel::Strategy& strategy() { return *strategy_; }
  const std::shared_ptr<comm::ProcessGrid>& grid() const { return grid_; }
  const TrainerOptions& options() const { return options_; }

 private:
  /// evaluate(); `alone`: this rank evaluates the whole set by itself (not collective).
  EvalResult evaluate_on(const data::TensorDataset& dataset, bool alone);
  /// Collective. Gathers every rank's trace spans; rank 0 writes options.trace_file.
  void write_trace();
  /// fit()'s setup: the model's loss, its initial weights (--init-from), the strategy set up
  /// with it and the optimizer `spec` (`train`'s first micro-batch for strategies that trace
  /// shapes), SyncBatchNorm's group, the layout line.
  void set_up(Model model, const data::TensorDataset& train, const optim::OptimizerSpec& spec);
  /// A model of placeholders (Model::deferred) stays so only for a strategy that draws its own
  /// parts of it (moved to the run's device); any other gets it whole. Returns true when the
  /// strategy is to read its parts of the checkpoint directory `init_from` after setup ("":
  /// none; a file or another layout gets the whole model here, for init_from to load).
  bool keep_placeholders(Model& model, const std::string& init_from);

  TrainerOptions options_;
  comm::CommunicatorPtr world_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  parallel::StrategyPtr strategy_;
  /// Where the model trains (strategy_options.device, resolved).
  c10::Device device_{c10::DeviceType::CPU};
  /// Which runner drives it (the registry's word).
  parallel::Loop loop_ = parallel::Loop::kSteps;
  /// The loss and prediction of the model being trained: Model::loss / Model::predict when it
  /// has them, else options.loss and argmax.
  parallel::LossFn loss_ = parallel::cross_entropy;
  std::function<at::Tensor(const at::Tensor&)> predict_;
  std::function<void(parallel::Strategy&)> after_setup_;
  TrainCallbacks callbacks_;
};

}  // namespace dtrain::train
