#include "parallel/ft/FaultTolerantZero.h"

#include <torch/torch.h>

#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

FaultTolerantZero::FaultTolerantZero(StrategyOptions options, int stage)
    : zero::ZeroStrategy(std::move(options), stage),
      ReplicaMemberStrategy(options_, scaler_ != nullptr),
      shards_(options_.of<FaultToleranceOptions>().replica_shards) {}

comm::CommunicatorPtr FaultTolerantZero::data_parallel_group() {
  const comm::CommunicatorPtr& world = grid_->world();
  const int tp = grid_->tp_size();
  const int size = shards_ * tp;
  DTRAIN_CHECK_INPUT(
      grid_->pp_size() == 1 && !grid_->replicated_stages() && world->size() % size == 0,
      "--fault-tolerance replicas: ", world->size(),
      " ranks do not divide into replicas of --replica-shards ", shards_, " x --tensor-parallel ",
      tp, " (without a pipeline)");
  const int me = world->global_ranks()[world->rank()];
  const int replica = me / size;
  const int position = grid_->coordinates().tp;
  std::vector<int> shard_ranks, replica_ranks;
  for (int s = 0; s < shards_; ++s) shard_ranks.push_back(replica * size + s * tp + position);
  for (int r = 0; r < size; ++r) replica_ranks.push_back(replica * size + r);
  // A replacement replica's ranks, started again together, form their groups among themselves
  // under a key of their incarnation (the world never forms for them).
  const char* incarnation = std::getenv("DTRAIN_FT_REPLACEMENT");
  const std::string key = concat(incarnation != nullptr ? incarnation
                                 : replacement_         ? "replacement"
                                                        : "0",
                                 "/", replica);
  replica_ = world->regroup(replica_ranks, concat("ft/replica/", key), concat("replica ", replica));
  return world->regroup(shard_ranks, concat("ft/shards/", key, "/", position),
                        concat("shards[replica=", replica, ",tp=", position, "]"));
}

void FaultTolerantZero::broadcast_initial_state() {
  form_replica_group(grid_->world(), shards_ * grid_->tp_size());
  if (replacement_) return;
  // Every replica starts from rank 0's values (over the grid's data-parallel group, which the
  // first ranks formed).
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  for (auto& p : parameters_) works.push_back(grid_->dp()->broadcast(p, {0}));
  for (auto& b : model_.module->buffers()) works.push_back(grid_->dp()->broadcast(b, {0}));
  comm::wait_all(works);
}

void FaultTolerantZero::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                              std::shared_ptr<comm::ProcessGrid> grid) {
  zero::ZeroStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  DTRAIN_CHECK_INPUT(shard_gradient().defined(), name(),
                     " with --fault-tolerance replicas sums each replica's gradient shard with "
                     "the other replicas': tensor parallelism's partial sums (--sequence-parallel, "
                     "--kv-heads below --tensor-parallel) keep zero1 from reduce-scattering; use "
                     "ddp or zero2 without them");
  join_when_replacing(shards_ * grid_->tp_size());
}

ReplicaState FaultTolerantZero::replica_state() {
  materialize();  // a gather in flight writes into the parameters sent
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : model_.module->buffers()) state.values.push_back(b);
  for (const auto& group : optimizer_->param_groups()) {
    for (const auto& p : group.params()) state.optimized.push_back(p);
  }
  state.optimizer = optimizer_.get();
  return state;
}

void FaultTolerantZero::after_gradient_sync(StepResult& result) {
  trace::Span span("sync", "gradient shard sum over the replicas present");
  torch::NoGradGuard no_grad;
  // The shard (the replica's mean over its ranks), then this rank's loss and a one: the sum
  // counts the replicas in it. Filled from the shard, which stays as the Reducer left it until
  // the sum commits (a sum taken again after a failure starts from it).
  const at::Tensor& shard = shard_gradient();
  const int64_t n = shard.numel();
  at::Tensor flat = at::empty({n + 2}, shard.options());
  const double local_loss = result.loss;
  auto fill = [&shard, n, local_loss](at::Tensor& out) {
    out.narrow(0, 0, n).copy_(shard);
    out[-2].fill_(local_loss);
    out[-1].fill_(1.0);
  };
  fill(flat);
  member_->manager().allreduce(flat, fill);
  const double replicas = flat[-1].item<double>();
  shard.copy_(flat.narrow(0, 0, n).div_(replicas));
  // The loss: the mean over the replicas present at this position, then over the replica's
  // shards (their ranks trained on rows of their own).
  at::Tensor loss = at::tensor({flat[-2].item<double>() / replicas}, at::kDouble);
  comm_->allreduce(loss)->wait();
  result.loss = loss.item<double>() / comm_->size();
  result.metrics["replicas"] = replicas;
  result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
}

}  // namespace dtrain::parallel::ft
