// Builds LibTorch optimizers from an OptimizerSpec and validates its values.
#include "dtrain/optim/Optimizers.h"

#include <torch/optim.h>

#include "dtrain/common/Error.h"

namespace dtrain::optim {

OptimizerPtr make_optimizer(std::vector<at::Tensor> parameters, const OptimizerSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.lr > 0, "learning rate must be > 0, got ", spec.lr);
  DTRAIN_CHECK_INPUT(spec.weight_decay >= 0, "weight decay must be >= 0, got ",
                     spec.weight_decay);
  if (spec.name == "sgd") {
    DTRAIN_CHECK_INPUT(spec.momentum >= 0, "momentum must be >= 0, got ", spec.momentum);
    DTRAIN_CHECK_INPUT(!spec.nesterov || spec.momentum > 0, "nesterov needs momentum > 0");
    return std::make_unique<torch::optim::SGD>(
        parameters, torch::optim::SGDOptions(spec.lr)
                        .momentum(spec.momentum)
                        .nesterov(spec.nesterov)
                        .weight_decay(spec.weight_decay));
  }
  if (spec.name == "adam") {
    return std::make_unique<torch::optim::Adam>(
        parameters, torch::optim::AdamOptions(spec.lr)
                        .betas({spec.beta1, spec.beta2})
                        .eps(spec.eps)
                        .weight_decay(spec.weight_decay));
  }
  if (spec.name == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        parameters, torch::optim::AdamWOptions(spec.lr)
                        .betas({spec.beta1, spec.beta2})
                        .eps(spec.eps)
                        .weight_decay(spec.weight_decay));
  }
  if (spec.name == "adagrad") {
    return std::make_unique<torch::optim::Adagrad>(
        parameters, torch::optim::AdagradOptions(spec.lr).weight_decay(spec.weight_decay));
  }
  DTRAIN_THROW(InputError, "unknown optimizer '", spec.name,
               "' (expected sgd, adam, adamw or adagrad)");
}

OptimizerFactory optimizer_factory(OptimizerSpec spec) {
  return [spec](std::vector<at::Tensor> parameters) {
    return make_optimizer(std::move(parameters), spec);
  };
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

double learning_rate(const torch::optim::Optimizer& optimizer) {
  return optimizer.param_groups().at(0).options().get_lr();
}

}  // namespace dtrain::optim
