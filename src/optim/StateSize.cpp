// Sums the tensors of LibTorch's per-parameter optimizer states.
#include "dtrain/optim/StateSize.h"

#include <torch/optim.h>

#include <string>
#include <utility>

#include "dtrain/common/Error.h"
#include "dtrain/optim/Offload.h"
#include "optim/StateKey.h"

namespace dtrain::optim {

namespace {

int64_t bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

void put(ParamState& state, const std::string& name, const at::Tensor& t) {
  if (t.defined()) state[name] = t.detach().reshape({-1});
}

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }

// `name` from `state`, shaped like `parameter` (a copy unless `copy` is false and it has the
// parameter's dtype and device already); undefined when absent.
at::Tensor take(const ParamState& state, const std::string& name, const at::Tensor& parameter,
                bool copy) {
  auto it = state.find(name);
  if (it == state.end()) return {};
  DTRAIN_CHECK_INPUT(it->second.numel() == parameter.numel(), "optimizer state '", name, "' has ",
                     it->second.numel(), " elements for a parameter of ", parameter.numel());
  at::Tensor value =
      it->second.to(parameter.options().requires_grad(false)).reshape(parameter.sizes());
  return copy ? value.clone() : value;
}

int64_t take_step(const ParamState& state) {
  auto it = state.find("step");
  return it == state.end() ? 0 : it->second.item<int64_t>();
}

// Adam and AdamW keep the same fields in different classes.
template <typename S>
void get_adam(ParamState& out, const S& s) {
  out["step"] = step_tensor(s.step());
  put(out, "exp_avg", s.exp_avg());
  put(out, "exp_avg_sq", s.exp_avg_sq());
  put(out, "max_exp_avg_sq", s.max_exp_avg_sq());
}

template <typename S>
std::unique_ptr<S> make_adam(const ParamState& state, const at::Tensor& parameter, bool copy) {
  auto s = std::make_unique<S>();
  s->step(take_step(state));
  s->exp_avg(take(state, "exp_avg", parameter, copy));
  s->exp_avg_sq(take(state, "exp_avg_sq", parameter, copy));
  s->max_exp_avg_sq(take(state, "max_exp_avg_sq", parameter, copy));
  return s;
}

void install(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
             const ParamState& state, bool copy) {
  if (auto* offloaded = dynamic_cast<OffloadedOptimizer*>(&optimizer)) {
    offloaded->set_state_of(parameter, state);
    return;
  }
  const StateKey key = key_of(parameter);
  optimizer.state().erase(key);
  if (state.empty()) return;
  std::unique_ptr<torch::optim::OptimizerParamState> made;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(take(state, "momentum_buffer", parameter, copy));
    made = std::move(s);
  } else if (dynamic_cast<torch::optim::Adam*>(&optimizer)) {
    made = make_adam<torch::optim::AdamParamState>(state, parameter, copy);
  } else if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    made = make_adam<torch::optim::AdamWParamState>(state, parameter, copy);
  } else if (dynamic_cast<torch::optim::Adagrad*>(&optimizer)) {
    auto g = std::make_unique<torch::optim::AdagradParamState>();
    g->step(take_step(state));
    g->sum(take(state, "sum", parameter, copy));
    made = std::move(g);
  } else {
    DTRAIN_THROW(Error, "optimizer state of an unsupported optimizer class");
  }
  optimizer.state()[key] = std::move(made);
}

}  // namespace

ParamState get_param_state(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter) {
  if (const auto* offloaded = dynamic_cast<const OffloadedOptimizer*>(&optimizer)) {
    return offloaded->state_of(parameter);
  }
  ParamState out;
  auto it = optimizer.state().find(key_of(parameter));
  if (it == optimizer.state().end()) return out;
  const auto* state = it->second.get();
  if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
    put(out, "momentum_buffer", s->momentum_buffer());
  } else if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
    get_adam(out, *a);
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
    get_adam(out, *w);
  } else if (auto* g = dynamic_cast<const torch::optim::AdagradParamState*>(state)) {
    out["step"] = step_tensor(g->step());
    put(out, "sum", g->sum());
  } else {
    DTRAIN_THROW(Error, "optimizer state of an unsupported optimizer class");
  }
  return out;
}

void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
                     const ParamState& state) {
  install(optimizer, parameter, state, /*copy=*/true);
}

void adopt_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
                       ParamState&& state) {
  install(optimizer, parameter, state, /*copy=*/false);
  state.clear();
}

ParamState param_state_to_fill(const torch::optim::Optimizer& optimizer,
                               const at::Tensor& parameter) {
  if (const auto* offloaded = dynamic_cast<const OffloadedOptimizer*>(&optimizer)) {
    return offloaded->state_to_fill(parameter);
  }
  ParamState state = get_param_state(optimizer, parameter);
  if (!state.empty()) return state;
  const torch::optim::OptimizerOptions* options = nullptr;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.unsafeGetTensorImpl() == parameter.unsafeGetTensorImpl()) options = &group.options();
    }
  }
  if (options == nullptr) return state;
  auto zeros = [&parameter] {
    return at::zeros({parameter.numel()}, parameter.options().requires_grad(false));
  };
  if (const auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(options)) {
    if (sgd->momentum() != 0) state["momentum_buffer"] = zeros();
    return state;
  }
  auto adam = [&](bool amsgrad) {
    state["step"] = step_tensor(0);
    state["exp_avg"] = zeros();
    state["exp_avg_sq"] = zeros();
    if (amsgrad) state["max_exp_avg_sq"] = zeros();
  };
  if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(options)) {
    adam(a->amsgrad());
  } else if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(options)) {
    adam(w->amsgrad());
  } else if (dynamic_cast<const torch::optim::AdagradOptions*>(options) != nullptr) {
    state["step"] = step_tensor(0);
    state["sum"] = zeros();
  }
  return state;
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  if (const auto* offloaded = dynamic_cast<const OffloadedOptimizer*>(&optimizer)) {
    return offloaded->resident_state_bytes();
  }
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) {
    const auto* state = entry.second.get();
    if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      total += bytes(s->momentum_buffer());
    } else if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      total += bytes(a->exp_avg()) + bytes(a->exp_avg_sq()) + bytes(a->max_exp_avg_sq());
    } else if (auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      total += bytes(w->exp_avg()) + bytes(w->exp_avg_sq()) + bytes(w->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const torch::optim::AdagradParamState*>(state)) {
      total += bytes(g->sum());
    }
  }
  return total;
}

}  // namespace dtrain::optim
