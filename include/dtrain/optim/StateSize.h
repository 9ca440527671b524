// Bytes held in an optimizer's per-parameter state (momentum, Adam moments, Adagrad sums).
#pragma once

#include <torch/optim/optimizer.h>

namespace dtrain::optim {

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace dtrain::optim
