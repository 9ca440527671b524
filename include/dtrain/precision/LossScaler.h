// Dynamic loss scaling (as torch.cuda.amp.GradScaler): multiply the loss by a scale so small fp16
// gradients do not flush to zero; before clipping and the step, divide the gradients by it and
// skip the step if any is inf/NaN on any rank; halve the scale on overflow, double it after
// `growth_interval` clean steps, and fail clearly instead of letting it collapse.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::precision {

struct LossScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  /// Below this scale training stops with an error (the gradients overflow however small the
  /// scale: a diverged run, not a scaling problem).
  double min_scale = 1.0;
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  /// loss x scale.
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides every defined gradient by the scale, in place. Returns whether any gradient on any
  /// rank of `comm` (may be null: this rank only) is inf/NaN; all ranks get the same answer.
  bool unscale_and_check(const std::vector<at::Tensor>& parameters,
                         const comm::CommunicatorPtr& comm);
  /// Records the step's outcome and adapts the scale. Throws when the scale falls below
  /// min_scale.
  void update(bool found_inf);

  double scale_value() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }

  /// State for checkpoints: [scale, growth tracker, skipped steps] as float64.
  at::Tensor state() const;
  void load_state(const at::Tensor& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace dtrain::precision
