// Dropout randomness under tensor parallelism (Megatron-LM's RNG tracker): where activations are
// replicated across the group (embeddings, residual stream) every rank must drop the same
// elements, or the replicas drift apart; where they are split (attention heads, MLP columns)
// each rank's part must get its own mask, or the parts' masks would repeat. The tracker holds
// one generator of each kind, owned by the model, so ranks running as threads of one process do
// not share LibTorch's global generator.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dtrain::nn::tensor {

class RngTracker {
 public:
  /// `seed` must be the same on every rank of the group; `rank` is this rank's place in it.
  RngTracker(uint64_t seed, int rank);
  /// The same sequence on every rank of the group.
  at::Generator& replicated() { return replicated_; }
  /// A different sequence on each rank.
  at::Generator& parallel() { return parallel_; }

 private:
  at::Generator replicated_;
  at::Generator parallel_;
};

/// Inverted dropout drawing its mask from `generator`: each element zeroed with probability
/// `p`, the rest scaled by 1 / (1 - p). The identity when not training or p == 0.
at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& generator);

}  // namespace dtrain::nn::tensor
