// Dynamic loss scaler.
#include "dtrain/precision/LossScaler.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::precision {

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {
  DTRAIN_CHECK_INPUT(options_.init_scale > 0 && options_.growth_factor > 1 &&
                         options_.backoff_factor > 0 && options_.backoff_factor < 1 &&
                         options_.growth_interval >= 1 && options_.min_scale > 0,
                     "invalid loss scaler options (init_scale > 0, growth_factor > 1, "
                     "0 < backoff_factor < 1, growth_interval >= 1, min_scale > 0)");
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

bool LossScaler::unscale_and_check(const std::vector<at::Tensor>& parameters,
                                   const comm::CommunicatorPtr& comm) {
  const double inverse = 1.0 / scale_;
  // One flag accumulated where the gradients are, read once: on a GPU a read per parameter
  // would wait for the device that many times.
  at::Tensor nonfinite;
  for (const auto& p : parameters) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    at::Tensor g = grad;  // shares storage
    g.mul_(inverse);
    const at::Tensor bad = at::isfinite(g).logical_not().any();
    nonfinite = nonfinite.defined() ? nonfinite.logical_or(bad) : bad;
  }
  bool found = nonfinite.defined() && nonfinite.item<bool>();
  if (comm && comm->size() > 1) {
    // Agree: a step skipped on one rank must be skipped on all, or the replicas diverge.
    at::Tensor flag = at::full({1}, found ? 1.0 : 0.0, at::kFloat);
    comm->allreduce(flag, {comm::ReduceOp::Max})->wait();
    found = flag.item<float>() > 0;
  }
  return found;
}

void LossScaler::update(bool found_inf) {
  if (found_inf) {
    ++skipped_;
    growth_tracker_ = 0;
    scale_ *= options_.backoff_factor;
    DTRAIN_CHECK(scale_ >= options_.min_scale, "loss scale fell to ", scale_,
                 " (below the minimum ", options_.min_scale, ") after ", skipped_,
                 " skipped steps: the gradients are inf/NaN even unscaled; the run has "
                 "diverged (lower the learning rate, or check the data)");
    return;
  }
  if (++growth_tracker_ >= options_.growth_interval) {
    scale_ *= options_.growth_factor;
    growth_tracker_ = 0;
  }
}

at::Tensor LossScaler::state() const {
  return at::tensor({scale_, static_cast<double>(growth_tracker_), static_cast<double>(skipped_)},
                    at::kDouble);
}

void LossScaler::load_state(const at::Tensor& state) {
  DTRAIN_CHECK_INPUT(state.numel() == 3 && state.scalar_type() == at::kDouble,
                     "loss scaler state must be 3 float64 values, got ", state.sizes());
  scale_ = state[0].item<double>();
  growth_tracker_ = static_cast<int64_t>(state[1].item<double>());
  skipped_ = static_cast<int64_t>(state[2].item<double>());
}

}  // namespace dtrain::precision
