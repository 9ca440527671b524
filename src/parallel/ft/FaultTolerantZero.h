// ZeRO-1/2 whose replicas outlive each other (--fault-tolerance replicas --replica-shards S:
// hybrid sharding, torchft's HSDP): each replica is S data-parallel ranks (x --tensor-parallel)
// that shard the optimizer state (zero2: and the gradients) among themselves; the replicas hold
// copies. Each step the Reducer reduce-scatters the gradients inside the replica; the shard at
// each position is then summed with the same shard of the other replicas present through the
// ReplicaManager (one decision per step for every position) and divided by their number; each
// rank updates its shard and the replica all-gathers the parameters. A rank that fails takes
// its replica out; a replacement replica's ranks each take the parameters and the shard's
// optimizer state from the leading replica's rank at their position.
#pragma once

#include <memory>

#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaMember.h"
#include "parallel/zero/ZeroStrategy.h"

namespace dtrain::parallel::ft {

class FaultTolerantZero : public zero::ZeroStrategy, public ReplicaMemberStrategy {
 public:
  FaultTolerantZero(StrategyOptions options, int stage);
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  bool survives_replica_failures() const override { return true; }
  comm::CommunicatorPtr step_group() const override { return member_->manager().group(); }
  comm::CommunicatorPtr replica_group() const override { return replica_; }

 protected:
  /// The ranks of this replica at this rank's tensor-parallel position (they shard the state).
  comm::CommunicatorPtr data_parallel_group() override;
  /// The replica group forms here; a replacement's state comes with its admission.
  void broadcast_initial_state() override;
  /// The shard's gradient summed over the replicas present, divided by their number.
  void after_gradient_sync(StepResult& result) override;
  /// The step's last backward starts each part's sum as soon as the replica has reduced it.
  void before_backward(bool last) override { summing_ = last; }
  void configure_reducer(ddp::ReducerOptions& options) override;
  /// What a replacement receives: the parameters (whole) and buffers, the shard's optimizer
  /// state (the gathers in flight waited first).
  ReplicaState replica_state() override;

 private:
  /// A part of the gradient shard reduced inside the replica: its sum over the replicas starts.
  void start_part(int64_t offset, int64_t length);

  int shards_ = 1;
  comm::CommunicatorPtr replica_;
  bool summing_ = false;
  at::Tensor before_;              // the shard as the replica reduced it (a retry's start)
  std::vector<at::Tensor> parts_;  // started this step, in order
  std::vector<comm::WorkPtr> part_works_;
};

}  // namespace dtrain::parallel::ft
