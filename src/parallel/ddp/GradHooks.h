// GradReadyHooks: calls back after each parameter's gradient is accumulated in backward (post-hooks
// on the parameters' AccumulateGrad nodes), for the Reducer and ZeRO-3's sharder.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace dtrain::parallel::ddp {

class GradReadyHooks {
 public:
  /// `on_ready(k)` runs once parameter k's .grad holds this backward's gradient.
  explicit GradReadyHooks(std::function<void(size_t)> on_ready) : on_ready_(std::move(on_ready)) {}
  ~GradReadyHooks();
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  /// Hooks every parameter; re-hooks those whose node changed since the last call (a parameter
  /// re-assigned with set_, as torch::load does, gets a new AccumulateGrad node).
  void attach(const std::vector<at::Tensor>& parameters, const std::vector<std::string>& names);

 private:
  std::function<void(size_t)> on_ready_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> keys_;
};

}  // namespace dtrain::parallel::ddp
