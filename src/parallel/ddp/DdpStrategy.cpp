// DDP: broadcast initial state from rank 0, accumulate locally for k-1 micro-batches, reduce
// on the last, clip, step.
#include "parallel/ddp/DdpStrategy.h"

#include <torch/torch.h>

#include <iostream>

#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "parallel/StrategySupport.h"
#include "parallel/ft/FaultToleranceFlags.h"
#include "parallel/ft/FaultTolerantDdp.h"

namespace dtrain::parallel::ddp {

StrategyInfo ddp_strategy() {
  StrategyInfo info;
  info.name = "ddp";
  info.summary = "data parallelism: bucketed gradient all-reduce overlapped with backward";
  info.pipeline_stages = true;
  info.cost.traffic = StepCost::Traffic::kAllReduce;
  info.options = {ft::fault_tolerance_options()};
  info.fault_tolerant = true;
  info.master_weights = true;
  info.expert_parallel = true;
  info.context_parallel = true;
  info.check_layout = ft::check_fault_tolerance_layout;
  info.make = [](const StrategyOptions& options) -> StrategyPtr {
    if (options.of<ft::FaultToleranceOptions>().replicas()) {
      return std::make_unique<ft::FaultTolerantDdp>(options);
    }
    return std::make_unique<DdpStrategy>(options);
  };
  return info;
}

DdpStrategy::DdpStrategy(StrategyOptions options) : options_(std::move(options)) {
  reducer_options_from(options_);  // validate early
  precision_ = precision::parse_precision(options_.precision);
  device_ = parse_device(options_.device);
  precision::check_supported(precision_, device_);
  scaler_ = make_loss_scaler(options_, precision_);
}

void DdpStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                        std::shared_ptr<comm::ProcessGrid> grid) {
  model_ = std::move(model);
  grid_ = std::move(grid);
  comm_ = data_parallel_group();
  if (precision_ == precision::Precision::Bf16) model_.module->to(at::kBFloat16);
  for (const auto& item : model_.module->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    parameters_.push_back(item.value());
    names_.push_back(item.key());
  }
  DTRAIN_CHECK_INPUT(!parameters_.empty(), "model has no trainable parameters");
  tp_ = tensor_parallel_layout(*model_.module, *grid_);
  // Expert parallelism: this rank's experts are blocks no other rank of its expert group holds.
  expert_ = tp_.expert_flags(names_);
  DTRAIN_CHECK(!has_experts() || grid_->ep_size() > 1,
               "the model's experts are split over ranks but the grid has no expert groups "
               "(ProcessGrid::split_experts)");
  DTRAIN_CHECK_INPUT(tp_.partial.empty() || !gradients_sharded() || sums_partial_first(), name(),
                     " shards the gradients that sequence parallelism (and --qk-norm's head "
                     "norms) sum over the tensor-parallel group first; use ddp, zero1 or zero2 "
                     "(or leave out --sequence-parallel)");
  DTRAIN_CHECK_INPUT(!tp_.has_shared_blocks() || !gradients_sharded(), name(),
                     " shards the gradients of key/value heads that tensor-parallel ranks share "
                     "(--kv-heads below --tensor-parallel) and sum first; use ddp or zero1, or "
                     "a --tensor-parallel that divides --kv-heads");
  broadcast_initial_state();
  // bf16-master: the fp32 values stay as the master weights; the model computes in bf16.
  initial_master_ = keep_master_weights(*model_.module, parameters_, precision_);
  build_optimizer(make_optimizer);
  initial_master_.clear();
  build_gradient_sync(names_);
}

void DdpStrategy::broadcast_initial_state() {
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  // Placeholders (Model::deferred) are drawn from their names, the same on every rank.
  if (!model_.deferred || !model_.deferred->pending()) {
    // An expert block goes to the ranks holding the same experts (its expert data-parallel
    // group), everything else to every replica.
    for (size_t k = 0; k < parameters_.size(); ++k) {
      const comm::CommunicatorPtr& group = is_expert(k) ? grid_->edp() : comm_;
      if (group->size() > 1) works.push_back(group->broadcast(parameters_[k], {0}));
    }
  }
  for (auto& b : model_.module->buffers()) works.push_back(comm_->broadcast(b, {0}));
  comm::wait_all(works);
}

