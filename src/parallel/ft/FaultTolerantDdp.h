// DDP whose replicas outlive each other (--fault-tolerance replicas; a replica is one rank or
// one tensor-parallel group, which fails and is replaced as one): each step's gradients,
// with the replica's loss and a one that counts it, are summed by the ReplicaManager over the
// replicas present and divided by their number. A replica that dies takes its share of the
// data with it from the step that failed on: the survivors' step is the mean over their own
// batches (the learning rate unchanged, as torchft does), so the global batch shrinks with the
// group. Rank 0 evaluates and checkpoints alone.
//
// A replacement (its launcher starts a failed replica's process again) joins at the end of a
// step: the first replica present sends it the weights, buffers and optimizer state, and the
// steps trained; it reads its own share of the data from the next step on, as before it failed.
#pragma once

#include <memory>

#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/ft/ReplicaMember.h"

namespace dtrain::parallel::ft {

class FaultTolerantDdp : public ddp::DdpStrategy, public ReplicaMemberStrategy {
 public:
  explicit FaultTolerantDdp(StrategyOptions options);
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  bool survives_replica_failures() const override { return true; }
  comm::CommunicatorPtr step_group() const override { return member_->manager().group(); }
  comm::CommunicatorPtr replica_group() const override { return grid_->tp(); }

 protected:
  /// No Reducer: the manager sums the gradients once backward is done.
  void build_gradient_sync(const std::vector<std::string>&) override {}
  /// A replacement takes the state from a replica present when it is admitted, not from rank 0.
  void broadcast_initial_state() override;
  /// Only the leading replica saves (alone), whichever it is.
  bool writes_replicated_state() const override { return true; }
  /// What a replacement receives: the parameters and buffers, the parameters' optimizer state.
  ReplicaState replica_state() override;
  /// After backward: the gradients (and `result.loss`) become the mean over the replicas
  /// present; sets the "replicas" metric.
  virtual void sum_gradients(StepResult& result);
};

}  // namespace dtrain::parallel::ft
