// DDP whose replicas outlive each other (--fault-tolerance replicas): each step's gradients,
// with the replica's loss and a one that counts it, are summed by the ReplicaManager over the
// replicas present and divided by their number. A replica that dies takes its share of the
// data with it from the step that failed on: the survivors' step is the mean over their own
// batches (the learning rate unchanged, as torchft does), so the global batch shrinks with the
// group. Rank 0 evaluates and checkpoints alone.
#pragma once

#include <memory>

#include "parallel/ddp/DdpStrategy.h"
#include "parallel/ft/ReplicaManager.h"

namespace dtrain::parallel::ft {

class FaultTolerantDdp : public ddp::DdpStrategy {
 public:
  explicit FaultTolerantDdp(StrategyOptions options);
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  bool survives_replica_failures() const override { return true; }
  comm::CommunicatorPtr step_group() const override { return manager_->group(); }

 protected:
  /// No Reducer: the manager sums the gradients once backward is done.
  void build_gradient_sync(const std::vector<std::string>&) override {}

 private:
  std::unique_ptr<ReplicaManager> manager_;
};

/// --fault-tolerance's flags and checks.
OptionGroup fault_tolerance_options();
/// InputError unless the layout is replicas of one rank each (no pipeline, no tensor
/// parallelism).
void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout);

}  // namespace dtrain::parallel::ft
