// Pipeline parallelism over the grid's PP group, with data parallelism over its DP group: the
// model's stages are cut into V x P contiguous virtual stages; this rank runs virtual stages
// r, r + P, ... (its chunks; zb-v: r and 2P - 1 - r), exchanging activations and their
// gradients with its neighbours in the order a schedule gives (Schedule.h). Each chunk's
// gradients are averaged over the DP group by a Reducer as the chunk's last backward of the
// step runs; the optimizer covers this rank's parameters only (or, with zero1, its DP shard of
// them). --pipeline-sync 2bw, eager and async (PipeDream.cpp) run 1F1B without the flush between
// steps.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>

#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/pipeline/Partition.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/precision/LossScaler.h"
#include "dtrain/precision/Precision.h"
#include "parallel/StrategySupport.h"
#include "parallel/zero/FlatShards.h"

namespace dtrain::parallel::ddp {
class Reducer;
}
namespace dtrain::nn {
class MoeImpl;
}

namespace dtrain::parallel::pipeline {

class StageLink;

StrategyInfo pipeline_strategy();  // PipelineRegistry.cpp
/// The pipeline's options alone (InputError naming the flag): schedule, virtual stages, the
/// data-parallel side, transport, balance.
void check_options(const PipelineOptions& options);
/// A pipeline with replicated stages (--stage-replicas; micro_batches 0: not known yet):
/// single-chunk flushed schedules, ddp, no tensor parallelism, a micro-batch per replica.
void check_stage_replicas(const PipelineOptions& options, const std::vector<int>& replicas,
                          int tensor_parallel, int64_t micro_batches);

class PipelineStrategy : public Strategy {
 public:
  explicit PipelineStrategy(StrategyOptions options);
  ~PipelineStrategy() override;
  std::string name() const override { return "pipeline"; }
  void prepare(const data::Batch& example) override;
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  DataNeeds data_needs() const override;
  at::Tensor evaluate_forward(const at::Tensor& inputs) override;
  std::string layout() const override;
  /// This rank's copy of the whole model; only its own stages' parameters are trained here.
  Model& model() override {
    shards_.wait();  // zero1 --overlap-param-gather
    return model_;
  }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  MemoryReport memory_report() const override;
  /// Collective over the pipeline: every rank's copy of the model gets each stage's current
  /// values from the rank that trains it.
  void materialize() override;
  void load_values(const std::string& directory) override;
  /// --pipeline-sync 2bw, eager or async: runs what is still in flight (the last step's remaining
  /// backwards and their update) so every stage holds the newest weights.
  void finish_training(StepResult& last) override;
  /// 2bw, async: each stage's data-parallel group agrees on the step's loss (every stage of a
  /// replica has it from the last stage); a world-wide agreement would re-synchronize the stages at
  /// each step's end, which the flush-free steps are there to avoid.
  comm::CommunicatorPtr step_group() const override;

  /// Virtual stage v runs model stages [partition().first(v), partition().end(v)).
  const Partition& partition() const { return partition_; }
  /// The parameters this rank trains (its stages'), with their names in the whole model.
  const std::vector<at::Tensor>& local_parameters() const { return parameters_; }
  const std::vector<std::string>& local_parameter_names() const { return names_; }
  /// Called after each action of a step (for profilers and benchmarks: e.g. memory in use once
  /// a forward's activations are kept).
  void set_action_observer(std::function<void(const Action&)> observer) {
    observer_ = std::move(observer);
  }
  /// --pipeline-sync 2bw, eager or async: called after each forward and backward with the weight
  /// version it computed on (for tests: a micro-batch's backward must see its forward's).
  void set_version_observer(std::function<void(const Action&, int64_t version)> observer) {
    version_observer_ = std::move(observer);
  }

