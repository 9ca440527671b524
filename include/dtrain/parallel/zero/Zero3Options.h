// ZeRO-3's own options (StrategyOptions::of<Zero3Options>()); its flags are declared beside it
// (src/parallel/zero/Zero3Strategy.cpp).
#pragma once

#include <cstdint>

namespace dtrain::parallel::zero {

struct Zero3Options {
  /// Units gathered as one are the model's stages (Model::stages), consecutive ones merged
  /// until a unit has at least this many parameters (0 = one unit per stage).
  int64_t min_unit_params = 0;
  /// Gather the next unit's parameters while the current one computes.
  bool prefetch = true;
};

}  // namespace dtrain::parallel::zero
