#include "parallel/pipeline/PipelineStrategy.h"

#include <torch/torch.h>

#include <unordered_map>
#include <unordered_set>

#include "dtrain/common/Error.h"
#include "dtrain/memory/Checkpoint.h"
#include "dtrain/optim/StateSize.h"
#include "parallel/pipeline/StageLink.h"

namespace dtrain::parallel::pipeline {

PipelineStrategy::PipelineStrategy(StrategyOptions options)
    : options_(std::move(options)), kind_(schedule_kind_named(options_.pipeline_schedule)) {
  DTRAIN_CHECK_INPUT(kind_ != ScheduleKind::Interleaved,
                     "the pipeline executor runs gpipe and 1f1b; interleaved is not available "
                     "yet");
  DTRAIN_CHECK_INPUT(options_.precision == "fp32", "pipeline parallelism runs fp32 for now, not ",
                     options_.precision);
}

PipelineStrategy::~PipelineStrategy() = default;

void PipelineStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  model_ = std::move(model);
  grid_ = std::move(grid);
  DTRAIN_CHECK_INPUT(!model_.stages.empty(),
                     "pipeline parallelism needs a model described as stages (Model::stages: "
                     "sequential_model() or the Zoo's models)");
  const int ranks = grid_->pp_size();
  std::vector<double> costs;
  for (const auto& stage : model_.stages) {
    double count = 0;
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) count += p.numel();
    }
    costs.push_back(count);
  }
  partition_ = options_.pipeline_balance == "params"
                   ? balanced_partition(costs, ranks)
                   : partition_from_counts(options_.pipeline_balance,
                                           static_cast<int>(costs.size()), ranks);
  const int me = grid_->coordinates().pp;
  stages_.assign(model_.stages.begin() + partition_.first(me),
                 model_.stages.begin() + partition_.end(me));

  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : model_.module->named_parameters()) {
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::unordered_set<const void*> seen;
  for (const auto& stage : stages_) {
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) {
        if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
        parameters_.push_back(p);
        const auto it = name_of.find(p.unsafeGetTensorImpl());
        names_.push_back(it == name_of.end() ? std::string("?") : it->second);
      }
    }
  }
  // Replicas of a stage start equal (as DDP's do).
  if (grid_->dp_size() > 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters_) grid_->dp()->broadcast(p, {0})->wait();
  }
  optimizer_ = make_optimizer(parameters_);
  link_ = std::make_unique<StageLink>(grid_->pp());
}

at::Tensor PipelineStrategy::run_stages(const at::Tensor& input) const {
  at::Tensor x = input;
  for (const auto& stage : stages_) {
    if (stage.checkpoint && torch::GradMode::is_enabled()) {
      std::vector<at::Tensor> params;
      for (const auto& module : stage.modules) {
        for (const auto& p : module->parameters()) params.push_back(p);
      }
      x = memory::checkpoint(stage.forward, x, params);
    } else {
      x = stage.forward(x);
    }
  }
  return x;
}

StepResult PipelineStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                        const LossFn& loss) {
  const int ranks = grid_->pp_size();
  const int me = grid_->coordinates().pp;
  const bool first = me == 0;
  const bool last = me == ranks - 1;
  const int count = static_cast<int>(micro_batches.size());
  const auto actions = build_schedule({kind_, ranks, count, 1}, me);
  for (auto& p : parameters_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }

  StepResult result;
  // Per micro-batch: the stage's input (for its gradient) and output (or the loss).
  std::map<int, std::pair<at::Tensor, at::Tensor>> kept;
  double loss_sum = 0;
  auto post_ahead = [&](const Action& a) {
    if (a.kind == Action::Forward && !first) link_->post_recv(StageLink::Activation, a.micro_batch);
    if (a.kind == Action::Backward && !last) link_->post_recv(StageLink::Gradient, a.micro_batch);
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    if (i + 1 < actions.size()) post_ahead(actions[i + 1]);
    const Action& a = actions[i];
    const data::Batch& batch = micro_batches[a.micro_batch];
    if (a.kind == Action::Forward) {
      at::Tensor x = first ? batch.inputs : link_->recv(StageLink::Activation, a.micro_batch);
      if (!first) x.requires_grad_(true);
      at::Tensor y = run_stages(x);
      if (last) {
        at::Tensor l = loss(y, batch.targets) / count;
        loss_sum += l.item<double>();
        kept[a.micro_batch] = {x, l};
      } else {
        link_->send(StageLink::Activation, a.micro_batch, y.detach());
        kept[a.micro_batch] = {x, y};
      }
      result.samples += batch.inputs.size(0);
    } else {
      auto node = kept.extract(a.micro_batch);
      DTRAIN_CHECK(!node.empty(), "pipeline stage ", me, ": backward of micro-batch ",
                   a.micro_batch, " before its forward");
      auto [x, y] = node.mapped();
      if (last) {
        y.backward();
      } else {
        y.backward(link_->recv(StageLink::Gradient, a.micro_batch));
      }
      if (!first) {
        at::Tensor g = x.grad();
        if (!g.defined()) g = at::zeros_like(x);
        link_->send(StageLink::Gradient, a.micro_batch, g);
      }
    }
  }
  link_->finish_sends();
  average_gradients_over_dp();
  result.grad_norm = clip_gradients();
  optimizer_->step();

  // The loss lives on the last stage: every rank reports it.
  at::Tensor reported = at::full({1}, last ? loss_sum : 0.0, at::kDouble);
  grid_->pp()->allreduce(reported)->wait();
  result.loss = reported.item<double>();
  return result;
}

void PipelineStrategy::average_gradients_over_dp() {
  std::vector<at::Tensor> grads;
  for (auto& p : parameters_) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad().reshape(-1));
  }
  if (grid_->dp_size() == 1 || grads.empty()) return;
  at::Tensor flat = at::cat(grads);
  grid_->dp()->allreduce(flat, {comm::ReduceOp::Avg})->wait();
  int64_t offset = 0;
  for (auto& p : parameters_) {
    const int64_t n = p.numel();
    p.mutable_grad().copy_(flat.narrow(0, offset, n).view_as(p));
    offset += n;
  }
}

double PipelineStrategy::clip_gradients() {
  if (options_.max_grad_norm <= 0) return -1.0;
  // Each stage's replicas hold equal (averaged) gradients: the norm sums over stages.
  at::Tensor square = at::zeros({1}, at::kDouble);
  for (auto& p : parameters_) square += p.grad().to(at::kDouble).pow(2).sum();
  grid_->pp()->allreduce(square)->wait();
  const double norm = std::sqrt(square.item<double>());
  const double coefficient = options_.max_grad_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    for (auto& p : parameters_) p.mutable_grad().mul_(coefficient);
  }
  return norm;
}

void PipelineStrategy::save(const std::string& directory) {
  DTRAIN_THROW(InputError, "pipeline checkpoints are not written yet (", directory, ")");
}

void PipelineStrategy::load(const std::string& directory) {
  DTRAIN_THROW(InputError, "pipeline checkpoints cannot be read yet (", directory, ")");
}

MemoryReport PipelineStrategy::memory_report() const {
  MemoryReport report;
  for (const auto& p : parameters_) {
    report.parameter_bytes += p.numel() * p.element_size();
    if (p.grad().defined()) report.gradient_bytes += p.grad().numel() * p.grad().element_size();
  }
  if (optimizer_) report.optimizer_bytes = optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel::pipeline