 protected:
  // What --fault-tolerance replicas changes (ft/FaultTolerantPipeline.h: pipelines inside
  // replicas that outlive each other).
  /// Where the stage costs are agreed (every rank takes its rank 0's): the world.
  virtual comm::Communicator& agreement_group() const { return *grid_->world(); }
  /// At setup, after the pipeline's own broadcast: each stage's values from the first
  /// data-parallel replica's (over the DP group).
  virtual void broadcast_replica_state();
  /// Each chunk's gradients averaged over the DP group by a Reducer during the step; false: the
  /// gradients stay local, for reduce_over_replicas.
  virtual bool reduces_over_data_parallel() const { return true; }
  /// After the schedule, before the update and the loss's report over the pipeline (which sums
  /// result.loss: on entry this rank's share of the replica's loss, the last stage's).
  virtual void reduce_over_replicas(StepResult& /*result*/) {}
  /// This rank writes its stage's files in a checkpoint: the first replica's ranks.
  virtual bool writes_stage_files() const { return grid_->coordinates().dp == 0; }

  struct Chunk {
    int virtual_stage = 0;
    std::vector<Stage> stages;
    std::vector<size_t> parameters;  // indices into parameters_
    /// zero1: its parameters other than experts, as indices into dense_.
    std::vector<size_t> dense;
    /// zero1 --overlap-param-gather: before each stage, the last shard bucket it needs.
    std::vector<int64_t> gather_until;
  };
  std::vector<double> stage_costs();
  /// This rank's actions of a step (replicated stages: its share of its stage's, micro-batch m
  /// on replica m % replicas).
  std::vector<Action> my_actions(int micro_batches) const;
  /// The schedule over this grid's pipeline (its placement of the virtual stages needs no M).
  ScheduleSpec spec(int micro_batches = 1) const {
    return {kind_, grid_->pp_size(), micro_batches, chunks_per_rank_};
  }
  at::Tensor run_chunk(const Chunk& chunk, const at::Tensor& x) const;
  /// The chunk's parameters and their names (`dense`: without blocks of experts).
  std::pair<std::vector<at::Tensor>, std::vector<std::string>> chunk_parameters(
      const Chunk& chunk, bool dense = false) const;
  /// The first stage's input as the model takes it (bf16 weights: cast).
  at::Tensor model_input(const at::Tensor& inputs) const;
  /// bf16-master: each expert's gradient in fp32 (the model's bf16 one converted, then dropped)
  /// on its master weight (ddp stages) or a holder of its own (zero1's expert shards take it),
  /// in expert_params_' order; kept for reduced_gradient_holders.
  const std::vector<at::Tensor>& expert_master_gradients();
  std::vector<at::Tensor> expert_holders_;
  /// Packed sequences: the model's view of a micro-batch's `inputs` (Model::see_inputs) before
  /// `chunk` runs its forward (where the chunk does not start the model), or a `backward` that
  /// recomputes a checkpointed stage of it.
  void show_inputs(const Chunk& chunk, const at::Tensor& inputs, bool backward) const;
  /// One tensor per parameter whose .grad is its whole reduced gradient: the parameters, or
  /// with bf16-master (not reduce-scattered) the master weights or holders of the Reducers'
  /// fp32 gradients.
  std::vector<at::Tensor> reduced_gradient_holders() const;
  /// bf16-master: the updated master weights (zero1: this rank's shard, before the gather)
  /// into the bf16 model.
  void update_model_from_master();
  /// A whole backward of `chunk` from its output `y` (the loss on the last stage, else with
  /// `upstream`); backward_and_send then sends its input's gradient on over the StageLink as
  /// micro-batch `link`.
  void backward_chunk(const Chunk& chunk, const at::Tensor& y, const at::Tensor& upstream);
  void backward_and_send(const Chunk& chunk, const at::Tensor& x, const at::Tensor& y,
                         const at::Tensor& upstream, int link, const std::string& label);
  bool first_virtual(const Chunk& chunk) const { return chunk.virtual_stage == 0; }
  bool last_virtual(const Chunk& chunk) const {
    return chunk.virtual_stage == partition_.ranks() - 1;
  }
  NamedTensors local_buffers() const;
  double clip_gradients();

