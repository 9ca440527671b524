// Update rules on one flat tensor of parameters, applied to any range of it: what a
// parameter-server shard does with a pushed gradient (its slice of the model) and what the
// federated server does with a round's averaged update. The names are optim's own (one table,
// Optimizers.cpp, for LibTorch's optimizers and these); the state tensors are named for
// checkpoints.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::optim {

struct FlatRule {
  /// "sgd" (momentum: heavy ball, v = momentum v + g), "adagrad" or "adam".
  std::string name = "sgd";
  double momentum = 0.0;
  /// Adagrad: the accumulator's initial value (as torch.optim.Adagrad) and epsilon.
  double initial_accumulator = 0.0;
  double adagrad_eps = 1e-10;
  /// Adam: decay rates, epsilon, bias correction (per element: a range may be updated more
  /// often than another) and the second moment's initial value (FedAdam, Reddi et al.: no
  /// bias correction, v starting at tau^2, epsilon tau).
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  bool bias_correction = true;
  double initial_second = 0.0;
};

/// InputError naming the rule when it is not one of optim's flat rules.
void check(const FlatRule& rule);

class FlatOptimizer {
 public:
  explicit FlatOptimizer(FlatRule rule);
  /// Allocates the state for parameters like `values` (else done at the first step).
  void init(const at::Tensor& values);
  /// values[offset, offset + n) -= lr x the rule's step for `gradient` (n elements).
  void step(at::Tensor& values, int64_t offset, const at::Tensor& gradient, double lr);
  /// Named state tensors ("first", "second", "steps"), empty before the state is needed.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  /// Restores state() (names it does not know are ignored).
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state);
  const FlatRule& rule() const { return rule_; }

 private:
  FlatRule rule_;
  bool initialized_ = false;
  at::Tensor first_, second_, steps_;
};

}  // namespace dtrain::optim
