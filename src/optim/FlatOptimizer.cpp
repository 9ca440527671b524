// The flat update rules (FlatOptimizer.h).
#include "dtrain/optim/FlatOptimizer.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"
#include "dtrain/optim/Optimizers.h"

namespace dtrain::optim {

void check(const FlatRule& rule) {
  DTRAIN_CHECK_INPUT(has_flat_rule(rule.name), "optimizer '", rule.name, "' has no flat rule (",
                     flat_rule_names(), ")");
}

FlatOptimizer::FlatOptimizer(FlatRule rule) : rule_(std::move(rule)) { check(rule_); }

void FlatOptimizer::init(const at::Tensor& values) {
  initialized_ = true;
  if (rule_.name == "sgd") {
    if (rule_.momentum > 0) first_ = at::zeros_like(values);
  } else if (rule_.name == "adagrad") {
    first_ = at::full_like(values, rule_.initial_accumulator);
  } else {
    first_ = at::zeros_like(values);
    second_ = at::full_like(values, rule_.initial_second);
    if (rule_.bias_correction) steps_ = at::zeros_like(values);
  }
}

void FlatOptimizer::step(at::Tensor& values, int64_t offset, const at::Tensor& gradient,
                         double lr) {
  if (!initialized_) init(values);
  const int64_t n = gradient.numel();
  at::Tensor w = values.narrow(0, offset, n);
  if (rule_.name == "sgd") {
    if (rule_.momentum == 0) {
      w.add_(gradient, -lr);
      return;
    }
    at::Tensor v = first_.narrow(0, offset, n);
    v.mul_(rule_.momentum).add_(gradient);
    w.add_(v, -lr);
  } else if (rule_.name == "adagrad") {
    at::Tensor sum = first_.narrow(0, offset, n);
    sum.addcmul_(gradient, gradient);
    w.addcdiv_(gradient, sum.sqrt().add_(rule_.adagrad_eps), -lr);
  } else {
    at::Tensor m = first_.narrow(0, offset, n);
    at::Tensor v = second_.narrow(0, offset, n);
    m.mul_(rule_.beta1).add_(gradient, 1 - rule_.beta1);
    v.mul_(rule_.beta2).addcmul_(gradient, gradient, 1 - rule_.beta2);
    if (!rule_.bias_correction) {
      w.addcdiv_(m, v.sqrt().add_(rule_.adam_eps), -lr);
      return;
    }
    at::Tensor t = steps_.narrow(0, offset, n);
    t.add_(1);
    const at::Tensor correction1 = 1 - at::pow(rule_.beta1, t);
    const at::Tensor correction2 = 1 - at::pow(rule_.beta2, t);
    w.sub_(m / correction1 / ((v / correction2).sqrt_().add_(rule_.adam_eps)) * lr);
  }
}

std::vector<std::pair<std::string, at::Tensor>> FlatOptimizer::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (first_.defined()) out.emplace_back("first", first_);
  if (second_.defined()) out.emplace_back("second", second_);
  if (steps_.defined()) out.emplace_back("steps", steps_);
  return out;
}

void FlatOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  first_ = second_ = steps_ = at::Tensor();
  initialized_ = !state.empty();
  for (const auto& [name, tensor] : state) {
    if (name == "first") first_ = tensor.clone();
    if (name == "second") second_ = tensor.clone();
    if (name == "steps") steps_ = tensor.clone();
  }
}

}  // namespace dtrain::optim