  // The flushed step (FlushedStep.cpp): this rank's actions in order, each a function of its
  // own, then the reduction, loss scaling and the update.
  struct FlushedStep;
  void run_forward(FlushedStep& step, const Action& a);
  /// (`i`: the action's index: the chunk's last backward or W starts its gradients' reduction.)
  void run_weight(FlushedStep& step, const Action& a, size_t i);
  void run_backward(FlushedStep& step, const Action& a, size_t i);
  // Each in three parts, so that an overlapped pair can receive both inputs, compute both at
  // once and then send both results: the input (received, or the batch's), the computation
  // (returns what goes on: the activation, undefined after the loss; the input's gradient,
  // undefined on the first stage), the send.
  at::Tensor forward_input(const Action& a, const std::vector<data::Batch>& micro_batches);
  at::Tensor compute_forward(FlushedStep& step, const Action& a, const at::Tensor& x);
  void send_forward(const Action& a, const at::Tensor& y);
  at::Tensor backward_input(const Action& a);
  at::Tensor compute_backward(FlushedStep& step, const Action& a, size_t i,
                              const at::Tensor& upstream);
  void send_backward(const Action& a, const at::Tensor& g);
  /// DualPipe-V's pair at `i` (an overlapped forward, the backward after it and that backward's
  /// W where it comes next): the forward on this thread, the rest on a helper thread whose
  /// all-to-alls take the expert group's second lane and whose spans are the rank's track 1.
  /// Returns how many actions it ran.
  size_t run_pair(FlushedStep& step, const std::vector<Action>& actions, size_t i);
  StepResult finish_flushed_step(FlushedStep& step);
  /// "m" or "m.chunk": an action's micro-batch (and chunk) in trace spans.
  std::string action_label(const Action& a) const;

  // PipeDream (--pipeline-sync 2bw, eager or async; PipeDream.cpp). Steps follow one another
  // without a flush: rank r ends a step with its last P - r - 1 micro-batches forwarded and not yet
  // backwarded, and runs their backwards in the next step between that step's forwards. Each
  // micro-batch computes forward and backward on one weight version (weight stashing), kept
  // in a buffer of its own until no micro-batch in flight reads it:
  // - 2bw: batch b computes on W(max(b - 1, 0)); when this rank's last backward of batch b is
  //   done, W(b + 1) = W(b) - step(gradient of batch b). Two versions per stage.
  // - eager: each micro-batch computes on the newest version at its forward; rank r updates
  //   after its backward of micro-batch M - 1 - w (w = P - r - 1: the backwards its next
  //   forward comes before), on the gradients summed so far; the step's last w micro-batches'
  //   gradients, done after it, stay in the gradient buffers for the next update. Two versions.
  // - async: each micro-batch computes on the newest version at its forward; after each
  //   backward, W(n + 1) = W(n) - step(its gradient). Up to P - r + 1 versions on rank r.
  struct InFlight {
    at::Tensor x, y;
    at::Tensor inputs;  // the micro-batch's (a recomputing backward's show_inputs)
    int64_t batch = 0, version = 0;
    int micro_batch = 0, count = 0, link = 0;  // link: its index on the StageLink
  };
  void setup_versions();
  StepResult train_step_pipedream(const std::vector<data::Batch>& micro_batches,
                                  const LossFn& loss);
  /// The oldest in-flight micro-batch's backward (and the update that follows it, if any).
  void backward_pipedream();
  /// W(newest + 1) = W(newest) - step(the gradients), at `batch`'s learning rate.
  void update_pipedream(int64_t batch);
  /// Moves the buffers of versions nothing will read again to spare_.
  void release_versions();
  /// Points this rank's parameters at version n's buffers.
  void use_version(int64_t n);
  /// Collective: runs every in-flight backward; the parameters then hold the newest version.
  void flush();
  /// Checkpoints (2bw): the version the next batch computes on, W(n - 1), beside the newest
  /// W(n) (the usual files), in the subfolder pipedream-2bw; a checkpoint without it (another
  /// strategy's, or async's) resumes with both versions equal.
  void save_pipedream_stash(const std::string& directory, int writer, int writers);
  void load_pipedream_versions(const std::string& directory);
  /// Checkpoints (eager): the gradients of the last step's micro-batches that the next update
  /// takes (summed over the stage's data-parallel replicas), in the subfolder pipedream-eager.
  /// Collective over the stage's data-parallel group.
  void save_pending_gradients(const std::string& directory, bool writes, int writer, int writers);
  /// How many of a step's last micro-batches this rank runs backward after its update
  /// (eager: P - r - 1; otherwise 0).
  int late_micro_batches() const;
  /// The version batch `batch` computes on: the newest (async, eager), the one before it (2bw), or
  /// under --weight-prediction extrapolate the prediction made for it (predicted(batch)).
  int64_t version_for(int64_t batch) const;
  /// The number under which the prediction batch `batch` computes on is kept.
  static int64_t predicted(int64_t batch) { return (int64_t{1} << 40) + batch; }
  bool flush_free_ = false;  // 2bw, eager or async
  bool async_ = false;
  bool eager_ = false;
  std::vector<at::Tensor> restored_gradients_;  // eager: read from a checkpoint, for batch 0
  bool predict_ = false;                                 // --weight-prediction extrapolate
  int64_t batches_ = 0;                                  // batches started since setup or load
  int64_t newest_ = 0;                                   // the newest version's number
  std::map<int64_t, std::vector<at::Tensor>> versions_;  // the versions kept, by number
  std::vector<std::vector<at::Tensor>> spare_;           // buffers of versions let go
  int64_t current_version_ = -1;                         // the version the parameters point at
  std::vector<at::Tensor> optimized_;   // the optimizer's own, pointed at the buffer it writes
  std::deque<InFlight> in_flight_;      // oldest first (1F1B backwards go in forward order)
  std::map<int64_t, double> batch_lr_;  // the learning rate of each batch not yet applied

