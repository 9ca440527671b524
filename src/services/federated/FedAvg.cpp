#include "dtrain/services/federated/FedAvg.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "dtrain/common/Error.h"
#include "dtrain/optim/FlatOptimizer.h"
#include "dtrain/optim/Optimizers.h"

namespace dtrain::services::federated {

void validate(const LocalTraining& o) {
  DTRAIN_CHECK_INPUT(o.epochs >= 1, "--local-epochs must be >= 1, got ", o.epochs);
  DTRAIN_CHECK_INPUT(o.batch >= 0, "--local-batch must be >= 0 (0 = the whole local set), got ",
                     o.batch);
  DTRAIN_CHECK_INPUT(o.lr > 0 && std::isfinite(o.lr), "--lr must be > 0, got ", o.lr);
  DTRAIN_CHECK_INPUT(o.lr_decay > 0 && o.lr_decay <= 1, "--lr-decay must be in (0, 1], got ",
                     o.lr_decay);
  DTRAIN_CHECK_INPUT(o.momentum >= 0 && o.momentum < 1, "--momentum must be in [0, 1), got ",
                     o.momentum);
  DTRAIN_CHECK_INPUT(o.weight_decay >= 0, "--weight-decay must be >= 0, got ", o.weight_decay);
  DTRAIN_CHECK_INPUT(o.prox_mu >= 0 && std::isfinite(o.prox_mu), "--prox-mu must be >= 0, got ",
                     o.prox_mu);
  DTRAIN_CHECK_INPUT(
      o.correction == "none" || o.correction == "scaffold" || o.correction == "feddyn",
      "a plan's drift correction '", o.correction, "': expected none, scaffold or feddyn");
  DTRAIN_CHECK_INPUT(o.scaffold_option == 1 || o.scaffold_option == 2,
                     "--scaffold-option must be 1 or 2, got ", o.scaffold_option);
}

int64_t local_batch(const LocalTraining& plan, int64_t examples) {
  return plan.batch > 0 ? std::min(plan.batch, examples) : examples;
}

int64_t local_steps(const LocalTraining& plan, int64_t examples) {
  const int64_t batch = local_batch(plan, examples);
  return plan.epochs * ((examples + batch - 1) / batch);
}

LocalTraining plan_for_round(const LocalTraining& plan, int64_t round) {
  LocalTraining out = plan;
  out.lr = plan.lr * std::pow(plan.lr_decay, static_cast<double>(round));
  out.lr_decay = 1.0;
  return out;
}

void validate(const ServerOptimizerSpec& s) {
  DTRAIN_CHECK_INPUT(s.name == "sgd" || s.name == "adam", "--server-optimizer '", s.name,
                     "': expected sgd (FedAvg; FedAvgM with --server-momentum) or adam (FedAdam)");
  DTRAIN_CHECK_INPUT(s.lr > 0 && std::isfinite(s.lr), "--server-lr must be > 0, got ", s.lr);
  DTRAIN_CHECK_INPUT(s.momentum >= 0 && s.momentum < 1, "--server-momentum must be in [0, 1), got ",
                     s.momentum);
  DTRAIN_CHECK_INPUT(s.beta1 >= 0 && s.beta1 < 1 && s.beta2 >= 0 && s.beta2 < 1 && s.tau > 0,
                     "FedAdam needs 0 <= beta1, beta2 < 1 and tau > 0");
}

at::Tensor flatten_parameters(const Model& model) {
  std::vector<at::Tensor> flat;
  for (const auto& p : model.module->parameters()) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}

void load_flat_parameters(Model& model, const at::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : model.module->parameters()) {
    p.copy_(flat.slice(0, offset, offset + p.numel()).view_as(p));
    offset += p.numel();
  }
  DTRAIN_CHECK(offset == flat.numel(), "a flat vector of ", flat.numel(),
               " elements for a model of ", offset);
}

