#include "dtrain/nn/WeightGrad.h"

#include <torch/torch.h>

#include <unordered_map>

#include "common/TorchCompat.h"
#include "dtrain/common/Error.h"

namespace dtrain::nn {

struct DeferredWeightGrads::Entry {
  at::Tensor input;        // the layer's input, [..., in]
  at::Tensor grad_output;  // its output's gradient, [..., out]
  at::Tensor weight;       // [out, in]
  at::Tensor bias;         // [out] or undefined
};

namespace {

thread_local DeferredWeightGrads* current_store = nullptr;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The linear layer whose backward returns the input's gradient only and hands the store what
// the weight's (and bias's) needs. The weight is an input even though its gradient is left for
// W: the output then asks for a gradient even when the layer's input does not, so a first
// layer's backward still runs and leaves its W. Two functions, with and without a bias
// (Function::apply cannot take an undefined tensor on LibTorch 1.13). The store travels in the
// context (backward may run on another thread).
at::Tensor deferred_backward(AutogradContext* ctx, const at::Tensor& grad_output,
                             const at::Tensor& bias) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& input = saved[0];
  const at::Tensor& weight = saved[1];
  at::Tensor grad_input;
  if (input.requires_grad()) grad_input = at::matmul(grad_output, weight);
  auto* store = reinterpret_cast<DeferredWeightGrads*>(ctx->saved_data["store"].toInt());
  store->add({input, grad_output, weight, bias});
  return grad_input;
}

struct DeferredLinear : torch::autograd::Function<DeferredLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            int64_t store) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["store"] = store;
    return at::linear(input, weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {deferred_backward(ctx, grads[0], at::Tensor()), at::Tensor(), at::Tensor()};
  }
};

struct DeferredLinearWithBias : torch::autograd::Function<DeferredLinearWithBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t store) {
    ctx->save_for_backward({input, weight, bias});
    ctx->saved_data["store"] = store;
    return at::linear(input, weight, bias);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor bias = ctx->get_saved_variables()[2];
    return {deferred_backward(ctx, grads[0], bias), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool autocasting(const at::Tensor& t) { return compat::autocast_state(t.device().type()).enabled; }

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  const bool defer = current_store != nullptr && weight.requires_grad() &&
                     torch::GradMode::is_enabled() && !autocasting(input);
  if (!defer) {
    return at::linear(
        input, weight,
        bias.defined() ? c10::optional<at::Tensor>(bias) : c10::optional<at::Tensor>());
  }
  const auto store = reinterpret_cast<int64_t>(current_store);
  return bias.defined() ? DeferredLinearWithBias::apply(input, weight, bias, store)
                        : DeferredLinear::apply(input, weight, store);
}

DeferredWeightGrads::DeferredWeightGrads() = default;
DeferredWeightGrads::~DeferredWeightGrads() = default;

int64_t DeferredWeightGrads::bytes() const {
  int64_t total = 0;
  for (const auto& e : entries_) {
    total += e.input.numel() * e.input.element_size();
    total += e.grad_output.numel() * e.grad_output.element_size();
  }
  return total;
}

void DeferredWeightGrads::add(Entry entry) { entries_.push_back(std::move(entry)); }

at::Tensor DeferredWeightGrads::backward_input(const at::Tensor& output,
                                               const at::Tensor& grad_output,
                                               const at::Tensor& input,
                                               const std::vector<at::Tensor>& parameters) {
  const bool wants_input = input.defined() && input.requires_grad();
  std::vector<at::Tensor> wrt;
  if (wants_input) wrt.push_back(input);
  for (const auto& p : parameters) {
    if (p.requires_grad()) wrt.push_back(p);
  }
  std::vector<at::Tensor> grads;
  if (output.requires_grad() && !wrt.empty()) {
    grads = torch::autograd::grad(
        {output}, wrt,
        grad_output.defined() ? std::vector<at::Tensor>{grad_output} : std::vector<at::Tensor>{},
        /*retain_graph=*/false, /*create_graph=*/false,
        /*allow_unused=*/true);
  }
  grads.resize(wrt.size());
  parameters_.insert(parameters_.end(), wrt.begin() + (wants_input ? 1 : 0), wrt.end());
  gradients_.insert(gradients_.end(), grads.begin() + (wants_input ? 1 : 0), grads.end());
  return wants_input ? grads[0] : at::Tensor();
}

void DeferredWeightGrads::compute() {
  // One sum per parameter (a weight used by several layers, or also by a non-linear op whose
  // gradient backward computed), then one autograd call over all of them.
  std::vector<at::Tensor> parameters, gradients;
  std::unordered_map<const void*, size_t> index;
  auto accumulate = [&](const at::Tensor& parameter, at::Tensor gradient) {
    if (!gradient.defined()) return;
    const auto [it, fresh] = index.emplace(parameter.unsafeGetTensorImpl(), parameters.size());
    if (fresh) {
      parameters.push_back(parameter);
      gradients.push_back(std::move(gradient));
    } else {
      gradients[it->second] = gradients[it->second] + gradient;
    }
  };
  {
    torch::NoGradGuard no_grad;
    for (auto& e : entries_) {
      const int64_t out = e.grad_output.size(-1), in = e.input.size(-1);
      const at::Tensor dy = e.grad_output.reshape({-1, out});
      accumulate(e.weight, at::mm(dy.t(), e.input.reshape({-1, in})));
      if (e.bias.defined() && e.bias.requires_grad()) accumulate(e.bias, dy.sum(0));
    }
    entries_.clear();
    for (size_t i = 0; i < gradients_.size(); ++i) accumulate(parameters_[i], gradients_[i]);
    parameters_.clear();
    gradients_.clear();
  }
  if (!parameters.empty()) torch::autograd::backward(parameters, gradients);
}

bool deferring_weight_grads() { return current_store != nullptr; }

WeightGradDeferral::WeightGradDeferral(DeferredWeightGrads* store) : previous_(current_store) {
  current_store = store;
}

WeightGradDeferral::~WeightGradDeferral() { current_store = previous_; }

}  // namespace dtrain::nn
