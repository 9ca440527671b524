// The federated server's aggregation seam, after Flower's Strategy: an Aggregator configures
// each round's plan for the selected clients, aggregates the updates the server accepted into
// the new global model, and may evaluate it. FedAvg, FedSGD, FedProx, FedAvgM and FedAdam are
// the built-in means, median, trimmed-mean, krum, multi-krum and clipped-mean the robust ones
// (Robust.h); code outside the library registers its own with register_aggregator
// (tests/how_to_add_test.cpp adds the lower median).
//
// Secure aggregation (and differential privacy's noise on the sum) reveal only the round's
// weighted mean: an aggregator that needs each client's update says so, and combining it with
// --secure-aggregation or --dp-clip is an InputError before the first round.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/aggregation/Robust.h"

namespace dtrain::services::federated {

/// One accepted update (only for aggregators that need them).
struct WeightedUpdate {
  std::string client;
  at::Tensor delta;
  /// Its weight in the mean: the client's example count (1 with differential privacy).
  double weight = 0.0;
};

/// What a round hands the aggregator.
struct RoundUpdates {
  /// The round being closed (0-based).
  int64_t round = 0;
  /// The weighted mean of the accepted updates in the model's dtype (with differential
  /// privacy: their noised sum over the selected clients); the only thing secure aggregation
  /// reveals.
  at::Tensor mean;
  /// Each accepted update, in the order they arrived; empty unless
  /// needs_individual_updates().
  std::vector<WeightedUpdate> updates;
  /// SCAFFOLD: the sum (float64) of the accepted clients' control-variate changes; undefined
  /// unless needs_control_deltas().
  at::Tensor control_sum;
  /// The accepted updates, and the clients in the federation (N; RoundServerOptions).
  int64_t participants = 0, population = 0;
};

/// The aggregator and the flags it reads.
struct AggregatorOptions {
  /// --algorithm: fedavg, fedsgd, fedprox, fedavgm, fedadam, scaffold, feddyn, the robust ones
  /// or a registered one (resolve_algorithm maps the older spellings).
  std::string algorithm = "fedavg";
  /// The server optimizer applied to the aggregate (--server-optimizer, --server-lr, ...).
  ServerOptimizerSpec server;
  /// FedDyn's alpha (--feddyn-alpha) and SCAFFOLD's option (--scaffold-option).
  double feddyn_alpha = 0.01;
  int scaffold_option = 2;
  /// The robust aggregators' parameters (--assumed-faulty, --update-clip).
  RobustSpec robust;
};

class Aggregator {
 public:
  virtual ~Aggregator() = default;
  virtual std::string name() const = 0;
  /// Flower's configure_fit: the plan the selected clients train with in `round` (0-based),
  /// from the plan the flags give (its rate decayed by round). InputError when the plan does
  /// not suit the algorithm.
  virtual LocalTraining configure(const LocalTraining& plan, int64_t round) const {
    return plan_for_round(plan, round);
  }
  /// Whether it needs each client's update rather than their weighted mean.
  virtual bool needs_individual_updates() const { return false; }
  /// Whether clients send SCAFFOLD's control-variate changes with their updates (summed in the
  /// clear: refused with secure aggregation and differential privacy).
  virtual bool needs_control_deltas() const { return false; }
  /// Whether it can take updates as they come (FedBuff's buffered steps, each update of its own
  /// model version): false for a rule that assumes synchronous rounds, such as one that keeps
  /// drift state scaled by a round's participants (FedDyn) or a statistic over one round's
  /// updates; by default, rules that need neither each update nor control deltas can.
  virtual bool supports_buffered() const {
    return !needs_individual_updates() && !needs_control_deltas();
  }
  /// A flat tensor the selected clients receive with the model (SCAFFOLD's server control
  /// variate); undefined for none.
  virtual at::Tensor client_control() const { return at::Tensor(); }
  /// Flower's aggregate_fit: moves `global` (flat, the model's dtype) to the new model.
  virtual void aggregate(at::Tensor& global, const RoundUpdates& round) = 0;
  /// Flower's evaluate (optional): named figures of the new global model for the round's
  /// record ("" keys none).
  virtual std::map<std::string, double> evaluate(const at::Tensor& global, int64_t round) {
    (void)global;
    (void)round;
    return {};
  }
  /// State kept across rounds (a server optimizer's moments), saved in the server's
  /// checkpoint; `state_kind` names it there ("sgd", "adam", or the aggregator's name).
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const { return {}; }
  virtual void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) {
    (void)state;
  }
  virtual std::string state_kind() const { return name(); }
};

using AggregatorPtr = std::unique_ptr<Aggregator>;

struct AggregatorInfo {
  std::string name;
  /// One line for --help.
  std::string summary;
  std::function<AggregatorPtr(const AggregatorOptions&)> make;
};

/// Adds an aggregator (InputError when the name is taken); before any server starts.
void register_aggregator(AggregatorInfo info);
std::vector<std::string> aggregator_names();
/// InputError naming the registered ones for an unknown name.
AggregatorPtr make_aggregator(const std::string& name, const AggregatorOptions& options);

/// The aggregator `--algorithm` names, the older spellings kept: fedavg with --server-optimizer
/// adam is fedadam, with --server-momentum fedavgm, with --prox-mu fedprox.
std::string resolve_algorithm(const std::string& algorithm, const AggregatorOptions& options,
                              const LocalTraining& plan);

/// InputError when the aggregator needs individual updates (or control-variate changes) but the
/// round reveals only their (noised) mean: --secure-aggregation or differential privacy.
void check_combination(const Aggregator& aggregator, bool secure_aggregation, bool private_sum);

}  // namespace dtrain::services::federated