void DdpStrategy::build_gradient_sync(const std::vector<std::string>& names) {
  ReducerOptions reducer_options = reducer_options_from(options_);
  // bf16-master: gradients accumulate and are reduced in fp32 (Megatron's default for bf16).
  if (precision::has_master_weights(precision_)) reducer_options.grad_dtype = at::kFloat;
  configure_reducer(reducer_options);
  if (!has_experts()) {
    reducer_ = std::make_unique<Reducer>(parameters_, names, comm_, reducer_options);
    return;
  }
  // The experts' gradients are reduced over their own group after backward
  // (reduce_expert_gradients); the Reducer takes the rest.
  std::vector<at::Tensor> dense;
  std::vector<std::string> dense_names;
  reducer_index_.assign(parameters_.size(), SIZE_MAX);
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (is_expert(k)) continue;
    reducer_index_[k] = dense.size();
    dense.push_back(parameters_[k]);
    dense_names.push_back(names[k]);
  }
  reducer_ = std::make_unique<Reducer>(dense, dense_names, comm_, reducer_options);
}

bool DdpStrategy::has_experts() const {
  return std::find(expert_.begin(), expert_.end(), true) != expert_.end();
}

void DdpStrategy::zero_expert_gradients() {
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (is_expert(k)) parameters_[k].mutable_grad().reset();
  }
}

void DdpStrategy::reduce_expert_gradients(bool sum_partial) {
  std::vector<at::Tensor> experts;
  std::vector<std::string> names;
  torch::NoGradGuard no_grad;
  expert_gradients_.clear();
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (!is_expert(k)) continue;
    if (!precision::has_master_weights(precision_)) {
      experts.push_back(parameters_[k]);
    } else {
      // bf16-master: the master's fp32 gradient (ddp's master_, or ZeRO's shards' master pieces,
      // which take expert_gradients_), from the model's bf16 one, reduced in fp32 as the
      // Reducer reduces the rest.
      const at::Tensor& grad = parameters_[k].grad();
      experts.push_back(gradient_holder(
          master_.empty() ? at::Tensor() : master_[k],
          grad.defined()
              ? grad.to(at::kFloat)
              : at::zeros(parameters_[k].sizes(), parameters_[k].options().dtype(at::kFloat))));
      parameters_[k].mutable_grad().reset();
    }
    names.push_back(names_[k]);
  }
  // (Sequence parallelism: the Reducer summed the dense parameters' partial gradients over the
  // TP group; the experts bypass it.)
  if (sum_partial && !experts.empty()) tp_.sum_partial_gradients(experts, names);
  parallel::reduce_expert_gradients(experts, grid_->edp(), comm_->size());
  // (after it: a gradient no token reached is made there)
  for (const auto& e : experts) expert_gradients_.push_back(e.grad());
}

void DdpStrategy::broadcast_buffers() {
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  for (auto& b : model_.module->buffers()) works.push_back(comm_->broadcast(b, {0}));
  comm::wait_all(works);
}

