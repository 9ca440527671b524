// DiLoCo's own options (StrategyOptions::of<diloco::DilocoOptions>()); its flags are declared
// beside the strategy (src/parallel/diloco/DilocoStrategy.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::parallel::diloco {

struct DilocoOptions {
  /// The synchronous strategy each island trains with: ddp, zero1 or zero2.
  std::string inner_strategy = "ddp";
  /// Ranks per island (they must divide the world); 0 = the ranks of one node (LOCAL_WORLD_SIZE,
  /// set by dtrain launch; the whole world when it is not set).
  int island_size = 0;
  /// H: inner steps between outer steps.
  int64_t outer_steps = 50;
  /// The outer optimizer over the averaged outer gradient (the islands' mean parameter change):
  /// "nesterov" (DiLoCo's), "sgd" (momentum as --outer-momentum; 0 = plain) or "adam".
  std::string outer_optimizer = "nesterov";
  double outer_lr = 0.7;
  double outer_momentum = 0.9;
  /// How the outer gradient crosses the islands: "none" (an allreduce), "q8" (8-bit blocks,
  /// stochastic rounding) or "topk:FRACTION" (with error feedback), encoded by the library that
  /// compresses federated updates (dtrain/comm/Compression.h) and allgathered.
  std::string outer_compression = "none";
};

}  // namespace dtrain::parallel::diloco
