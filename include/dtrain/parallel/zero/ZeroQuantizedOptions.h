// ZeRO-2/3's quantized collectives (StrategyOptions::of<ZeroQuantizedOptions>(), flags declared
// in src/parallel/zero/ZeroStrategy.cpp, shared by zero2 and zero3).
#pragma once

#include <cstdint>

namespace dtrain::parallel::zero {

struct ZeroQuantizedOptions {
  /// --zero-quantized: gradients reduce-scattered as int8 blocks (zero2, zero3) and parameters
  /// gathered as int8 blocks for forward and backward (zero3); ZeRO++'s qgZ and qwZ.
  bool enabled = false;
  /// --zero-quantized-block: elements per float32 scale.
  int64_t block = 256;
  /// Tests: the same exchanges without quantizing (equal to the plain collectives).
  bool identity = false;
};

}  // namespace dtrain::parallel::zero
