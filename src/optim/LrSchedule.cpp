// Warmup + decay arithmetic.
#include "dtrain/optim/LrSchedule.h"

#include <algorithm>
#include <cmath>

#include "dtrain/common/Error.h"

namespace dtrain::optim {

LrSchedule::LrSchedule(double base_lr, int64_t total_steps, LrScheduleSpec spec)
    : base_lr_(base_lr), total_steps_(std::max<int64_t>(total_steps, 1)), spec_(std::move(spec)) {
  DTRAIN_CHECK_INPUT(spec_.decay == "constant" || spec_.decay == "step" || spec_.decay == "cosine",
                     "unknown lr decay '", spec_.decay, "' (expected constant, step or cosine)");
  DTRAIN_CHECK_INPUT(spec_.warmup_steps >= 0, "warmup steps must be >= 0, got ",
                     spec_.warmup_steps);
  DTRAIN_CHECK_INPUT(spec_.step_size > 0, "lr step size must be > 0, got ", spec_.step_size);
  DTRAIN_CHECK_INPUT(spec_.min_lr_fraction >= 0 && spec_.min_lr_fraction <= 1,
                     "min lr fraction must be in [0, 1], got ", spec_.min_lr_fraction);
}

double LrSchedule::at(int64_t step) const {
  if (step < spec_.warmup_steps) {
    return base_lr_ * static_cast<double>(step + 1) / static_cast<double>(spec_.warmup_steps);
  }
  const int64_t t = step - spec_.warmup_steps;
  if (spec_.decay == "step") {
    return base_lr_ * std::pow(spec_.gamma, static_cast<double>(t / spec_.step_size));
  }
  if (spec_.decay == "cosine") {
    const double span =
        static_cast<double>(std::max<int64_t>(total_steps_ - spec_.warmup_steps, 1));
    const double progress = std::min(1.0, static_cast<double>(t) / span);
    const double floor = base_lr_ * spec_.min_lr_fraction;
    return floor + (base_lr_ - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return base_lr_;
}

double linear_scaled_lr(double base_lr, int64_t global_batch, int64_t reference_batch) {
  DTRAIN_CHECK_INPUT(reference_batch > 0, "reference batch must be > 0, got ", reference_batch);
  return base_lr * static_cast<double>(global_batch) / static_cast<double>(reference_batch);
}

}  // namespace dtrain::optim
