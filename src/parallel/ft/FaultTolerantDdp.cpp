#include "parallel/ft/FaultTolerantDdp.h"

#include <torch/torch.h>

#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/common/Trace.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

namespace {

void declare_flags(FlagSet& flags, FaultToleranceOptions& o) {
  flags.add("--fault-tolerance", o.mode,
            "ddp: none (a failed rank stops the job; --max-restarts restarts every rank from "
            "the newest checkpoint) or replicas (the other replicas go on without it at once, "
            "its share of the data dropped; --nproc or dtrain launch)");
}

void check_flags(const FaultToleranceOptions& o) {
  DTRAIN_CHECK_INPUT(o.mode == "none" || o.mode == "replicas",
                     "--fault-tolerance must be none or replicas, got '", o.mode, "'");
}

}  // namespace

OptionGroup fault_tolerance_options() {
  return option_group<FaultToleranceOptions>("fault-tolerance", declare_flags, check_flags);
}

void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout) {
  if (!options.of<FaultToleranceOptions>().replicas()) return;
  DTRAIN_CHECK_INPUT(layout.pipeline_parallel == 1 && layout.tensor_parallel == 1 &&
                         layout.stage_replicas.empty(),
                     "--fault-tolerance replicas: each replica is one rank for now (ddp without "
                     "--pipeline-parallel, --stage-replicas or --tensor-parallel)");
  DTRAIN_CHECK_INPUT(!layout.defer_eval,
                     "--fault-tolerance replicas evaluates on rank 0 alone: leave out --defer-eval");
}

FaultTolerantDdp::FaultTolerantDdp(StrategyOptions options) : DdpStrategy(std::move(options)) {
  DTRAIN_CHECK_INPUT(scaler_ == nullptr,
                     "--fault-tolerance replicas with loss scaling (fp16-mixed) is not built: use "
                     "bf16-mixed or fp32, or --loss-scaling none");
  DTRAIN_CHECK_INPUT(!options_.hierarchical_allreduce && options_.grad_compression == "none",
                     "--fault-tolerance replicas sums full-precision gradients over one group: "
                     "leave out --hierarchical-allreduce and --grad-compression");
}

void FaultTolerantDdp::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  DdpStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  DTRAIN_CHECK_INPUT(grid_->tp_size() == 1 && grid_->pp_size() == 1,
                     "--fault-tolerance replicas: each replica is one rank for now");
  // Under a launcher that stops every rank when one fails, nothing would be left to go on.
  DTRAIN_CHECK_INPUT(std::getenv("DTRAIN_AGENT_STORE") == nullptr ||
                         std::getenv("DTRAIN_TOLERATE_FAILURES") != nullptr,
                     "--fault-tolerance replicas under dtrain launch needs the launcher's "
                     "--tolerate-failures (dtrain train --nproc sets it)");
  manager_ = std::make_unique<ReplicaManager>(grid_->world());
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
    torch::NoGradGuard no_grad;
    // Every gradient, then this replica's loss and a one: the sum counts the replicas in it.
    // Filled from the gradients, which stay as backward left them until the sum commits (a sum
    // taken again after a failure starts from them).
    int64_t total = 0;
    for (const auto& p : parameters_) total += p.numel();
    at::Tensor flat = at::empty({total + 2}, parameters_.front().options());
    const double local_loss = result.loss;
    auto fill = [this, local_loss](at::Tensor& out) {
      int64_t offset = 0;
      for (const auto& p : parameters_) {
        at::Tensor part = out.narrow(0, offset, p.numel());
        if (p.grad().defined()) {
          part.copy_(p.grad().reshape({-1}));
        } else {
          part.zero_();
        }
        offset += p.numel();
      }
      out[-2].fill_(local_loss);
      out[-1].fill_(1.0);
    };
    fill(flat);
    manager_->allreduce(flat, fill);
    const double replicas = flat[-1].item<double>();
    flat.div_(replicas);
    int64_t offset = 0;
    for (auto& p : parameters_) {
      const at::Tensor mean = flat.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(mean);
      } else {
        p.mutable_grad() = mean.clone();
      }
      offset += p.numel();
    }
    result.loss = flat[-2].item<double>();
    result.metrics["replicas"] = replicas;
    result.metrics["regroupings"] = static_cast<double>(manager_->regroupings());
  }
  trace::Span span("optimizer", "step");
  if (options_.max_grad_norm > 0) result.grad_norm = clip_gradients(options_.max_grad_norm);
  apply_update();
  result.metrics["step_skipped"] = 0.0;
  return result;
}

}  // namespace dtrain::parallel::ft
