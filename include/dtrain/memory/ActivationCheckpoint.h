// Activation (gradient) checkpointing: run a segment of the network without keeping its
// activations, and recompute them in backward (Chen et al., "Training Deep Nets with Sublinear
// Memory Cost"). The recompute restores the RNG state of the original forward (dropout masks
// match) and its autocast state; gradients equal those without checkpointing.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <string>
#include <vector>

namespace dtrain::memory {

using SegmentFn = std::function<at::Tensor(const at::Tensor&)>;
using MultiSegmentFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

/// y = fn(x), keeping only `x` for backward. `parameters` are the leaves `fn` uses that need
/// gradients: they receive them through this node, in the outer backward pass (so DDP's hooks
/// fire as usual). `generators`: besides the device's default one, the generators `fn` draws
/// from (a model's own dropout generators), replayed too. Without grad mode this is just fn(x).
at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& x,
                      const std::vector<at::Tensor>& parameters,
                      const std::vector<at::Generator>& generators = {});

/// y = fn(inputs), keeping only `inputs` for backward (selective recomputation: attention's
/// core from its queries, keys and values).
at::Tensor checkpoint(const MultiSegmentFn& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& parameters,
                      const std::vector<at::Generator>& generators = {});

/// checkpoint() over `module`'s forward and parameters.
at::Tensor checkpoint(torch::nn::Module& module, const SegmentFn& forward, const at::Tensor& x);

/// Runs `sequence` as `segments` contiguous segments, checkpointing all but the last (PyTorch's
/// checkpoint_sequential); segments <= 1 runs it normally.
at::Tensor checkpoint_sequential(const torch::nn::Sequential& sequence, int64_t segments,
                                 const at::Tensor& x);

/// Runs `stages` in order as `segments` contiguous segments (as even as possible), checkpointing
/// all but the last; `parameters[i]` are stage i's parameters. segments <= 1: no checkpointing.
at::Tensor checkpoint_stages(const std::vector<SegmentFn>& stages,
                             const std::vector<std::vector<at::Tensor>>& parameters,
                             int64_t segments, const at::Tensor& x,
                             const std::vector<at::Generator>& generators = {});

/// round(sqrt(layers)), at least 1: the segment count that minimizes memory (~2 sqrt(N) layer
/// activations) for one extra forward.
int64_t sqrt_segments(int64_t layers);

/// Parses `--checkpointing`: "none" -> 0, "sqrt" -> sqrt_segments(layers), "K" -> K.
/// "selective" (attention's core only) is the transformers' (models/Gpt.h) and refused here.
int64_t parse_segments(const std::string& value, int64_t layers);

}  // namespace dtrain::memory
