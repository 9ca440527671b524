// DiLoCo's own options (StrategyOptions::of<diloco::DilocoOptions>()); its flags are declared
// beside the strategy (src/parallel/diloco/DilocoStrategy.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::parallel::diloco {

struct DilocoOptions {
  /// The synchronous strategy each island trains with: ddp, zero1, zero2 or zero3 (whose
  /// islands hold the outer state as shards).
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
  /// Streaming DiLoCo (Douillard et al. 2025): the model's parameters in this many fragments of
  /// consecutive tensors (balanced by size), fragment p exchanged every H steps at phase
  /// p * H / fragments, so each exchange carries about 1/fragments of the model. 1 = the whole
  /// model at once (DiLoCo).
  int fragments = 1;
  /// Streaming: inner steps a fragment's exchange overlaps (tau; its average is applied this
  /// many steps after it left). 0 = applied at once; must be < outer_steps.
  int overlap_steps = 0;
  /// Streaming: how the new outer parameters enter the island's model: alpha * island's +
  /// (1 - alpha) * outer (0 = replaced, DiLoCo's; the streaming paper's 0.5 keeps some of the
  /// steps made during the overlap).
  double merge_alpha = 0.0;
};

}  // namespace dtrain::parallel::diloco