StepResult DdpStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                   const LossFn& loss) {
  DTRAIN_CHECK(!micro_batches.empty(), "train_step needs at least one micro-batch");
  model_.module->train();
  GradientSync& sync_engine = gradient_sync();
  sync_engine.zero_grad();
  if (!syncs_expert_gradients()) zero_expert_gradients();
  if (options_.broadcast_buffers && comm_->size() > 1) broadcast_buffers();
  StepResult result;
  const auto count = static_cast<double>(micro_batches.size());
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const bool last = i + 1 == micro_batches.size();
    const bool sync = last || reduce_every_micro_batch();
    sync_engine.set_sync(sync);
    if (sync) sync_engine.prepare_for_backward();
    const auto& batch = micro_batches[i];
    const at::Tensor value = micro_batch_loss(batch, loss, i);
    at::Tensor objective = micro_batches.size() == 1 ? value : value / count;
    if (scaler_) objective = scaler_->scale(objective);
    before_backward(last);
    {
      trace::Span span("backward", concat("B", i));
      objective.backward();
    }
    result.loss += value.item<double>() / count;
    result.samples += batch.inputs.size(0);
    if (sync && !last) sync_engine.finalize();
  }
  {
    trace::Span span("sync", "gradient reduction");
    sync_engine.finalize();
    // bf16-master: the experts' fp32 gradients are made (and their partial sums taken) by
    // reduce_expert_gradients.
    const bool experts_later =
        precision::has_master_weights(precision_) && has_experts() && !syncs_expert_gradients();
    if (!sync_engine.sums_partial_gradients()) {
      std::vector<at::Tensor> holders = reduced_gradient_holders();
      std::vector<std::string> names = names_;
      if (experts_later) {
        size_t kept = 0;
        for (size_t k = 0; k < holders.size(); ++k) {
          if (is_expert(k)) continue;
          holders[kept] = holders[k];
          names[kept++] = names[k];
        }
        holders.resize(kept);
        names.resize(kept);
      }
      tp_.sum_partial_gradients(holders, names);
    }
    if (!syncs_expert_gradients()) {
      reduce_expert_gradients(sync_engine.sums_partial_gradients() || experts_later);
    }
    after_gradient_sync(result);
  }
  const auto& stats = sync_engine.stats();
  if (!stats.unused_parameters.empty() && !warned_unused_ && comm_->rank() == 0) {
    std::cerr << "dtrain: warning: " << stats.unused_parameters.size()
              << " parameter(s) got no gradient (first: " << stats.unused_parameters.front()
              << "); their gradient is taken as zero\n";
    warned_unused_ = true;
  }
  bool skip = false;
  if (scaler_) {
    // The same decision on every rank (a TP rank's blocks can overflow alone).
    skip = scaler_->unscale_and_check(gradient_holders(), grid_->world());
    scaler_->update(skip);
    result.metrics["loss_scale"] = scaler_->scale_value();
    result.metrics["skipped_steps"] = static_cast<double>(scaler_->skipped_steps());
  }
  result.metrics["step_skipped"] = skip ? 1.0 : 0.0;
  if (!skip) {
    trace::Span span("optimizer", "step");
    if (options_.max_grad_norm > 0) result.grad_norm = clip_gradients(options_.max_grad_norm);
    apply_update();
  }
  result.metrics["exposed_comm_ms"] = stats.exposed_comm_ms;
  result.metrics["buckets_overlapped"] =
      static_cast<double>(stats.buckets_launched_during_backward);
  if (stats.peak_transient_bytes > 0) {
    result.metrics["peak_transient_mb"] =
        static_cast<double>(stats.peak_transient_bytes) / (1 << 20);
  }
  return result;
}

at::Tensor DdpStrategy::micro_batch_loss(const data::Batch& batch, const LossFn& loss,
                                         size_t index) {
  trace::Span span("forward", concat("F", index));
  precision::AutocastScope autocast(precision_, device_.type());
  const at::Tensor output = model_.forward(model_input(batch.inputs));
  // bf16-master: the loss in fp32 from bf16 logits (as Megatron's cross-entropy).
  return loss(precision::has_master_weights(precision_) && output.is_floating_point()
                  ? output.to(at::kFloat)
                  : output,
              batch.targets);
}

at::Tensor DdpStrategy::model_input(const at::Tensor& inputs) const {
  // A bf16 model takes bf16 inputs; other models take what they are given (float64 oracles).
  const auto dtype = precision::parameter_dtype(precision_);
  return dtype != at::kFloat && inputs.is_floating_point() ? inputs.to(dtype) : inputs;
}

at::Tensor DdpStrategy::evaluate_forward(const at::Tensor& inputs) {
  const at::Tensor output = model()(model_input(inputs));
  return output.scalar_type() == at::kBFloat16 ? output.to(at::kFloat) : output;
}

std::vector<at::Tensor> DdpStrategy::reduced_gradient_holders() const {
  const bool converted =
      precision::has_master_weights(precision_) && reducer_ && !reducer_->reduce_scatters();
  if (!converted) return parameters_;
  std::vector<at::Tensor> holders;
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (is_expert(k)) {  // (reduce_expert_gradients gave the master its fp32 gradient)
      holders.push_back(master_.empty() ? parameters_[k] : master_[k]);
      continue;
    }
    holders.push_back(gradient_holder(master_.empty() ? at::Tensor() : master_[k],
                                      reducer_->main_grad(reducer_index(k))));
  }
  return holders;
}

std::vector<PieceRef> DdpStrategy::value_pieces() const {
  std::vector<PieceRef> pieces = whole_pieces(names_, parameters_);
  if (precision::has_master_weights(precision_)) {  // the master weights too, from the same file
    for (auto& piece : state_pieces()) pieces.push_back(std::move(piece));
  }
  return pieces;
}

