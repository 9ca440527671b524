// Strategy: how a model and optimizer are wrapped, stepped and saved across ranks (DESIGN.md).
// The Trainer owns the loop and knows no strategy's internals; a new strategy is a new folder
// under src/parallel plus one line in the registry (Registry.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/models/Model.h"
#include "dtrain/optim/Optimizers.h"

namespace dtrain::parallel {

/// Loss of a batch: (model output, targets) -> scalar (mean over the batch).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;
/// Cross-entropy over class logits (the default loss).
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

struct StepResult {
  /// Mean loss over this rank's micro-batches.
  double loss = 0.0;
  /// Examples this rank processed.
  int64_t samples = 0;
  /// Global gradient norm before clipping (when clipping is on), else -1.
  double grad_norm = -1.0;
  /// Strategy-specific timings and counters (e.g. "exposed_comm_ms").
  std::map<std::string, double> metrics;
};

struct MemoryReport {
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  int64_t total() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

/// Options every strategy understands; strategy-specific ones are ignored by the others.
struct StrategyOptions {
  /// Gradient bucket size for the reducer, and the (smaller) cap of its first bucket.
  int64_t bucket_cap_bytes = 25LL * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  /// "none", "fp16" or "bf16": dtype the gradients travel in.
  std::string grad_compression = "none";
  /// Parameters that get no gradient in a step: false = treat their gradient as zero (and say
  /// so once), true = fail the step with an error naming them (after the collectives finish,
  /// so peers never hang).
  bool error_on_unused_parameters = false;
  /// Broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each step.
  bool broadcast_buffers = true;
  /// Clip gradients to this global L2 norm before the step (0 = off).
  double max_grad_norm = 0.0;
  /// "fp32", "bf16-mixed", "fp16-mixed" or "bf16" (precision/Precision.h).
  std::string precision = "fp32";
  /// "auto" (dynamic for fp16-mixed, else none), "dynamic" or "none".
  std::string loss_scaling = "auto";
  /// Initial scale and growth interval of the dynamic loss scaler.
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 2000;
  /// ZeRO-3: units gathered as one are the model's stages (Model::stages), consecutive ones
  /// merged until a unit has at least this many parameters (0 = one unit per stage).
  int64_t zero3_min_unit_params = 0;
  /// ZeRO-3: gather the next unit's parameters while the current one computes.
  bool zero3_prefetch = true;
  /// Pipeline (over the grid's PP group): "gpipe", "1f1b" or "interleaved"; the step's
  /// micro-batches are the pipeline's micro-batches.
  std::string pipeline_schedule = "1f1b";
  /// Pipeline: model chunks per rank (interleaved only): the model is cut into chunks x P
  /// virtual stages, rank r running virtual stages r, r + P, ...
  int pipeline_virtual_stages = 1;
  /// Pipeline: stages placed by "params" (parameter count), "time" (forward + backward time of
  /// each stage measured on the example batch, see Strategy::prepare) or "S1,S2,..." (stages per
  /// virtual stage).
  std::string pipeline_balance = "params";
  /// Pipeline: how each stage's replicas share their work over the DP group: "ddp" (averaged
  /// gradients) or "zero1" (and each replica keeps the optimizer state of its shard only).
  std::string pipeline_data_parallel = "ddp";
  /// Pipeline: how activations and their gradients travel between stages: "auto" (through
  /// shared memory between stages on the same machine, the communicator otherwise) or "comm"
  /// (always the communicator).
  std::string pipeline_transport = "auto";
  /// Downpour (parameter server): "host:port" of every shard, in shard order.
  std::vector<std::string> ps_addresses{};
  /// Downpour: fetch fresh parameters every n_fetch steps and push the gradients accumulated
  /// over n_push steps (DistBelief's names); both in the background, beside compute.
  int ps_n_fetch = 1;
  int ps_n_push = 1;
  /// Downpour: a worker whose parameters are more than this many server versions behind the
  /// newest it knows of (its own unapplied pushes included) waits for a fresh pull (-1 = no cap).
  int64_t ps_max_staleness = -1;
  /// Downpour: deadline of every parameter-server RPC.
  int64_t ps_rpc_timeout_ms = 30000;
  /// Downpour: how long an unreachable shard (restarting?) is retried before it is an error.
  int64_t ps_retry_ms = 60000;
  /// Downpour: the shards' token ("" = none) and TLS (trusting ps_tls_ca, "" = system roots).
  std::string ps_auth_token{};
  bool ps_tls = false;
  std::string ps_tls_ca{};
  /// Sandblaster: work units per evaluation of the loss (0 = 10 per worker) and backup copies
  /// of the units still running near an evaluation's end; L-BFGS history pairs.
  int64_t sb_work_units = 0;
  bool sb_backup_tasks = true;
  int sb_history = 10;
  /// Sandblaster: "tapered" (the last units smaller, so an evaluation ends on small ones) or
  /// "uniform" unit sizes.
  std::string sb_unit_sizing = "tapered";
};

/// One iteration of a strategy that runs its own loop (Sandblaster: an L-BFGS iteration).
struct IterationReport {
  /// Iterations done so far in this run.
  int64_t iteration = 0;
  double loss = 0.0;
  double grad_norm = -1.0;
  /// Wall time of the iteration and the passes over the training set it made.
  double seconds = 0.0;
  int64_t evaluations = 0;
  std::map<std::string, double> metrics;
};

/// What a strategy that runs its own loop gets from the Trainer.
struct LoopContext {
  const data::TensorDataset* train = nullptr;
  LossFn loss;
  /// Iterations to run at most (the Trainer's steps).
  int64_t max_iterations = 100;
  /// Examples per forward when a strategy computes over a range of the data.
  int64_t chunk = 256;
  /// This rank's slowdown (--simulate-slowdown): its work takes this many times as long,
  /// sleeping the difference or (spin) keeping its core busy.
  double slowdown = 1.0;
  bool slowdown_spin = false;
  /// The objective's L2 term, 0.5 * weight_decay * |params|^2 (the optimizer's weight decay).
  double weight_decay = 0.0;
  /// Bound of a wait for the other ranks' work (the job's --comm-timeout).
  int64_t stall_ms = 120000;
  /// On rank 0 after every iteration, with model() holding the iteration's parameters (the
  /// Trainer writes metrics, evaluates and checkpoints there).
  std::function<void(const IterationReport&)> on_iteration;
  /// On every rank after each piece of work it computed and sent, before reporting it (the
  /// count so far): the Trainer's simulated failures fire here (a worker dying with a unit).
  std::function<void(int64_t)> on_work;
};

/// What of each micro-batch a rank reads (a pipeline's middle stages read neither; the first
/// reads inputs, the last targets).
struct DataNeeds {
  bool inputs = true;
  bool targets = true;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;