ClientUpdate train_locally(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                           const std::vector<int64_t>& indices, const LocalTraining& options,
                           uint64_t seed, const parallel::LossFn& loss,
                           const std::function<bool()>& keep_going, const at::Tensor& correction) {
  DTRAIN_CHECK_INPUT(!indices.empty(), "a client without training examples");
  load_flat_parameters(model, global);
  model.module->train();
  std::vector<at::Tensor> parameters = model.module->parameters();
  // FedProx's anchor: the global parameters, shaped as the model's.
  std::vector<at::Tensor> anchor;
  if (options.prox_mu > 0) {
    for (const auto& p : parameters) anchor.push_back(p.detach().clone());
  }
  optim::OptimizerSpec spec;
  spec.name = "sgd";
  spec.lr = options.lr;
  spec.momentum = options.momentum;
  spec.weight_decay = options.weight_decay;
  auto optimizer = optim::make_optimizer(parameters, spec);
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t batch = local_batch(options, n);
  std::vector<int64_t> order = indices;
  std::mt19937_64 rng(seed);
  ClientUpdate update;
  update.examples = n;
  double loss_sum = 0;
  for (int64_t epoch = 0; epoch < options.epochs; ++epoch) {
    if (batch < n) std::shuffle(order.begin(), order.end(), rng);
    for (int64_t begin = 0; begin < n; begin += batch) {
      const std::vector<int64_t> chosen(order.begin() + begin,
                                        order.begin() + std::min(n, begin + batch));
      if (keep_going && !keep_going()) {
        update.completed = false;
        return update;
      }
      const data::Batch b = data.get(chosen);
      optimizer->zero_grad();
      at::Tensor value = loss(model(b.inputs), b.targets);
      value.backward();
      if (options.prox_mu > 0) {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < parameters.size(); ++i) {
          at::Tensor& g = parameters[i].mutable_grad();
          if (g.defined()) g.add_(parameters[i] - anchor[i], options.prox_mu);
        }
      }
      if (correction.defined()) {
        torch::NoGradGuard no_grad;
        int64_t offset = 0;
        for (auto& p : parameters) {
          at::Tensor& g = p.mutable_grad();
          const at::Tensor c = correction.slice(0, offset, offset + p.numel()).view_as(p);
          if (g.defined()) {
            g.add_(c);
          } else {
            g = c.clone();
          }
          offset += p.numel();
        }
      }
      optimizer->step();
      loss_sum += value.item<double>();
      ++update.steps;
    }
  }
  update.loss = loss_sum / static_cast<double>(update.steps);
  update.delta = flatten_parameters(model) - global;
  return update;
}

void WeightedMean::restore(at::Tensor sum, double weight, int64_t count) {
  sum_ = std::move(sum);
  weight_ = weight;
  count_ = count;
}

void WeightedMean::add(const at::Tensor& update, double weight, double scale) {
  DTRAIN_CHECK(weight > 0 && scale >= 0, "an update of weight ", weight, " x ", scale);
  if (!sum_.defined()) {
    sum_ = update.to(at::kDouble) * (weight * scale);
  } else {
    DTRAIN_CHECK(sum_.numel() == update.numel(), "updates of ", sum_.numel(), " and ",
                 update.numel(), " elements");
    // Into the float64 sum without a float64 copy of the update (its elements are widened as
    // they are added: the same sum, one pass, no allocation).
    sum_.add_(update, weight * scale);
  }
  weight_ += weight;
  ++count_;
}

at::Tensor WeightedMean::mean(at::ScalarType dtype) const {
  if (!sum_.defined()) return {};
  return (sum_ / weight_).to(dtype);
}

namespace {

// The server optimizer as optim's flat rule. The averaged update is a direction of descent,
// so it is stepped as a gradient at rate -lr: global += lr x the rule's step. FedAdam (Reddi
// et al.) is Adam without bias correction, its second moment starting at tau^2, epsilon tau.
optim::FlatRule flat_rule(const ServerOptimizerSpec& spec) {
  validate(spec);
  optim::FlatRule rule;
  rule.name = spec.name;
  rule.momentum = spec.momentum;
  rule.beta1 = spec.beta1;
  rule.beta2 = spec.beta2;
  rule.adam_eps = spec.tau;
  rule.bias_correction = false;
  rule.initial_second = spec.tau * spec.tau;
  return rule;
}

}  // namespace

ServerOptimizer::ServerOptimizer(ServerOptimizerSpec spec)
    : spec_(std::move(spec)), flat_(flat_rule(spec_)) {}

void ServerOptimizer::step(at::Tensor& global, const at::Tensor& average) {
  torch::NoGradGuard no_grad;
  flat_.step(global, 0, average, -spec_.lr);
}

std::vector<std::pair<std::string, at::Tensor>> ServerOptimizer::state() const {
  return flat_.state();
}

void ServerOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  flat_.load_state(state);
}

}  // namespace dtrain::services::federated
