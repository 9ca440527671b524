// ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models"): data parallelism in which each rank keeps optimizer state only for its
// shard of the parameters. Gradients are averaged by DDP's Reducer; each rank updates its shard;
// an allgather then gives every rank the full updated parameters.
#pragma once

#include "parallel/ddp/DdpStrategy.h"

namespace dtrain::parallel {

class ZeroStrategy : public DdpStrategy {
 public:
  explicit ZeroStrategy(StrategyOptions options);
  std::string name() const override { return "zero1"; }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  MemoryReport memory_report() const override;

  /// Elements per shard (the flat parameter vector padded to a multiple of the world size).
  int64_t shard_numel() const { return shard_numel_; }

 protected:
  void build_optimizer(const optim::OptimizerFactory& make_optimizer) override;
  void apply_update() override;

 private:
  /// Part of parameter `parameter` (from element `offset`) inside this rank's shard.
  struct Piece {
    size_t parameter;
    int64_t offset;
    at::Tensor tensor;  // aliases flat_; an optimizer parameter
  };

  at::Tensor flat_;  // all parameters, padded; the parameters alias it
  std::vector<Piece> pieces_;
  int64_t total_numel_ = 0;
  int64_t shard_numel_ = 0;
  std::vector<int64_t> offsets_;  // of each parameter in flat_
};

}  // namespace dtrain::parallel
