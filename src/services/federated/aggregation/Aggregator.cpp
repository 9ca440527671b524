// The built-in aggregators and their registry. Each applies the round's weighted mean with a
// server optimizer (FedAvg: SGD at the server rate, the mean becomes the model at rate 1;
// FedAvgM: with momentum; FedAdam: Adam, Reddi et al. 2021); FedSGD and FedProx differ in the
// plan they give the clients (one full-batch epoch; the proximal term mu). The robust ones
// (Robust.h) replace the mean by a statistic of the individual updates, applied the same way.
#include "dtrain/services/federated/aggregation/Aggregator.h"

#include <algorithm>
#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/common/Registry.h"

namespace dtrain::services::federated {

namespace {

// The mean applied by a server optimizer.
class OptimizerAggregator : public Aggregator {
 public:
  OptimizerAggregator(std::string name, ServerOptimizerSpec spec)
      : name_(std::move(name)), optimizer_(std::move(spec)) {}
  std::string name() const override { return name_; }
  void aggregate(at::Tensor& global, const RoundUpdates& round) override {
    optimizer_.step(global, round.mean);
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    return optimizer_.state();
  }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    optimizer_.load_state(state);
  }
  std::string state_kind() const override { return optimizer_.spec().name; }

 private:
  std::string name_;
  ServerOptimizer optimizer_;
};

// FedSGD (McMahan et al.'s baseline): one epoch of one full-batch step per round.
class FedSgd : public OptimizerAggregator {
 public:
  using OptimizerAggregator::OptimizerAggregator;
  LocalTraining configure(const LocalTraining& plan, int64_t round) const override {
    LocalTraining out = plan_for_round(plan, round);
    out.epochs = 1;
    out.batch = 0;
    return out;
  }
};

// FedProx (Li et al. 2020): local training adds mu/2 ||w - w_global||^2.
class FedProx : public OptimizerAggregator {
 public:
  using OptimizerAggregator::OptimizerAggregator;
  LocalTraining configure(const LocalTraining& plan, int64_t round) const override {
    DTRAIN_CHECK_INPUT(plan.prox_mu > 0,
                       "--algorithm fedprox needs its proximal weight: "
                       "--prox-mu > 0");
    return plan_for_round(plan, round);
  }
};

// A robust statistic of the individual updates (Robust.h) applied by the server optimizer.
class RobustAggregator : public OptimizerAggregator {
 public:
  using Statistic = std::function<at::Tensor(const std::vector<at::Tensor>&,
                                             const std::vector<double>&, const RobustSpec&)>;
  RobustAggregator(std::string name, const AggregatorOptions& options, Statistic statistic)
      : OptimizerAggregator(std::move(name), options.server),
        robust_(options.robust),
        statistic_(std::move(statistic)) {}
  bool needs_individual_updates() const override { return true; }
  void aggregate(at::Tensor& global, const RoundUpdates& round) override {
    std::vector<at::Tensor> deltas;
    std::vector<double> weights;
    for (const auto& update : round.updates) {
      deltas.push_back(update.delta);
      weights.push_back(update.weight);
    }
    RoundUpdates robust;
    robust.round = round.round;
    robust.mean = statistic_(deltas, weights, robust_);
    OptimizerAggregator::aggregate(global, robust);
  }

 private:
  RobustSpec robust_;
  Statistic statistic_;
};

// SCAFFOLD's server: the mean update applied by the server optimizer, c += sum(dc) / N.
class Scaffold : public OptimizerAggregator {
 public:
  Scaffold(const AggregatorOptions& options)
      : OptimizerAggregator("scaffold", options.server), option_(options.scaffold_option) {}
  bool needs_control_deltas() const override { return true; }
  LocalTraining configure(const LocalTraining& plan, int64_t round) const override {
    LocalTraining out = plan_for_round(plan, round);
    out.correction = "scaffold";
    out.scaffold_option = option_;
    return out;
  }
  at::Tensor client_control() const override { return control_; }
  void aggregate(at::Tensor& global, const RoundUpdates& round) override {
    if (!control_.defined()) control_ = at::zeros_like(global);
    OptimizerAggregator::aggregate(global, round);
    if (round.control_sum.defined()) {
      const auto n = static_cast<double>(std::max(round.population, round.participants));
      control_.add_((round.control_sum / n).to(control_.scalar_type()));
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    auto out = OptimizerAggregator::state();
    if (control_.defined()) out.emplace_back("scaffold.control", control_);
    return out;
  }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    std::vector<std::pair<std::string, at::Tensor>> rest;
    for (const auto& [name, tensor] : state) {
      if (name == "scaffold.control") {
        control_ = tensor.clone();
      } else {
        rest.emplace_back(name, tensor);
      }
    }
    OptimizerAggregator::load_state(rest);
  }
  std::string state_kind() const override { return "scaffold"; }

