// FedAvg's two halves (McMahan et al. 2017): a client trains the global model on its own
// examples for E epochs of batch B and returns the change (its update), and the server averages
// the updates weighted by the clients' example counts and applies the average with a server
// optimizer: plain FedAvg (SGD at rate 1: the average becomes the model), FedAvgM (momentum)
// or FedAdam (Reddi et al. 2021). FedSGD is E = 1 with the full local batch; FedProx adds
// mu/2 ||w - w_global||^2 to the local objective (Li et al. 2020).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/optim/FlatOptimizer.h"
#include "dtrain/parallel/Strategy.h"

namespace dtrain::services::federated {

struct LocalTraining {
  /// E: passes over the local training examples.
  int64_t epochs = 5;
  /// B: local batch size (0 = all local examples in one batch: FedSGD's full batch).
  int64_t batch = 10;
  /// Local SGD.
  double lr = 0.05;
  /// The local rate of round r (0-based) is lr x lr_decay^r (1 = constant; McMahan et al.
  /// decay it by about 0.99 a round in some experiments).
  double lr_decay = 1.0;
  double momentum = 0.0;
  double weight_decay = 0.0;
  /// FedProx's proximal weight mu (0 = plain FedAvg; FedDyn's alpha).
  double prox_mu = 0.0;
  /// Drift correction (set by the aggregator's plan, Drift.h): "none", "scaffold" (Karimireddy
  /// et al. 2020) or "feddyn" (Acar et al. 2021).
  std::string correction = "none";
  /// SCAFFOLD's update of the client control variate: 1 (the gradient at the server model, one
  /// more pass over the local data) or 2 (from the local steps' total movement; the paper's
  /// choice).
  int scaffold_option = 2;
};

/// InputError naming the flag out of range.
void validate(const LocalTraining& options);

/// The examples in one local step of `plan` over `examples` examples (B, or all for B = 0), and
/// the steps the plan takes.
int64_t local_batch(const LocalTraining& plan, int64_t examples);
int64_t local_steps(const LocalTraining& plan, int64_t examples);

/// `plan` for round `round` (0-based): its rate decayed.
LocalTraining plan_for_round(const LocalTraining& plan, int64_t round);

struct ClientUpdate {
  /// The trained local parameters minus the global ones, flat (the model's dtype).
  at::Tensor delta;
  /// Local training examples (the update's weight).
  int64_t examples = 0;
  /// Mean training loss over the local steps, and the steps taken.
  double loss = 0.0;
  int64_t steps = 0;
  /// False when `keep_going` ended local training early (the update is then not sent).
  bool completed = true;
};

/// The model's parameters as one flat tensor (a copy), and back.
at::Tensor flatten_parameters(const Model& model);
void load_flat_parameters(Model& model, const at::Tensor& flat);

/// Sets `model` to `global` and trains it on `data`'s examples `indices` as `options` say
/// (each epoch in an order drawn from `seed`); returns the update. `keep_going` (if given) is
/// asked before every local step: false stops training (completed = false). `correction` (flat,
/// if defined) is added to every step's gradient (SCAFFOLD's c - c_i, FedDyn's -grad memory).
ClientUpdate train_locally(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                           const std::vector<int64_t>& indices, const LocalTraining& options,
                           uint64_t seed, const parallel::LossFn& loss = parallel::cross_entropy,
                           const std::function<bool()>& keep_going = nullptr,
                           const at::Tensor& correction = at::Tensor());

/// The example-weighted mean of updates, summed in float64 whatever the updates' dtype.
class WeightedMean {
 public:
  /// Adds scale x update with weight `weight` (the sum grows by weight x scale x update, the
  /// total weight by weight: a scale < 1 discounts an update, as FedBuff's staleness does).
  void add(const at::Tensor& update, double weight, double scale = 1.0);
  /// The float64 sum (undefined when empty) and a sum restored (a resumed buffer).
  const at::Tensor& sum() const { return sum_; }
  void restore(at::Tensor sum, double weight, int64_t count);
  int64_t count() const { return count_; }
  double total_weight() const { return weight_; }
  /// The mean, in `dtype` (InputError-free: undefined when nothing was added).
  at::Tensor mean(at::ScalarType dtype) const;

 private:
  at::Tensor sum_;
  double weight_ = 0.0;
  int64_t count_ = 0;
};

struct ServerOptimizerSpec {
  /// "sgd" (FedAvg; with momentum > 0: FedAvgM) or "adam" (FedAdam).
  std::string name = "sgd";
  /// The server's rate on the averaged update (1 with sgd: the average becomes the model).
  double lr = 1.0;
  double momentum = 0.0;
  /// FedAdam: moments' decay and tau (its epsilon, the adaptivity's floor).
  double beta1 = 0.9, beta2 = 0.99, tau = 1e-3;
};

void validate(const ServerOptimizerSpec& spec);

/// Applies averaged updates to the global model; its state (momentum, Adam's moments) is part
/// of the server's checkpoint.
class ServerOptimizer {
 public:
  explicit ServerOptimizer(ServerOptimizerSpec spec);
  /// global += the step for `average` (an averaged update: a direction of descent).
  void step(at::Tensor& global, const at::Tensor& average);
  /// Named state tensors (empty for plain FedAvg), for checkpoints.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state);
  const ServerOptimizerSpec& spec() const { return spec_; }

 private:
  ServerOptimizerSpec spec_;
  optim::FlatOptimizer flat_;
};

}  // namespace dtrain::services::federated
