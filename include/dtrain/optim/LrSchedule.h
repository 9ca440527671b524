// Learning-rate schedules: linear warmup (Goyal et al., "Accurate, Large Minibatch SGD") then
// constant, step or cosine decay; and the linear scaling rule for large global batches.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::optim {

struct LrScheduleSpec {
  /// "constant", "step" or "cosine".
  std::string decay = "constant";
  /// Steps of linear warmup from base_lr / warmup_steps up to base_lr.
  int64_t warmup_steps = 0;
  /// step decay: multiply by `gamma` every `step_size` steps after warmup.
  int64_t step_size = 1000;
  double gamma = 0.1;
  /// cosine decay: the final learning rate as a fraction of base_lr.
  double min_lr_fraction = 0.0;
};

class LrSchedule {
 public:
  LrSchedule(double base_lr, int64_t total_steps, LrScheduleSpec spec);
  /// Learning rate for optimizer step `step` (0-based).
  double at(int64_t step) const;
  double base_lr() const { return base_lr_; }

 private:
  double base_lr_;
  int64_t total_steps_;
  LrScheduleSpec spec_;
};

/// The linear scaling rule: lr grows with the global batch relative to a reference batch.
double linear_scaled_lr(double base_lr, int64_t global_batch, int64_t reference_batch);

}  // namespace dtrain::optim
