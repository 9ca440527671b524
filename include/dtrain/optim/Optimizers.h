// Optimizers by name (LibTorch's SGD / Adam / AdamW / Adagrad) and the factory type strategies
// receive, so a strategy can build an optimizer over the parameters it owns (e.g. a shard).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/optim/OptimizerSpec.h"

namespace dtrain::optim {

using OptimizerPtr = std::unique_ptr<torch::optim::Optimizer>;
using OptimizerFactory = std::function<OptimizerPtr(std::vector<at::Tensor> parameters)>;

OptimizerPtr make_optimizer(std::vector<at::Tensor> parameters, const OptimizerSpec& spec);
/// Whether `name` also has a flat rule (FlatOptimizer.h), and the names that do ("sgd, ...").
bool has_flat_rule(const std::string& name);
std::string flat_rule_names();
/// A factory that builds `spec` over whatever parameters it is given.
OptimizerFactory optimizer_factory(OptimizerSpec spec);

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);
double learning_rate(const torch::optim::Optimizer& optimizer);

}  // namespace dtrain::optim
