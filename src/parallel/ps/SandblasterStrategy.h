// Sandblaster L-BFGS (DistBelief) as a strategy that runs its own loop: rank 0 hosts the
// coordinator (a WorkQueue served over gRPC, and an LbfgsCoordinator that drives L-BFGS on the
// parameter-server shards with vector commands), and every rank - rank 0 too - is a worker
// that asks for work units, computes a unit's loss and gradient at the shards' parameters and
// adds the gradient into the shards' "g", keyed so that only the first copy of a unit counts.
#pragma once

#include <map>
#include <memory>
#include <mutex>

#include "dtrain/parallel/Loops.h"
#include "dtrain/parallel/ps/WorkQueue.h"
#include "parallel/ps/ReplicaStrategy.h"

namespace dtrain::parallel::ps {

StrategyInfo sandblaster_strategy();

class SandblasterStrategy : public ReplicaStrategy, public DrivenLoop {
 public:
  explicit SandblasterStrategy(StrategyOptions options);
  ~SandblasterStrategy() override;
  std::string name() const override { return "sandblaster"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  /// Not collective: the shards' parameters (pulled now) as a one-file checkpoint.
  void save(const std::string& directory) override;
  MemoryReport memory_report() const override;
  int64_t run_loop(const LoopContext& context) override;
  std::map<std::string, double> run_metrics() override;
  std::string layout() const override;

 private:
  /// The worker loop (every rank): units until the coordinator says the run is over.
  void work(const LoopContext& context);
  /// Computes one unit's loss and gradient and adds the gradient into the shards' "g".
  /// Computes unit `unit` of evaluation `round`: examples [begin, end).
  double compute_unit(const LoopContext& context, int64_t round, int64_t unit, int64_t begin,
                      int64_t end);
  /// The coordinator (rank 0, its own thread): L-BFGS over the shards.
  void coordinate(const LoopContext& context);
  void pull_into_model();
  SandblasterOptions sb_;
  int rank_ = 0, workers_ = 1;
  int64_t units_ = 0;
  std::string coordinator_address_;
  // Rank 0: the queue and its server.
  std::unique_ptr<WorkQueue> queue_;
  std::unique_ptr<WorkQueueHost> server_;
  // The model is used by the worker (units) and, on rank 0, by the coordinator's iteration
  // callback (evaluation, checkpoints); recursive: save() inside the callback pulls again.
  std::recursive_mutex model_mutex_;
  int64_t model_round_ = 0;  // the round whose parameters the model holds (0: none / stale)
  int64_t iterations_ = 0;
  // Worker counters.
  int64_t units_done_ = 0, pushes_ignored_ = 0;
  // Rank 0: the run.
  std::string stop_reason_;
  double seconds_per_iteration_ = 0, seconds_per_evaluation_ = 0;
  int64_t evaluations_ = 0;
};

}  // namespace dtrain::parallel::ps
