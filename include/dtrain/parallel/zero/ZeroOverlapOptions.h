// ZeRO-1/2's overlap of the parameter all-gather with the next forward
// (StrategyOptions::of<ZeroOverlapOptions>(), flag declared in src/parallel/zero/ZeroStrategy.cpp,
// shared by zero1, zero2 and the pipeline's zero1).
#pragma once

namespace dtrain::parallel::zero {

struct ZeroOverlapOptions {
  /// --overlap-param-gather: after the sharded update, each bucket's all-gather is left running
  /// and the next step's forward waits for a bucket only when it reaches the first layer that
  /// needs it (Megatron's --overlap-param-gather). The same numbers; communication hidden.
  bool param_gather = false;
};

}  // namespace dtrain::parallel::zero
