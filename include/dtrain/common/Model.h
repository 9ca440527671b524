// Model: a LibTorch module plus its forward function, so the Trainer and strategies can train
// any user module (anything with `at::Tensor forward(at::Tensor)`) without knowing its type.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace torch::nn {
class Sequential;
}

namespace dtrain {

namespace nn {
class DeferredInit;
}

/// One step of a model's sequential decomposition (what ZeRO-3 gathers as a unit, what a
/// pipeline would place on a stage): `forward` uses only the parameters of `modules`.
struct Stage {
  std::string name;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  std::function<at::Tensor(const at::Tensor&)> forward;
  /// Recompute this stage's activations in backward instead of keeping them (activation
  /// checkpointing), for strategies that run the stages themselves.
  bool checkpoint = false;
  /// The generators its forward draws from besides the device's default one (a model's own
  /// dropout generators): a recomputation replays them too.
  std::vector<at::Generator> generators = {};
};

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  /// Optional: forward(x) == stages[n-1].forward(... stages[0].forward(x)). Empty when the model
  /// is opaque (strategies then treat it as one piece).
  std::vector<Stage> stages;
  /// Optional: the model's own loss, (output, targets) -> scalar mean, which the Trainer uses
  /// instead of its configured one (a tensor-parallel model's output is a block of the logits,
  /// whose loss is vocab-parallel).
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
  /// Optional: predicted classes from the output (default: argmax over the last dimension).
  std::function<at::Tensor(const at::Tensor&)> predict;
  /// Optional: what the model's later stages take from a batch's inputs besides the activation
  /// they receive (packed sequences' documents, which the embedding works out from the token
  /// ids). A strategy that runs the stages apart (a pipeline) calls it with a micro-batch's
  /// inputs before a stage without the model's first runs that micro-batch's forward, or a
  /// backward that recomputes it; forward() calls it itself.
  std::function<void(const at::Tensor&)> see_inputs;
  /// Set when the parameters are placeholders without memory whose values this draws
  /// (nn/DeferredInit.h: a model built for a strategy that keeps part of each parameter). A
  /// strategy that does not draw its parts calls materialize_all() first (the Trainer does).
  std::shared_ptr<nn::DeferredInit> deferred;

  Model() = default;
  Model(std::shared_ptr<torch::nn::Module> m, std::function<at::Tensor(const at::Tensor&)> f)
      : module(std::move(m)), forward(std::move(f)) {}
  /// From a module type with `forward(Tensor)`.
  template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::nn::Module, M>>>
  Model(std::shared_ptr<M> m)  // NOLINT(google-explicit-constructor): intended conversion
      : module(m), forward([raw = m.get()](const at::Tensor& x) { return raw->forward(x); }) {}
  /// From a TORCH_MODULE holder (torch::nn::Sequential, user modules).
  template <typename M>
  Model(const torch::nn::ModuleHolder<M>& holder)  // NOLINT(google-explicit-constructor)
      : Model(holder.ptr()) {}

  at::Tensor operator()(const at::Tensor& x) const { return forward(x); }
};

/// A Sequential as a Model with one stage per child.
Model sequential_model(const torch::nn::Sequential& sequential);

}  // namespace dtrain
