// The built-in aggregators and their registry. Each applies the round's weighted mean with a
// server optimizer (FedAvg: SGD at the server rate, the mean becomes the model at rate 1;
// FedAvgM: with momentum; FedAdam: Adam, Reddi et al. 2021); FedSGD and FedProx differ in the
// plan they give the clients (one full-batch epoch; the proximal term mu).
#include "dtrain/services/federated/Aggregator.h"

#include <algorithm>
#include <mutex>

#include "dtrain/common/Error.h"

namespace dtrain::federated {

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
  };
}

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<AggregatorInfo>& registry() {
  static std::vector<AggregatorInfo> all = built_in();
  return all;
}

}  // namespace

void register_aggregator(AggregatorInfo info) {
  DTRAIN_CHECK_INPUT(!info.name.empty() && info.make,
                     "register_aggregator: an aggregator needs a name and a factory");
  const auto names = aggregator_names();
  DTRAIN_CHECK_INPUT(std::find(names.begin(), names.end(), info.name) == names.end(),
                     "register_aggregator: an aggregator named '", info.name,
                     "' is registered already");
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(std::move(info));
}

std::vector<std::string> aggregator_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& info : registry()) names.push_back(info.name);
  return names;
}

AggregatorPtr make_aggregator(const std::string& name, const AggregatorOptions& options) {
  std::function<AggregatorPtr(const AggregatorOptions&)> make;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const auto& info : registry()) {
      if (info.name == name) make = info.make;
    }
  }
  if (!make) {
    std::string known;
    for (const auto& n : aggregator_names()) known += (known.empty() ? "" : ", ") + n;
    DTRAIN_THROW(InputError, "--algorithm '", name, "': unknown (available: ", known, ")");
  }
  validate(options.server);
  return make(options);
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

}  // namespace dtrain::federated
