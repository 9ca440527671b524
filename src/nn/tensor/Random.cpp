// The tensor-parallel RNG tracker and dropout with an explicit generator.
#include "dtrain/nn/tensor/Random.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace dtrain::tensor {

namespace {
// Megatron's offset between the replicated and the per-rank seeds.
constexpr uint64_t kParallelSeedOffset = 2718;
}  // namespace

RngTracker::RngTracker(uint64_t seed, int rank)
    : replicated_(at::detail::createCPUGenerator(seed)),
      parallel_(at::detail::createCPUGenerator(seed + kParallelSeedOffset + rank)) {}

at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& generator) {
  if (!training || p == 0.0) return x;
  // bernoulli_ locks the generator itself.
  const at::Tensor keep = at::empty_like(x).bernoulli_(1.0 - p, generator);
  return x * keep * (1.0 / (1.0 - p));
}

}  // namespace dtrain::tensor
