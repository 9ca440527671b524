// ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models"): data parallelism in which each rank keeps optimizer state (stage 1) and
// gradients (stage 2) only for its shard of the parameters. Stage 1 averages full gradients with
// DDP's Reducer; stage 2 has the Reducer reduce-scatter each bucket into the rank's gradient shard
// and free it. Each rank updates its shard; an allgather gives every rank the updated parameters.
#pragma once

#include "dtrain/parallel/zero/ZeroOverlapOptions.h"
#include "dtrain/parallel/zero/ZeroQuantizedOptions.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/FlatShards.h"

namespace dtrain::parallel::zero {

/// ZeRO stage 1 (optimizer state sharded) and stage 2 (gradients too).
StrategyInfo zero1_strategy();
StrategyInfo zero2_strategy();
/// --zero-quantized and its block size (zero2, zero3), and what they ask of the collectives.
OptionGroup zero_quantized_options();
comm::BlockQuantization block_quantization(const StrategyOptions& options);
/// --overlap-param-gather (zero1, zero2, a pipeline's zero1).
OptionGroup zero_overlap_options();
/// --sequence-parallel refused (ZeRO-2 and 3 reduce-scatter before LayerNorm sums).
void check_no_sequence_parallel(const std::string& strategy, const Layout& layout);

class ZeroStrategy : public ddp::DdpStrategy {
 public:
  ZeroStrategy(StrategyOptions options, int stage = 1);
  std::string name() const override { return stage_ == 1 ? "zero1" : "zero2"; }
  MemoryReport memory_report() const override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  /// Whatever reads or writes the parameters outside a step waits for their gathers first.
  Model& model() override;
  void materialize() override { shards_.wait(); }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;

 protected:
  void build_optimizer(const optim::OptimizerFactory& make_optimizer) override;
  void apply_update() override;
  void configure_reducer(ddp::ReducerOptions& options) override;
  bool reduce_every_micro_batch() const override { return stage_ >= 2; }
  std::vector<at::Tensor> gradient_holders() const override;
  bool gradients_sharded() const override { return stage_ >= 2 || scatter_; }
  bool sums_partial_first() const override { return true; }
  /// Checkpoints: each rank writes its shard's pieces; loads fill every (replicated) parameter.
  std::vector<PieceRef> state_pieces() const override;
  bool state_sharded() const override { return true; }
  /// Expert parallelism: the experts' shards' gradients alias their reduced gradients before the
  /// clipping and the update see them.
  void after_gradient_sync(StepResult& result) override;
  /// The gradient shard the Reducer reduce-scatters into (defined when it does: zero2, and
  /// zero1 without tensor-parallel partial sums).
  const at::Tensor& shard_gradient() const { return shard_grad_; }

 private:
  /// --overlap-param-gather: model_.forward runs the stages, each after waiting for the
  /// gathers of the buckets it (and those before it) needs.
  void overlap_forward();

  int stage_;
  /// The Reducer reduce-scatters each bucket into shard_grad_: zero2 always (every
  /// micro-batch); zero1 at the step's last micro-batch (Megatron's distributed optimizer: half
  /// an allreduce's bytes), unless tensor parallelism leaves gradients that are partial sums
  /// over the TP group (sequence parallelism, shared key/value blocks), which are summed whole
  /// after the reduction: then zero1 allreduces.
  bool scatter_ = false;
  FlatShards shards_;
  /// Expert parallelism (--expert-parallel): shards_ holds the dense parameters (sharded over
  /// the data-parallel group); the experts are sharded over their expert data-parallel group
  /// (the ranks holding the same experts), their gradients reduced whole (reduce_expert_gradients)
  /// and aliased into their pieces.
  FlatShards expert_shards_;
  std::vector<at::Tensor> dense_, experts_;
  std::vector<std::string> dense_names_, expert_names_;
  double gather_wait_s_ = 0.0;  // this step's forward waiting for parameter gathers
  at::Tensor shard_grad_;       // scatter_: this rank's gradient shard (the pieces' grads alias it)
};

}  // namespace dtrain::parallel::zero
