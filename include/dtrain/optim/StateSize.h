// An optimizer's per-parameter state (momentum, Adam moments, Adagrad sums): its size, and
// access in a form that does not depend on the optimizer's class, so sharded checkpoints can cut
// and re-join it (SGD, Adam, AdamW and Adagrad).
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <string>

namespace dtrain::optim {

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

/// Named state tensors: element-wise ones ("exp_avg", "momentum_buffer", ...) flattened to 1-D,
/// scalars ("step") as 0-dim int64.
using ParamState = std::map<std::string, at::Tensor>;

/// The state `optimizer` keeps for `parameter` (empty before its first step).
ParamState get_param_state(const torch::optim::Optimizer& optimizer, const at::Tensor& parameter);
/// Replaces it with `state` (get_param_state's form, copied; empty = no state).
void set_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
                     const ParamState& state);
/// The same without the copy: the optimizer keeps `state`'s tensors themselves (as views shaped
/// like `parameter` when they have its dtype and device), for a caller that gives them up.
void adopt_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& parameter,
                       ParamState&& state);
/// Tensors of the form get_param_state gives once `optimizer` has stepped `parameter` (SGD with
/// momentum, Adam, AdamW with amsgrad or not, Adagrad), with their pages written: the state it
/// holds, or zeros. For a caller that receives the state into them later (a replacement replica
/// waiting for its admission), so the page faults of fresh memory fall in the wait.
ParamState param_state_to_fill(const torch::optim::Optimizer& optimizer,
                               const at::Tensor& parameter);

}  // namespace dtrain::optim
