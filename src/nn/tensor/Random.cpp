// The tensor-parallel RNG tracker and dropout with an explicit generator.
#include "dtrain/nn/tensor/Random.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace dtrain::nn::tensor {

namespace {
// Megatron's offset between the replicated and the per-rank seeds.
constexpr uint64_t kParallelSeedOffset = 2718;
}  // namespace

RngTracker::RngTracker(uint64_t seed, int rank)
    : replicated_(at::detail::createCPUGenerator(seed)),
      parallel_(at::detail::createCPUGenerator(seed + kParallelSeedOffset + rank)) {}

at::Tensor dropout(const at::Tensor& x, double p, bool training, at::Generator& generator) {
  if (!training || p == 0.0) return x;
  // bernoulli_ locks the generator itself. The tracker's generators are CPU ones: a GPU's mask
  // is drawn on the host and copied over (the same masks as on a CPU, for the same seeds).
  // A one-byte mask (as PyTorch's and Megatron's dropout keep): what backward holds of it.
  const at::Tensor keep = at::empty(x.sizes(), x.options().device(at::kCPU).dtype(at::kBool))
                              .bernoulli_(1.0 - p, generator);
  return x * (x.is_cpu() ? keep : keep.to(x.device(), /*non_blocking=*/false)) * (1.0 / (1.0 - p));
}

}  // namespace dtrain::nn::tensor
