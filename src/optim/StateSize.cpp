// Sums the tensors of LibTorch's per-parameter optimizer states.
#include "dtrain/optim/StateSize.h"

#include <torch/optim.h>

namespace dtrain::optim {

namespace {
int64_t bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }
}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
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