  StrategyOptions options_;
  PipelineOptions pipe_;
  std::string kind_;  ///< the schedule's name
  int chunks_per_rank_;
  precision::Precision precision_;
  c10::Device device_{c10::DeviceType::CPU};
  std::unique_ptr<precision::LossScaler> scaler_;
  TensorParallelLayout tp_;
  bool zero1_ = false;
  Model model_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  data::Batch example_;
  std::vector<double> costs_;
  Partition partition_;  // over V x P virtual stages
  std::vector<Chunk> chunks_;
  std::vector<at::Tensor> parameters_;
  /// bf16-master without zero1: fp32 copies of parameters_, which the optimizer updates (zero1
  /// keeps its shard's in shards_).
  std::vector<at::Tensor> master_;
  std::vector<std::string> names_;
  /// A mixture of experts: its layers (their balance losses taken in each layer's backward,
  /// scaled for the step's micro-batches), and whether each of parameters_ is a block of this
  /// rank's experts (--expert-parallel: its gradient bypasses the Reducers and is reduced over
  /// grid_->edp() after the schedule; checkpoints are written by the stage's first expert group).
  std::vector<nn::MoeImpl*> moe_layers_;
  std::vector<bool> expert_;
  /// The step's scale for the layers' balance losses; returns the sum of those taken since the
  /// last call.
  double scale_moe_losses(double scale);
  std::vector<std::unique_ptr<parallel::ddp::Reducer>> reducers_;  // one per chunk
  mutable parallel::zero::FlatShards shards_;  // zero1 (its gathers may run into the next step)
  /// parameters_ (and names_) split: the dense ones (what zero1's shards_ holds) and the
  /// experts; zero1 with --expert-parallel gives the experts shards of their own, over the
  /// stage's expert data-parallel group (each rank of it updates its part of the experts it
  /// holds).
  std::vector<at::Tensor> dense_, expert_params_;
  std::vector<std::string> dense_names_, expert_names_;
  parallel::zero::FlatShards expert_shards_;
  /// zero1: the optimizer's pieces (the dense shard's, then the experts').
  std::vector<at::Tensor> shard_pieces() const;
  /// zero1: the checkpoint pieces of both shards.
  std::vector<PieceRef> shard_state_pieces() const;
  bool overlap_gather_ = false;                // zero1 --overlap-param-gather
  bool scatter_ = false;  // zero1: gradients reduce-scattered into shard_grad_ (not allreduced)
  /// The Reducers sum sequence parallelism's partial gradients over the TP group (scatter_).
  bool partial_in_reducers_ = false;
  at::Tensor shard_grad_;
  mutable double gather_wait_s_ = 0.0;  // this step's forwards waiting for them
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<StageLink> link_;
  std::function<void(const Action&)> observer_;
  std::function<void(const Action&, int64_t)> version_observer_;
};

}  // namespace dtrain::parallel::pipeline
