// DiLoCo whose islands outlive each other (--strategy diloco --fault-tolerance replicas; torchft's
// fault-tolerant DiLoCo): each island is a replica (--island-size ranks, which fail and are
// replaced as one). Between outer steps the islands do not talk to each other; at an outer step
// the ranks at each place of the islands present sum their slice of the outer gradient with a one
// that counts the islands through the ReplicaManager (one decision per outer step for every
// place), and divide by the count. An island that dies takes its outer gradient with it: the
// outer step is the mean over the islands present (the outer learning rate unchanged). A
// replacement island is admitted at the end of an outer step and takes from the leading island's
// rank at its place: the island's parameters and buffers, the outer parameters, the inner and
// the outer optimizer's state and the step counters; it reads its own share of the data from the
// next step on.
#pragma once

#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/diloco/DilocoStrategy.h"
#include "parallel/ft/ReplicaMember.h"

namespace dtrain::parallel::ft {

class FaultTolerantDiloco : public diloco::DilocoStrategy, public ReplicaMemberStrategy {
 public:
  explicit FaultTolerantDiloco(StrategyOptions options);
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  /// The island's step, its loss the island's mean (each island reports its own: no step
  /// waits on the other islands).
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  bool survives_replica_failures() const override { return true; }
  comm::CommunicatorPtr replica_group() const override { return island_; }

 protected:
  /// The islands form with regroup (a replacement island among its own new ranks), the replica
  /// group over the world; every island starts from rank 0's model, a replacement from the
  /// state it is sent.
  void form_islands(Model& model) override;
  /// The mean over the islands present (ReplicaManager), done before it returns.
  comm::WorkPtr average_over_islands(const at::Tensor& slice) override;
  bool crosses_islands() const override { return true; }
  /// The leading island saves alone, as island 0 of a checkpoint of one island: every island
  /// resumes from the outer parameters with its inner optimizer's state.
  SaveRole save_role() const override;
  ReplicaState replica_state() override;

 private:
  at::Tensor counters_;  // what replica_state() sends of the step counters
  double present_ = 0;   // islands in the last outer step
};

}  // namespace dtrain::parallel::ft