 private:
  int option_;
  at::Tensor control_;
};

// FedDyn's server (Acar et al. 2021): h <- h - alpha (P / N) mean, w <- w + mean - h / alpha.
class FedDyn : public Aggregator {
 public:
  explicit FedDyn(double alpha) : alpha_(alpha) {}
  std::string name() const override { return "feddyn"; }
  // Its state h moves by the share of the population in a round: rounds it must have.
  bool supports_buffered() const override { return false; }
  LocalTraining configure(const LocalTraining& plan, int64_t round) const override {
    DTRAIN_CHECK_INPUT(plan.prox_mu == 0,
                       "--algorithm feddyn sets the proximal weight itself "
                       "(--feddyn-alpha): leave out --prox-mu");
    LocalTraining out = plan_for_round(plan, round);
    out.correction = "feddyn";
    out.prox_mu = alpha_;
    return out;
  }
  void aggregate(at::Tensor& global, const RoundUpdates& round) override {
    if (!h_.defined()) h_ = at::zeros_like(global);
    const auto share = static_cast<double>(round.participants) /
                       static_cast<double>(std::max(round.population, round.participants));
    h_.sub_(round.mean, alpha_ * share);
    global.add_(round.mean).sub_(h_, 1.0 / alpha_);
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    if (!h_.defined()) return {};
    return {{"feddyn.h", h_}};
  }
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    for (const auto& [name, tensor] : state) {
      if (name == "feddyn.h") h_ = tensor.clone();
    }
  }

 private:
  double alpha_;
  at::Tensor h_;
};

// Krum's f for a round of n updates.
int64_t assumed_faulty(const RobustSpec& robust, size_t n) {
  return static_cast<int64_t>(std::floor(robust.assumed_faulty * static_cast<double>(n)));
}

AggregatorPtr robust(const char* name, const AggregatorOptions& options,
                     RobustAggregator::Statistic statistic) {
  validate(options.robust);
  return std::make_unique<RobustAggregator>(name, options, std::move(statistic));
}

ServerOptimizerSpec with_name(ServerOptimizerSpec spec, const char* name) {
  spec.name = name;
  return spec;
}

