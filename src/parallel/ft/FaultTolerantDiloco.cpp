#include "parallel/ft/FaultTolerantDiloco.h"

#include <torch/torch.h>

#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

FaultTolerantDiloco::FaultTolerantDiloco(StrategyOptions options)
    : diloco::DilocoStrategy(std::move(options)),
      ReplicaMemberStrategy(options_, /*loss_scaled=*/false, /*sums_gradients=*/false) {
  // (A loss scaler is the inner strategy's, inside the island: the outer gradient is unscaled.)
  DTRAIN_CHECK_INPUT(
      diloco_.fragments == 1 && diloco_.overlap_steps == 0 && diloco_.outer_compression == "none",
      "--fault-tolerance replicas with diloco averages the whole outer gradient at "
      "once over the islands present: --streaming-fragments, --overlap-steps and "
      "--outer-compression are not built with it yet");
  DTRAIN_CHECK_INPUT(diloco_.island_size > 0,
                     "--fault-tolerance replicas with diloco: give --island-size (an island is "
                     "what fails and is replaced as one)");
}

void FaultTolerantDiloco::form_islands(Model& model) {
  const comm::CommunicatorPtr& world = grid_->world();
  const int size = island_size_of(world->size());
  const int me = world->global_ranks()[world->rank()];
  islands_ = world->size() / size;
  island_index_ = me / size;
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r) ranks.push_back(island_index_ * size + r);
  const std::string key = replica_key(island_index_);
  island_ = world->regroup(ranks, concat("ft/island/", key), concat("island ", island_index_));
  across_ = nullptr;
  form_replica_group(world, size);
  member_->manager().name_sums("outer step");
  if (replacement_) return;
  // Every island starts from rank 0's model (the world formed for the first ranks).
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  for (auto& p : model.module->parameters()) works.push_back(world->broadcast(p, {0}));
  for (auto& b : model.module->buffers()) works.push_back(world->broadcast(b, {0}));
  comm::wait_all(works);
}

void FaultTolerantDiloco::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                                std::shared_ptr<comm::ProcessGrid> grid) {
  diloco::DilocoStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  counters_ = counters();
  join_when_replacing(island_->size());
  if (replacement_ && joined_at_ != ReplaceableReplicas::kFinished) set_counters(counters_);
  present_ = static_cast<double>(member_->manager().members().size());
}

comm::WorkPtr FaultTolerantDiloco::average_over_islands(const at::Tensor& slice) {
  trace::Span span("sync", "outer gradient mean over the islands present");
  torch::NoGradGuard no_grad;
  // This rank's slice and a one: the sum counts the islands in it. The slice stays as it was
  // until the sum commits, so a sum taken again after a failure refills from it (no copy kept).
  const int64_t n = slice.numel();
  at::Tensor flat = at::empty({n + 1}, slice.options());
  auto fill = [&slice, n](at::Tensor& out) {
    out.narrow(0, 0, n).copy_(slice);
    out[n].fill_(1.0);
  };
  fill(flat);
  member_->manager().allreduce(flat, fill);
  present_ = flat[n].item<double>();
  slice.copy_(flat.narrow(0, 0, n).div_(present_));
  return nullptr;
}

StepResult FaultTolerantDiloco::train_step(const std::vector<data::Batch>& micro_batches,
                                           const LossFn& loss) {
  StepResult result = diloco::DilocoStrategy::train_step(micro_batches, loss);
  if (island_->size() > 1) {
    at::Tensor sum = at::tensor({result.loss}, at::kDouble);
    island_->allreduce(sum)->wait();
    result.loss = sum.item<double>() / island_->size();
  }
  result.metrics["replicas"] = present_;
  result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
  return result;
}

diloco::DilocoStrategy::SaveRole FaultTolerantDiloco::save_role() const {
  SaveRole role;
  role.leader = island_->rank() == 0;  // (only the leading island saves)
  role.island = 0;
  role.islands = 1;
  return role;
}

ReplicaState FaultTolerantDiloco::replica_state() {
  island_in_model();                     // an evaluation left the outer parameters in the model
  if (!sharded_) inner_->materialize();  // a parameter gather in flight writes into them
  counters_.copy_(counters());
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : inner_->model().module->buffers()) state.values.push_back(b);
  state.values.insert(state.values.end(), outer_.begin(), outer_.end());
  state.values.push_back(counters_);
  state.add_optimizer(inner_->optimizer());
  state.add_optimizer(*outer_optimizer_);
  return state;
}

}  // namespace dtrain::parallel::ft
