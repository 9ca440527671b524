// Strategy: how a model and optimizer are wrapped, stepped and saved across ranks. The Trainer's
// runners own the loops and know no strategy's internals; what only asynchronous or
// self-driving strategies do is in Loops.h, and how strategies are named, combined and given
// their flags in Registry.h (a new strategy: a folder under src/parallel plus one registry line).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Model.h"
#include "dtrain/common/OwnOptions.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/StateShards.h"

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

/// What every strategy reads (the gradients' bucketing and wire, clipping, precision), and each
/// strategy's own options by type: `options.of<pipeline::PipelineOptions>().schedule = "gpipe"`.
/// A strategy declares its own options struct, flags and checks (Registry.h), so adding one
/// changes nothing here.
struct StrategyOptions {
  /// Gradient bucket size for the reducer, and the (smaller) cap of its first bucket.
  int64_t bucket_cap_bytes = 25LL * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  /// "none", "fp16" or "bf16": dtype the gradients travel in.
  std::string grad_compression = "none";
  /// Allreduce gradients over hosts hierarchically (inside each host, then across hosts:
  /// comm/Hierarchical.h); a host's ranks are `ranks_per_host` consecutive ranks (0: the
  /// launcher's LOCAL_WORLD_SIZE).
  bool hierarchical_allreduce = false;
  int ranks_per_host = 0;
  /// Parameters that get no gradient in a step: false = treat their gradient as zero (and say
  /// so once), true = fail the step with an error naming them (after the collectives finish,
  /// so peers never hang).
  bool error_on_unused_parameters = false;
  /// Broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each step.
  bool broadcast_buffers = true;
  /// Clip gradients to this global L2 norm before the step (0 = off).
  double max_grad_norm = 0.0;
  /// "fp32", "bf16-mixed", "fp16-mixed", "bf16" or "bf16-master" (precision/Precision.h).
  std::string precision = "fp32";
  /// Where the model trains: "cpu", "cuda" or "cuda:N" (dtrain/common/Device.h). The Trainer
  /// resolves "cuda" to this rank's device and moves the model and the batches there.
  std::string device = "cpu";
  /// "auto" (dynamic for fp16-mixed, else none), "dynamic" or "none".
  std::string loss_scaling = "auto";
  /// Initial scale and growth interval of the dynamic loss scaler.
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 2000;

  /// A strategy's own options struct (default-constructed on first use; its defaults when
  /// never set).
  template <typename T>
  T& of() {
    return own.of<T>();
  }
  template <typename T>
  const T& of() const {
    return own.of<T>();
  }

  /// Where of<T>() keeps them (public only so that the struct stays an aggregate: tests write
  /// `DdpStrategy({.precision = "bf16"})`); use of<T>().
  OwnOptions own{};
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
  /// Collective. Sets the parameters' values (and buffers) from a checkpoint save() wrote, by
  /// any strategy at any world size, reading only what this rank keeps; the optimizer stays
  /// fresh (`--init-from CHECKPOINT` for a strategy that draws placeholders: zero3's shards).
  virtual void load_values(const std::string& directory);

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

  /// The ranks that agree on each step's loss (its mean; whether it is finite), after setup():
  /// nullptr for the whole world. A strategy whose groups meet only now and then across a slow
  /// link (DiLoCo's islands) names its own group, so no step waits on that link.
  virtual comm::CommunicatorPtr step_group() const { return nullptr; }
  /// With a step_group() smaller than the world: every this many steps the world agrees on
  /// whether a stop was requested (dtrain/train/Stop.h), one small allreduce over the world.
  /// DiLoCo's islands make it at their outer steps, where they meet anyway.
  virtual int64_t stop_check_every() const { return 10; }

  /// Replicas may fail without stopping the others (--fault-tolerance replicas): train_step's
  /// loss is already the mean over the replicas present (the runner reduces nothing), and rank 0
  /// evaluates and checkpoints alone, as with asynchronous workers.
  virtual bool survives_replica_failures() const { return false; }

  /// Collective. Makes model()'s parameters hold their full values until the next forward or
  /// step (ZeRO-3 gathers them; other strategies hold them always): for reading or exporting.
  virtual void materialize() {}

  /// The trainable values this rank holds and its optimizer updates, as pieces of the model's
  /// named parameters, when they are shards (ZeRO-3: each rank's slice of every parameter);
  /// empty when they are the model's parameters, whole (every other strategy).
  virtual std::vector<PieceRef> parameter_pieces() const { return {}; }

  /// Collective. Called once, right after the run's last step (not when a run stops early to be
  /// resumed): a strategy that defers work across steps does what is left (DiLoCo's outer step
  /// over the inner steps since the last one, and its exchanges still in flight), and may add to
  /// the last step's metrics.
  virtual void finish_training(StepResult& last) { (void)last; }
};

using StrategyPtr = std::unique_ptr<Strategy>;

}  // namespace dtrain::parallel