std::vector<AggregatorInfo> built_in() {
  return {
      {"fedavg", "FedAvg: the example-weighted mean of the updates (SGD at --server-lr)",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         DTRAIN_CHECK_INPUT(o.server.name == "sgd" && o.server.momentum == 0,
                            "--algorithm fedavg applies the mean with plain SGD: for --server-"
                            "optimizer adam use fedadam, for --server-momentum fedavgm");
         return std::make_unique<OptimizerAggregator>("fedavg", o.server);
       }},
      {"fedsgd", "FedSGD: one full-batch local step per round, averaged as FedAvg",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         return std::make_unique<FedSgd>("fedsgd", o.server);
       }},
      {"fedprox", "FedProx: FedAvg with the proximal term --prox-mu in local training",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         return std::make_unique<FedProx>("fedprox", o.server);
       }},
      {"fedavgm", "FedAvgM: the mean applied with server momentum (--server-momentum)",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         DTRAIN_CHECK_INPUT(o.server.momentum > 0,
                            "--algorithm fedavgm needs "
                            "--server-momentum > 0 (0.9 in Hsu et al. 2019)");
         return std::make_unique<OptimizerAggregator>("fedavgm", with_name(o.server, "sgd"));
       }},
      {"fedadam", "FedAdam: the mean applied by Adam on the server (Reddi et al. 2021)",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         return std::make_unique<OptimizerAggregator>("fedadam", with_name(o.server, "adam"));
       }},
      {"scaffold",
       "SCAFFOLD: control variates correct the clients' drift (Karimireddy et al. 2020; "
       "--scaffold-option)",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         DTRAIN_CHECK_INPUT(o.scaffold_option == 1 || o.scaffold_option == 2,
                            "--scaffold-option must be 1 or 2, got ", o.scaffold_option);
         return std::make_unique<Scaffold>(o);
       }},
      {"feddyn",
       "FedDyn: a dynamic regularizer aligns local and global optima (Acar et al. 2021; "
       "--feddyn-alpha)",
       [](const AggregatorOptions& o) -> AggregatorPtr {
         DTRAIN_CHECK_INPUT(o.feddyn_alpha > 0 && std::isfinite(o.feddyn_alpha),
                            "--feddyn-alpha must be > 0, got ", o.feddyn_alpha);
         DTRAIN_CHECK_INPUT(o.server.name == "sgd" && o.server.momentum == 0 && o.server.lr == 1,
                            "--algorithm feddyn applies its own server step: leave out "
                            "--server-optimizer, --server-lr and --server-momentum");
         return std::make_unique<FedDyn>(o.feddyn_alpha);
       }},
      {"median", "coordinate-wise median of the updates (Yin et al. 2018)",
       [](const AggregatorOptions& o) {
         return robust("median", o, [](const auto& u, const auto&, const RobustSpec&) {
           return coordinate_median(u);
         });
       }},
      {"trimmed-mean",
       "coordinate-wise mean without the --assumed-faulty fraction at each end (Yin et al. "
       "2018)",
       [](const AggregatorOptions& o) {
         return robust("trimmed-mean", o, [](const auto& u, const auto&, const RobustSpec& r) {
           return trimmed_mean(u, r.assumed_faulty);
         });
       }},
      {"krum",
       "the update nearest its n - f - 2 neighbours, f = --assumed-faulty x n (Blanchard et "
       "al. 2017)",
       [](const AggregatorOptions& o) {
         return robust("krum", o, [](const auto& u, const auto&, const RobustSpec& r) {
           return u[krum_select(u, assumed_faulty(r, u.size()), 1).front()];
         });
       }},
      {"multi-krum", "the example-weighted mean of Krum's n - f best updates",
       [](const AggregatorOptions& o) {
         return robust("multi-krum", o, [](const auto& u, const auto& w, const RobustSpec& r) {
           const int64_t f = assumed_faulty(r, u.size());
           WeightedMean mean;
           for (size_t i : krum_select(u, f, static_cast<int64_t>(u.size()) - f)) {
             mean.add(u[i], w[i]);
           }
           return mean.mean(u[0].scalar_type());
         });
       }},
      {"clipped-mean",
       "the example-weighted mean of the updates clipped to --update-clip (0: the round's "
       "median norm; Sun et al. 2019)",
       [](const AggregatorOptions& o) {
         return robust("clipped-mean", o, [](const auto& u, const auto& w, const RobustSpec& r) {
           return clipped_mean(u, w, r.update_clip);
         });
       }},
  };
}

Registry<AggregatorInfo>& registry() {
  static Registry<AggregatorInfo> all("aggregator", "--algorithm", built_in());
  return all;
}

}  // namespace

void register_aggregator(AggregatorInfo info) {
  DTRAIN_CHECK_INPUT(info.make, "register_aggregator: an aggregator needs a factory");
  registry().add(std::move(info));
}

std::vector<std::string> aggregator_names() { return registry().names(); }

AggregatorPtr make_aggregator(const std::string& name, const AggregatorOptions& options) {
  const AggregatorInfo& info = registry().at(name);
  validate(options.server);
  return info.make(options);
}

std::string resolve_algorithm(const std::string& algorithm, const AggregatorOptions& options,
                              const LocalTraining& plan) {
  if (algorithm != "fedavg") return algorithm;
  if (options.server.name == "adam") return "fedadam";
  if (options.server.momentum > 0) return "fedavgm";
  if (plan.prox_mu > 0) return "fedprox";
  return algorithm;
}

void check_combination(const Aggregator& aggregator, bool secure_aggregation, bool private_sum) {
  if (aggregator.needs_control_deltas()) {
    DTRAIN_CHECK_INPUT(!secure_aggregation && !private_sum, "--algorithm ", aggregator.name(),
                       " sums the clients' control-variate changes in the clear, which ",
                       secure_aggregation ? "--secure-aggregation" : "differential privacy",
                       " would not protect: use feddyn (its state stays on the clients) or "
                       "leave it out");
  }
  if (!aggregator.needs_individual_updates()) return;
  DTRAIN_CHECK_INPUT(!secure_aggregation, "--algorithm ", aggregator.name(),
                     " needs each client's update, and --secure-aggregation reveals only their "
                     "sum: use an aggregator of the mean (fedavg, fedsgd, fedprox, fedavgm, "
                     "fedadam) or leave out --secure-aggregation");
  DTRAIN_CHECK_INPUT(!private_sum, "--algorithm ", aggregator.name(),
                     " needs each client's update, and differential privacy (--dp-clip) noises "
                     "only their sum: an aggregate of individual updates would bypass the "
                     "noise");
}

}  // namespace dtrain::services::federated
