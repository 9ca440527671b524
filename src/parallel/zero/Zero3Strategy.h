// ZeRO-3 (FSDP's FULL_SHARD): parameters, gradients and optimizer state are all sharded; each
// rank stores 1/N of each and gathers a unit's parameters only while that unit computes
// (ParameterSharder). Everything else (loss scaling, clipping across shards, accumulation,
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
  std::vector<PieceRef> parameter_pieces() const override { return state_pieces(); }
  /// The sharder (for tests and benchmarks).
  const ParameterSharder& sharder() const { return *sharder_; }

 protected:
  void build_optimizer(const optim::OptimizerFactory& make_optimizer) override;
  void build_gradient_sync(const std::vector<std::string>& names) override {}
  ddp::GradientSync& gradient_sync() override { return *sharder_; }
  bool reduce_every_micro_batch() const override { return true; }
  std::vector<at::Tensor> gradient_holders() const override;
  bool gradients_sharded() const override { return true; }
  /// Checkpoints: each rank writes and loads only its shard's pieces.
  std::vector<PieceRef> state_pieces() const override;
  bool state_sharded() const override { return true; }
  std::vector<PieceRef> value_pieces() const override { return state_pieces(); }

 private:
  /// The units: the model's stages, consecutive ones merged up to zero3_.min_unit_params
  /// (the whole model when it has no stages).
  std::vector<ShardUnit> make_units() const;

  Zero3Options zero3_;
  std::unique_ptr<ParameterSharder> sharder_;
};

}  // namespace dtrain::parallel::zero
