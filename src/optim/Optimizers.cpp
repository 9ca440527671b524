// Optimizers by name: one table for LibTorch's optimizers and the flat rules; validates values.
#include "dtrain/optim/Optimizers.h"

#include <torch/optim.h>

#include "dtrain/common/Error.h"

namespace dtrain::optim {

namespace {

// The one table of optimizers by name: LibTorch's optimizer for the Trainer's strategies, and
// whether a flat rule (FlatOptimizer.h: parameter-server shards, the federated server) exists.
struct Entry {
  const char* name;
  bool flat;
  OptimizerPtr (*make)(std::vector<at::Tensor> parameters, const OptimizerSpec& spec);
};

const Entry kOptimizers[] = {
    {"sgd", true,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       DTRAIN_CHECK_INPUT(spec.momentum >= 0, "momentum must be >= 0, got ", spec.momentum);
       DTRAIN_CHECK_INPUT(!spec.nesterov || spec.momentum > 0, "nesterov needs momentum > 0");
       return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(spec.lr)
                                                                  .momentum(spec.momentum)
                                                                  .nesterov(spec.nesterov)
                                                                  .weight_decay(spec.weight_decay));
     }},
    {"adam", true,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       return std::make_unique<torch::optim::Adam>(parameters,
                                                   torch::optim::AdamOptions(spec.lr)
                                                       .betas({spec.beta1, spec.beta2})
                                                       .eps(spec.eps)
                                                       .weight_decay(spec.weight_decay));
     }},
    {"adamw", false,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       return std::make_unique<torch::optim::AdamW>(parameters,
                                                    torch::optim::AdamWOptions(spec.lr)
                                                        .betas({spec.beta1, spec.beta2})
                                                        .eps(spec.eps)
                                                        .weight_decay(spec.weight_decay));
     }},
    {"adagrad", true,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       return std::make_unique<torch::optim::Adagrad>(
           parameters, torch::optim::AdagradOptions(spec.lr).weight_decay(spec.weight_decay));
     }},
};

std::string names_where(bool flat_only) {
  std::string out;
  for (const Entry& entry : kOptimizers) {
    if (flat_only && !entry.flat) continue;
    out += (out.empty() ? "" : ", ") + std::string(entry.name);
  }
  return out;
}

}  // namespace

OptimizerPtr make_optimizer(std::vector<at::Tensor> parameters, const OptimizerSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.lr > 0, "learning rate must be > 0, got ", spec.lr);
  DTRAIN_CHECK_INPUT(spec.weight_decay >= 0, "weight decay must be >= 0, got ", spec.weight_decay);
  for (const Entry& entry : kOptimizers) {
    if (spec.name == entry.name) return entry.make(std::move(parameters), spec);
  }
  DTRAIN_THROW(InputError, "unknown optimizer '", spec.name, "' (expected ", names_where(false),
               ")");
}

bool has_flat_rule(const std::string& name) {
  for (const Entry& entry : kOptimizers) {
    if (name == entry.name) return entry.flat;
  }
  return false;
}

std::string flat_rule_names() { return names_where(true); }

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
