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
  const std::string key = replica_key(replica);
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
                     "the other replicas': key/value heads that tensor-parallel ranks share "
                     "(--kv-heads below --tensor-parallel) keep zero1 from reduce-scattering; use "
                     "ddp, or a --tensor-parallel that divides --kv-heads");
  join_when_replacing(shards_ * grid_->tp_size());
}

ReplicaState FaultTolerantZero::replica_state() {
  materialize();  // a gather in flight writes into the parameters sent
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : model_.module->buffers()) state.values.push_back(b);
  state.add_optimizer(*optimizer_);
  return state;
}

void FaultTolerantZero::configure_reducer(ddp::ReducerOptions& options) {
  zero::ZeroStrategy::configure_reducer(options);
  options.on_shard_part = [this](int64_t offset, int64_t length) { start_part(offset, length); };
}

void FaultTolerantZero::start_part(int64_t offset, int64_t length) {
  if (!summing_) return;  // (zero2's earlier micro-batches: the shard still accumulates)
  const at::Tensor& shard = shard_gradient();
  if (!before_.defined()) before_ = at::empty_like(shard);
  at::Tensor part = shard.narrow(0, offset, length);
  before_.narrow(0, offset, length).copy_(part);
  parts_.push_back(part);
  part_works_.push_back(member_->manager().start(part));
}

void FaultTolerantZero::after_gradient_sync(StepResult& result) {
  trace::Span span("sync", "gradient shard sum over the replicas present");
  torch::NoGradGuard no_grad;
  summing_ = false;
  // Each part of the shard (the replica's mean over its ranks) is being summed with the other
  // replicas' since the replica reduced it, during backward; then this rank's loss and a one:
  // the sum counts the replicas in it. After a failure every part is summed again over the
  // others from what the replica had reduced.
  const at::Tensor& shard = shard_gradient();
  const double local_loss = result.loss;
  at::Tensor extra = at::tensor({local_loss, 1.0}, at::kDouble);
  std::vector<at::Tensor> parts = std::move(parts_);
  std::vector<comm::WorkPtr> works = std::move(part_works_);
  parts_.clear();
  part_works_.clear();
  DTRAIN_CHECK(!parts.empty() || shard.numel() == 0, name(),
               ": no part of the gradient shard was reduced this step");
  parts.push_back(extra);
  works.push_back(member_->manager().start(extra));
  member_->manager().sum(parts, std::move(works), [&] {
    shard.copy_(before_);
    extra[0] = local_loss;
    extra[1] = 1.0;
  });
  const double replicas = extra[1].item<double>();
  shard.div_(replicas);
  // The loss: the mean over the replicas present at this position, then over the replica's
  // shards (their ranks trained on rows of their own).
  at::Tensor loss = at::tensor({extra[0].item<double>() / replicas}, at::kDouble);
  comm_->allreduce(loss)->wait();
  result.loss = loss.item<double>() / comm_->size();
  result.metrics["replicas"] = replicas;
  result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
}

}  // namespace dtrain::parallel::ft