  /// Collective. Takes ownership of training `model`; builds its optimizer with `make_optimizer`
  /// over the parameters this rank updates.
  virtual void setup(Model model, const optim::OptimizerFactory& make_optimizer,
                     std::shared_ptr<comm::ProcessGrid> grid) = 0;

  /// Collective. One optimizer step over `micro_batches` (gradient accumulation: gradients are
  /// synchronized once, after the last micro-batch). The loss of each micro-batch is divided by
  /// the number of micro-batches so the step matches one batch of their combined size.
  virtual StepResult train_step(const std::vector<data::Batch>& micro_batches,
                                const LossFn& loss) = 0;

  /// The full model for evaluation (forward only).
  virtual Model& model() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;

  /// Collective. Writes this strategy's state (model, optimizer) into the existing `directory`.
  virtual void save(const std::string& directory) = 0;
  /// Collective. Restores state written by save().
  virtual void load(const std::string& directory) = 0;

  /// Bytes of parameters, gradients and optimizer state this rank holds.
  virtual MemoryReport memory_report() const = 0;

  /// Before setup(): one micro-batch of the training data, for strategies that measure the model
  /// (the pipeline's balance by time).
  virtual void prepare(const data::Batch& example) { (void)example; }

  /// What this rank reads of each micro-batch; the Trainer leaves out the rest (after setup()).
  virtual DataNeeds data_needs() const { return {}; }

  /// Collective over the ranks that share `inputs` (every rank of a data-parallel replica gets
  /// the same). The model's output for evaluation (no gradients), on the ranks that hold it; an
  /// undefined tensor on the others (pipeline stages before the last).
  virtual at::Tensor evaluate_forward(const at::Tensor& inputs) { return model()(inputs); }

  /// A line describing how the model was laid out over the ranks ("" when there is nothing to
  /// say), printed by the Trainer after setup().
  virtual std::string layout() const { return ""; }

  /// Collective. Makes model()'s parameters hold their full values until the next forward or
  /// step (ZeRO-3 gathers them; other strategies hold them always): for reading or exporting.
  virtual void materialize() {}

  /// False for asynchronous strategies (parameter-server workers): their ranks do not step
  /// together, so the Trainer makes no per-step collective, and rank 0 alone evaluates and
  /// checkpoints (save() is then not collective). The run ends when global_steps() reaches its
  /// budget, however the steps were shared out.
  virtual bool synchronous() const { return true; }
  /// Asynchronous: worker steps applied so far by every worker together (as the servers count
  /// them); -1 for synchronous strategies.
  virtual int64_t global_steps() const { return -1; }
  /// Asynchronous: after this worker's last step, sends what it still holds (pending gradients)
  /// and makes model() hold the newest parameters.
  virtual void finish() {}
  /// Asynchronous, rank 0 after finish(): waits (bounded) until the other workers' last
  /// updates are in, or they went quiet (a worker that died), then takes the newest parameters.
  /// Returns a sentence about workers that did not finish ("" when all did).
  virtual std::string await_workers() { return ""; }
  /// Numbers about the whole run for the metrics file's "strategy" record, on rank 0 at the end
  /// (the parameter server's: staleness histogram, traffic per shard, pushes per worker).
  virtual std::map<std::string, double> run_metrics() { return {}; }

  /// True for strategies that run their own loop over the training set instead of the
  /// Trainer's batch loop (Sandblaster L-BFGS: a coordinator hands out work units); they are
  /// asynchronous (synchronous() false: rank 0 alone evaluates and checkpoints).
  virtual bool drives_loop() const { return false; }
  /// Every rank: runs the loop until it ends, calling context.on_iteration on rank 0; model()
  /// then holds the final parameters on rank 0. Returns the iterations run.
  virtual int64_t run_loop(const LoopContext& context) {
    (void)context;
    return 0;
  }
};

using StrategyPtr = std::unique_ptr<Strategy>;

/// Builds a registered strategy by name ("ddp", ...); InputError for unknown names.
StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options);
std::vector<std::string> strategy_names();

}  // namespace dtrain::parallel
