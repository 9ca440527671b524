// Backward split in two (zero-bubble pipelines, Qi et al. ICLR'24): B computes the gradient
// with respect to a stage's input, which the previous stage waits for, and W the weight
// gradients, which nobody waits for and which fill the pipeline's idle time later. dtrain's
// models compute their linear layers through nn::linear(); while a WeightGradDeferral scope is
// open on the thread that runs the forward, the layers it builds compute only their input's
// gradient in backward and leave their input and output gradient in the scope's store, whose
// compute() later forms the weight and bias gradients (W = dY^T X, b = sum dY) and accumulates
// them into .grad through autograd, so gradient hooks (data-parallel reducers) fire then.
// Outside a scope nn::linear() is at::linear. Under autocast a layer is computed as usual
// (its weight gradient in B): the deferral covers fp32, fp64 and bf16 weights.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dtrain::nn {

/// y = x W^T + b (at::linear), the weight gradient deferred inside a WeightGradDeferral scope.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const at::Tensor& bias = at::Tensor());

/// The weight gradients one forward's backward left for later.
class DeferredWeightGrads {
 public:
  DeferredWeightGrads();
  ~DeferredWeightGrads();
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;

  /// Bytes held for them (inputs and output gradients).
  int64_t bytes() const;
  /// B of a split backward: backpropagates `grad_output` (undefined for a scalar loss) from
  /// `output` to `input` (when it asks for a gradient) and `parameters`, without touching .grad
  /// (autograd::grad: no gradient hook fires). The deferred layers leave their W here; the
  /// other parameters' gradients (a norm's, an embedding's) are kept for compute(). Returns
  /// the input's gradient (undefined when it asks for none or none reaches it).
  at::Tensor backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                            const at::Tensor& input, const std::vector<at::Tensor>& parameters);
  /// W: forms every waiting gradient, adds those backward_input kept, and accumulates each
  /// parameter's sum into its .grad in one autograd call (gradient hooks fire). Empties the
  /// store.
  void compute();

  struct Entry;
  /// Called by the layers' backward.
  void add(Entry entry);

 private:
  std::vector<Entry> entries_;
  std::vector<at::Tensor> parameters_, gradients_;  // computed by backward_input
};

/// Whether nn::linear() on this thread defers weight gradients now (a scope with a store is
/// open): layers that fuse their own backward use nn::linear's path then.
bool deferring_weight_grads();

/// While alive, nn::linear() on this thread defers its weight gradient to `store` (which must
/// outlive the backward of what is computed meanwhile). Scopes nest; null turns deferral off.
class WeightGradDeferral {
 public:
  explicit WeightGradDeferral(DeferredWeightGrads* store);
  ~WeightGradDeferral();
  WeightGradDeferral(const WeightGradDeferral&) = delete;
  WeightGradDeferral& operator=(const WeightGradDeferral&) = delete;

 private:
  DeferredWeightGrads* previous_;
};

}  // namespace dtrain::nn
