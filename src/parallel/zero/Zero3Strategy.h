// ZeRO-3 (FSDP's FULL_SHARD): parameters, gradients and optimizer state are all sharded; each
// rank stores 1/N of each and gathers a unit's parameters only while that unit computes
// (ParameterSharder); with expert parallelism a rank's experts 1/N' over the N' ranks holding the
// same experts. Everything else (loss scaling, clipping across shards, accumulation,
// checkpoints) is DdpStrategy's step with the sharder as its gradient synchronizer.
#pragma once

#include "dtrain/parallel/zero/Zero3Options.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/ParameterSharder.h"

namespace dtrain::parallel::zero {

StrategyInfo zero3_strategy();

class Zero3Strategy : public ddp::DdpStrategy {
 public:
  explicit Zero3Strategy(StrategyOptions options);
  std::string name() const override { return "zero3"; }
  MemoryReport memory_report() const override;
  void materialize() override;
  /// The pieces this rank's optimizer updates (with master weights, their fp32 copies): whoever
  /// asks may write them (--init-from), so the bf16 shard takes them again before it is used.
  std::vector<PieceRef> parameter_pieces() const override {
    master_synced_ = false;
    return state_pieces();
  }
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  at::Tensor evaluate_forward(const at::Tensor& inputs) override;
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  void load_values(const std::string& directory) override;
  /// The sharder (for tests and benchmarks).
  const ParameterSharder& sharder() const { return *sharder_; }

 protected:
  void build_optimizer(const optim::OptimizerFactory& make_optimizer) override;
  void apply_update() override;
  void build_gradient_sync(const std::vector<std::string>& names) override {}
  ddp::GradientSync& gradient_sync() override { return *sharder_; }
  bool reduce_every_micro_batch() const override { return true; }
  std::vector<at::Tensor> gradient_holders() const override;
  bool gradients_sharded() const override { return true; }
  /// Expert parallelism: the experts' blocks are sharded over the expert data-parallel group and
  /// reduce-scattered over it by the sharder.
  bool syncs_expert_gradients() const override { return true; }
  /// Checkpoints: each rank writes and loads only its shard's pieces.
  std::vector<PieceRef> state_pieces() const override;
  bool state_sharded() const override { return true; }
  std::vector<PieceRef> value_pieces() const override { return state_pieces(); }

 private:
  /// The units: the model's stages, consecutive ones merged up to zero3_.min_unit_params
  /// (the whole model when it has no stages).
  std::vector<ShardUnit> make_units() const;

  /// --precision bf16-master: this rank's fp32 copy of its shard (drawn, or taken from the fp32
  /// model before it was cast), whose pieces the optimizer updates.
  void make_master(bool deferred);
  /// The bf16 shard from the master (after something wrote the master), and, with the optimizer's
  /// state in a file, the master moved there (at the first step: --init-from writes it first).
  void prepare_master();
  /// The bf16 shard takes the master's values, rounded.
  void round_master_into_shard();
  /// Runs `body` with the master in memory (read from the file when `read`) when it lives in
  /// the file, and frees it again after.
  template <typename Body>
  void with_master_in_memory(bool read, Body&& body);

  Zero3Options zero3_;
  std::unique_ptr<ParameterSharder> sharder_;
  /// bf16-master (Megatron's distributed optimizer, DeepSpeed's bf16 ZeRO-3): the parameters
  /// and their gathers are bf16, gradients are reduced and kept in fp32, and the optimizer
  /// updates fp32 master pieces (views of master_flat_) whose gradients alias the fp32 shard.
  /// With --offload optimizer:DIR the master lives in the state's file between steps.
  at::Tensor master_flat_;
  std::vector<at::Tensor> master_pieces_, master_grads_;
  mutable bool master_synced_ = true;
  bool master_in_file_ = false;
};

}  // namespace dtrain::parallel::zero
