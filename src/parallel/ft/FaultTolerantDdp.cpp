#include "parallel/ft/FaultTolerantDdp.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"

namespace dtrain::parallel::ft {

FaultTolerantDdp::FaultTolerantDdp(StrategyOptions options)
    : DdpStrategy(std::move(options)), ReplicaMemberStrategy(options_, scaler_ != nullptr) {}

void FaultTolerantDdp::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  DdpStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  DTRAIN_CHECK(grid_->pp_size() == 1 && !grid_->replicated_stages(),
               "FaultTolerantDdp: a pipeline's replicas are FaultTolerantPipeline's");
  // (broadcast_initial_state left a replacement's state to the admission.)
  join_when_replacing(grid_->tp_size());
}

void FaultTolerantDdp::broadcast_initial_state() {
  // The replica group forms here; a replacement's heartbeat runs while it waits to be admitted.
  form_replica_group(grid_->world(), grid_->tp_size());
  if (!replacement_) DdpStrategy::broadcast_initial_state();
}

ReplicaState FaultTolerantDdp::replica_state() {
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : model_.module->buffers()) state.values.push_back(b);
  state.optimizers.push_back({optimizer_.get(), parameters_});
  return state;
}

void FaultTolerantDdp::sum_gradients(StepResult& result) {
  const int replicas = mean_over_replicas(member_->manager(), parameters_, result.loss);
  // Sequence parallelism: what each TP rank holds of a replicated parameter's gradient is a
  // part; the replica's TP group sums them (as ddp does after its reduction).
  tp_.sum_partial_gradients(reduced_gradient_holders(), names_);
  result.metrics["replicas"] = replicas;
}

StepResult FaultTolerantDdp::train_step(const std::vector<data::Batch>& micro_batches,
                                        const LossFn& loss) {
  DTRAIN_CHECK(!micro_batches.empty(), "train_step needs at least one micro-batch");
  model_.module->train();
  for (auto& p : parameters_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  StepResult result;
  const auto count = static_cast<double>(micro_batches.size());
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const auto& batch = micro_batches[i];
    const at::Tensor value = micro_batch_loss(batch, loss, i);
    {
      trace::Span span("backward", concat("B", i));
      (micro_batches.size() == 1 ? value : value / count).backward();
    }
    result.loss += value.item<double>() / count;
    result.samples += batch.inputs.size(0);
  }
  {
    trace::Span span("sync", "gradient sum over the replicas present");
    sum_gradients(result);
    result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
  }
  trace::Span span("optimizer", "step");
  if (options_.max_grad_norm > 0) result.grad_norm = clip_gradients(options_.max_grad_norm);
  apply_update();
  result.metrics["step_skipped"] = 0.0;
  return result;
}

}  // namespace dtrain::parallel::ft