double DdpStrategy::clip_gradients(double max_norm) {
  const auto holders = gradient_holders();
  // Sharded gradients: each DP rank holds part of them (its pieces, in state_pieces() order).
  // Tensor parallelism: each TP rank holds blocks of the split ones, and the replicated ones
  // count once.
  std::vector<std::string> names;
  if (gradients_sharded()) {
    for (const auto& piece : state_pieces()) names.push_back(piece.name);
  } else {
    names = names_;
  }
  std::vector<bool> counted = tp_.counted(names);
  // (Sharded: every data-parallel rank holds its own part of the experts as of the rest, all
  // summed over the data-parallel group.)
  const bool experts_apart = has_experts() && !gradients_sharded();
  if (experts_apart) {
    // Each expert group's ranks hold disjoint experts: their squares are summed over the group,
    // the rest counted by its first rank.
    for (size_t k = 0; k < counted.size(); ++k) {
      counted[k] = counted[k] && (is_expert(k) || grid_->ep_rank() == 0);
    }
  }
  return clip_by_global_norm(
      holders,
      {gradients_sharded() ? comm_ : nullptr, grid_->tp(), experts_apart ? grid_->ep() : nullptr},
      max_norm, counted);
}

void DdpStrategy::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  if (!initial_master_.empty()) {
    master_ = initial_master_;
    for (auto& m : master_) m.requires_grad_(true);
  }
  optimizer_ = make_optimizer(master_.empty() ? parameters_ : master_);
}

void DdpStrategy::apply_update() {
  // bf16-master: the master weights' gradients are the Reducer's fp32 slots (pointed again each
  // step: an optimizer's zero_grad may have reset them).
  if (!master_.empty()) reduced_gradient_holders();
  optimizer_->step();
  copy_weights(master_, parameters_);  // bf16-master: the update into the bf16 model
}

NamedTensors DdpStrategy::named_buffers() const {
  NamedTensors buffers;
  for (const auto& item : model_.module->named_buffers())
    buffers.emplace_back(item.key(), item.value());
  return buffers;
}

void DdpStrategy::save(const std::string& directory) {
  // One file per TP rank of each DP rank that writes; buffers and replicated parameters come
  // from TP rank 0.
  const bool leader = writes_replicated_state();
  const NamedTensors buffers = leader && tp_.rank == 0 ? named_buffers() : NamedTensors{};
  if (state_sharded()) {
    write_state_shard(directory, tp_.rank * comm_->size() + comm_->rank(), comm_->size() * tp_.size,
                      tp_.for_writing(state_pieces()), optimizer_.get(), buffers);
  } else if (has_experts()) {
    // The first expert group writes: one file per expert rank (and tensor-parallel rank), its
    // experts in each (from TP rank 0), the rest (and the buffers) in its first rank's.
    if (grid_->edp()->rank() == 0) {
      const int ep = grid_->ep_size(), rank = grid_->ep_rank();
      write_state_shard(directory, tp_.rank * ep + rank, tp_.size * ep,
                        tp_.for_expert_rank(tp_.for_writing(state_pieces()), rank),
                        optimizer_.get(), rank == 0 ? buffers : NamedTensors{});
    }
  } else if (leader) {  // replicas are identical; DP rank 0 writes them
    write_state_shard(directory, tp_.rank, tp_.size, tp_.for_writing(state_pieces()),
                      optimizer_.get(), buffers);
  }
  if (scaler_ && grid_->world()->rank() == 0) save_loss_scaler(*scaler_, directory);
}

void DdpStrategy::load(const std::string& directory) {
  const NamedTensors buffers = named_buffers();
  read_state_shards(directory, tp_.for_reading(value_pieces()), optimizer_.get(),
                    tp_.for_reading(state_pieces()), &buffers);
  if (scaler_) load_loss_scaler(*scaler_, directory);
}

void DdpStrategy::load_values(const std::string& directory) {
  const NamedTensors buffers = named_buffers();
  read_state_shards(directory, tp_.for_reading(value_pieces()), nullptr, {}, &buffers);
}

MemoryReport DdpStrategy::memory_report() const {
  MemoryReport report;
  for (const auto& p : parameters_) {
    report.parameter_bytes += p.numel() * p.element_size();
    // bf16-master: the gradients live in the Reducer's fp32 buckets.
    report.gradient_bytes += p.numel() * gradient_element_size(p, precision_);
  }
  for (const auto& m : master_) report.optimizer_bytes += m.numel() * m.element_size();
  report.optimizer_bytes += optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel::ddp
