// What the parameter-server strategies (Downpour, Sandblaster) share: each rank is a worker
// holding a replica of the whole model, its parameters in flat order (float32, or float64 for
// exact comparisons: the shards keep the model's dtype), a client of every shard, and checkpoints
// of the shards' parameters written by one rank alone.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/parallel/ps/PsOptions.h"

namespace dtrain::parallel::ps {

/// A parameter-server strategy's registry entry: the shards' connection flags (--ps,
/// --ps-timeout-ms, ...: one group both strategies share) and `own`, and the layout rule of
/// whole-model replicas (no pipeline or tensor parallelism).
StrategyInfo replica_strategy(const std::string& name, const std::string& summary, Loop loop,
                              OptionGroup own,
                              std::function<StrategyPtr(const StrategyOptions&)> make);

class ReplicaStrategy : public Strategy {
 public:
  explicit ReplicaStrategy(StrategyOptions options)
      : options_(std::move(options)), ps_(options_.of<PsOptions>()) {}
  Model& model() override { return model_; }
  /// A local optimizer over the replica's parameters, kept for the Strategy interface: the
  /// shards make the updates (learning rates set on this one have no effect).
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  /// The replica's parameters; the shards take them at the start unless they hold some.
  void load(const std::string& directory) override;

 protected:
  /// The checks every parameter-server strategy makes (shards given, fp32, no pipeline or
  /// tensor parallelism, parameters all float32 or all float64), then takes the model and connects
  /// to the shards.
  void setup_replica(Model model, const optim::OptimizerFactory& make_optimizer,
                     std::shared_ptr<comm::ProcessGrid> grid);
  at::Tensor flat_parameters() const;
  void set_parameters(const at::Tensor& flat);
  /// Writes the replica's parameters (and buffers) as a one-file checkpoint.
  void write_replica(const std::string& directory) const;
  std::vector<PieceRef> pieces() const;
  NamedTensors buffers() const;

  StrategyOptions options_;
  PsOptions ps_;
  Model model_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;
  optim::OptimizerPtr optimizer_;
  std::unique_ptr<PsClient> client_;
  int64_t numel_ = 0;
  at::ScalarType dtype_ = at::kFloat;  // of every parameter
};

}  // namespace dtrain::parallel::ps
