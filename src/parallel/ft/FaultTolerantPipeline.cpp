#include "parallel/ft/FaultTolerantPipeline.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

void check_pipeline_replicas(const pipeline::PipelineOptions& o) {
  DTRAIN_CHECK_INPUT(o.data_parallel == "ddp",
                     "--fault-tolerance replicas with --pipeline-parallel: the replicas are ddp's "
                     "(--strategy ddp), not ",
                     o.data_parallel);
  DTRAIN_CHECK_INPUT(o.sync == "flush",
                     "--fault-tolerance replicas with --pipeline-parallel "
                     "commits whole steps: --pipeline-sync flush, not ",
                     o.sync);
  DTRAIN_CHECK_INPUT(o.balance != "time",
                     "--fault-tolerance replicas with --pipeline-parallel: --pipeline-balance time "
                     "measures on each replica, whose stages could then differ; use params or "
                     "counts");
}

FaultTolerantPipeline::FaultTolerantPipeline(StrategyOptions options)
    : PipelineStrategy(std::move(options)), ReplicaMemberStrategy(options_, scaler_ != nullptr) {
  check_pipeline_replicas(pipe_);
}

void FaultTolerantPipeline::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                                  std::shared_ptr<comm::ProcessGrid> grid) {
  const comm::CommunicatorPtr& world = grid->world();
  const int size = grid->pp_size() * grid->tp_size();
  DTRAIN_CHECK_INPUT(!grid->replicated_stages() &&
                         (grid->pp_size() == 1 || grid->order() == comm::GridOrder::kTpPpDp),
                     "--fault-tolerance replicas with a pipeline needs each replica's ranks "
                     "consecutive (comm::GridOrder::kTpPpDp; the Trainer lays them out so)");
  // The replica's own group (every stage and TP rank of it): the stage costs are agreed and the
  // leading replica checkpoints over it.
  const int replica = grid->coordinates().dp;
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(replica * size + r);
  replica_ = world->regroup(ranks, concat("ft/replica/", replica_key(replica)),
                            concat("replica ", replica));
  PipelineStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  // (broadcast_replica_state left a replacement's state to the admission.)
  join_when_replacing(size);
}

void FaultTolerantPipeline::broadcast_replica_state() {
  form_replica_group(grid_->world(), grid_->pp_size() * grid_->tp_size());
  if (!replacement_) PipelineStrategy::broadcast_replica_state();
}

void FaultTolerantPipeline::reduce_over_replicas(StepResult& result) {
  trace::Span span("sync", "gradient sum over the replicas present");
  const int replicas = mean_over_replicas(member_->manager(), parameters_, result.loss);
  result.metrics["replicas"] = replicas;
  result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
}

ReplicaState FaultTolerantPipeline::replica_state() {
  ReplicaState state;
  state.values = parameters_;
  for (const auto& [name, b] : local_buffers()) state.values.push_back(b);
  state.optimizers.push_back({optimizer_.get(), parameters_});
  return state;
}

}  // namespace dtrain::parallel::ft
