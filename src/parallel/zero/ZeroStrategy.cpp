// ZeRO-1: the flat parameter buffer, the shard optimizer, and the allgather after each update.
#include "parallel/zero/ZeroStrategy.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "parallel/StrategySupport.h"
#include "parallel/ft/FaultToleranceFlags.h"
#include "parallel/ft/FaultTolerantDdp.h"
#include "parallel/ft/FaultTolerantShardedZero.h"
#include "parallel/ft/FaultTolerantZero.h"

namespace dtrain::parallel::zero {

namespace {

void declare_quantized_flags(FlagSet& flags, ZeroQuantizedOptions& o) {
  flags.add("--zero-quantized", o.enabled,
            "zero2, zero3: reduce-scatter gradients (zero3: and gather parameters) as int8 "
            "blocks with a float32 scale each, about 4x fewer bytes (ZeRO++'s qgZ, qwZ)");
  flags.add("--zero-quantized-block", o.block,
            "zero2, zero3: elements per scale of --zero-quantized");
}

void check_quantized(const ZeroQuantizedOptions& o) {
  DTRAIN_CHECK_INPUT(o.block >= 1, "--zero-quantized-block must be >= 1, got ", o.block);
}

void declare_overlap_flags(FlagSet& flags, ZeroOverlapOptions& o) {
  flags.add("--overlap-param-gather", o.param_gather,
            "zero1, zero2 (and a pipeline's zero1): leave each bucket's parameter all-gather "
            "running after the update; the next forward waits for a bucket only when it reaches "
            "its layers (Megatron's --overlap-param-gather)");
}

}  // namespace

OptionGroup zero_overlap_options() {
  return option_group<ZeroOverlapOptions>("zero-overlap", declare_overlap_flags);
}

OptionGroup zero_quantized_options() {
  return option_group<ZeroQuantizedOptions>("zero-quantized", declare_quantized_flags,
                                            check_quantized);
}

comm::BlockQuantization block_quantization(const StrategyOptions& options) {
  const auto& o = options.of<ZeroQuantizedOptions>();
  comm::BlockQuantization q;
  if (o.enabled) {
    q.block = o.block;
    q.identity = o.identity;
  }
  return q;
}

StrategyInfo zero1_strategy() {
  StrategyInfo info;
  info.name = "zero1";
  info.summary = "ZeRO stage 1: data parallelism with the optimizer state sharded";
  info.pipeline_stages = true;
  info.cost.traffic = StepCost::Traffic::kReduceScatterGather;
  info.cost.shards_optimizer = true;
  info.options = {zero_overlap_options(), ft::fault_tolerance_options()};
  info.master_weights = true;
  info.expert_parallel = true;
  info.context_parallel = true;
  info.fault_tolerant = true;
  info.check_layout = ft::check_fault_tolerance_layout;
  info.make = [](const StrategyOptions& options) -> StrategyPtr {
    const auto& ft = options.of<ft::FaultToleranceOptions>();
    if (ft.replicas() && ft.shard_across_replicas) {
      return std::make_unique<ft::FaultTolerantShardedZero>(options);
    }
    if (ft.replicas()) return std::make_unique<ft::FaultTolerantZero>(options, 1);
    return std::make_unique<ZeroStrategy>(options, 1);
  };
  return info;
}

void check_no_sequence_parallel(const std::string& strategy, const Layout& layout) {
  DTRAIN_CHECK_INPUT(!layout.sequence_parallel,
                     "--sequence-parallel sums LayerNorm gradients over the tensor-parallel "
                     "ranks before the data-parallel update: use --strategy ddp, zero1 or "
                     "zero2, not ",
                     strategy);
}

StrategyInfo zero2_strategy() {
  StrategyInfo info;
  info.name = "zero2";
  info.summary = "ZeRO stage 2: optimizer state and gradients sharded (reduce-scatter)";
  info.options = {zero_quantized_options(), zero_overlap_options(), ft::fault_tolerance_options()};
  info.cost.traffic = StepCost::Traffic::kReduceScatterGather;
  info.cost.shards_optimizer = true;
  info.cost.shards_gradients = true;
  info.cost.bucket_buffers = 2;  // the reduce-scatter's
  info.master_weights = true;
  info.expert_parallel = true;
  info.context_parallel = true;
  info.fault_tolerant = true;
  info.check_layout = ft::check_fault_tolerance_layout;
  info.make = [](const StrategyOptions& options) -> StrategyPtr {
    if (options.of<ft::FaultToleranceOptions>().replicas()) {
      return std::make_unique<ft::FaultTolerantZero>(options, 2);
    }
    return std::make_unique<ZeroStrategy>(options, 2);
  };
  return info;
}

ZeroStrategy::ZeroStrategy(StrategyOptions options, int stage)
    : ddp::DdpStrategy(std::move(options)), stage_(stage) {
  DTRAIN_CHECK(stage_ == 1 || stage_ == 2, "ZeroStrategy stage must be 1 or 2, got ", stage_);
  DTRAIN_CHECK_INPUT(stage_ >= 2 || !options_.of<ZeroQuantizedOptions>().enabled,
                     "--zero-quantized reduce-scatters gradients: it is for zero2 and zero3, not ",
                     name());
  DTRAIN_CHECK_INPUT(stage_ < 2 || options_.grad_compression.rfind("powersgd", 0) != 0,
                     "zero2 reduce-scatters the gradients; --grad-compression ",
                     options_.grad_compression,
                     " compresses allreduces: use it with ddp, zero1 "
                     "or a pipeline");
  DTRAIN_CHECK_INPUT(precision_ != precision::Precision::Bf16, name(),
                     " keeps fp32 master weights; use --precision bf16-master (a bf16 model) or "
                     "bf16-mixed, not bf16");
}

void ZeroStrategy::configure_reducer(ddp::ReducerOptions& options) {
  if (!scatter_) return;
  options.shard_numel = shards_.shard_numel();
  options.shard_grad = shard_grad_;
  options.quantization = block_quantization(options_);
  // Sequence parallelism's LayerNorm gradients, summed over the TP group before the
  // reduce-scatter (each bucket's shard then holds whole sums).
  if (!tp_.partial.empty() && tp_.size > 1) {
    options.partial = tp_.partial_flags(has_experts() ? dense_names_ : names_);
    options.partial_group = tp_.group;
  }
}

std::vector<at::Tensor> ZeroStrategy::gradient_holders() const {
  if (!scatter_) return reduced_gradient_holders();
  std::vector<at::Tensor> holders = shards_.piece_tensors();
  for (auto& piece : expert_shards_.piece_tensors()) holders.push_back(piece);
  return holders;
}

void ZeroStrategy::after_gradient_sync(StepResult& result) {
  // (bf16-master: the experts' fp32 gradients, which their shards' master pieces update from)
  if (has_experts()) expert_shards_.alias_parameter_gradients(expert_gradients_);
  ddp::DdpStrategy::after_gradient_sync(result);
}

void ZeroStrategy::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  // The shards follow the Reducer's buckets: each bucket's reduce-scatter (zero2) and all-gather
  // is balanced and runs on its own.
  ddp::ReducerOptions reducer_options = reducer_options_from(options_);
  // Expert parallelism: the dense parameters over the data-parallel group (as the Reducer takes
  // them), the experts over the ranks that hold the same ones.
  for (size_t k = 0; k < parameters_.size(); ++k) {
    (is_expert(k) ? experts_ : dense_).push_back(parameters_[k]);
    (is_expert(k) ? expert_names_ : dense_names_).push_back(names_[k]);
  }
  shards_ = FlatShards(dense_, ddp::bucket_groups(dense_, dense_names_, reducer_options),
                       comm_->size(), comm_->rank(), name());
  if (has_experts()) {
    expert_shards_ =
        FlatShards(experts_, ddp::bucket_groups(experts_, expert_names_, reducer_options),
                   grid_->edp()->size(), grid_->edp()->rank(), name());
  }
  // bf16-master: the optimizer updates an fp32 copy of this rank's shard (Megatron's
  // distributed optimizer); the buffer, hence the gathers, stay bf16.
  scatter_ = stage_ >= 2 || reduce_scatters_gradients(options_, tp_, /*partial_summed_first=*/true);
  if (!initial_master_.empty()) {
    std::vector<at::Tensor> dense, experts;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      (is_expert(k) ? experts : dense).push_back(initial_master_[k]);
    }
    shards_.make_master(at::kFloat, dense);
    if (has_experts()) {
      // (Allreduced instead, the dense gradients' holders would not know the experts' fp32 ones.)
      DTRAIN_CHECK_INPUT(scatter_, name(),
                         " with --precision bf16-master and split experts reduce-scatters the "
                         "gradients; not with --grad-compression powersgd, "
                         "--hierarchical-allreduce or key/value heads shared by TP ranks");
      expert_shards_.make_master(at::kFloat, experts);
    }
  }
  if (scatter_) {  // the gradient shard the Reducer reduce-scatters into (fp32 with a master)
    shard_grad_ =
        at::zeros({shards_.shard_numel()},
                  parameters_.front().options().dtype(
                      shards_.has_master() ? at::kFloat : parameters_.front().scalar_type()));
    shards_.alias_shard_gradient(shard_grad_);
  }
  std::vector<at::Tensor> pieces = shards_.piece_tensors();
  for (auto& piece : expert_shards_.piece_tensors()) pieces.push_back(piece);
  optimizer_ = make_optimizer(pieces);
  if (options_.of<ZeroOverlapOptions>().param_gather) overlap_forward();
}

void ZeroStrategy::overlap_forward() {
  // A parameter no stage names (or a model without stages) makes the forward wait for every
  // bucket first.
  bool all_named = false;
  const std::vector<int64_t> needed =
      shards_.buckets_needed(model_.stages, parameters_, &all_named);
  const bool staged = !model_.stages.empty() && all_named;
  auto whole = model_.forward;
  auto stages = model_.stages;
  model_.forward = [this, staged, whole, stages, needed](const at::Tensor& inputs) {
    if (!staged) {
      gather_wait_s_ += shards_.wait();
      return whole(inputs);
    }
    at::Tensor x = inputs;
    for (size_t i = 0; i < stages.size(); ++i) {
      if (shards_.gathering()) gather_wait_s_ += shards_.wait(needed[i]);
      if (!stages[i].checkpoint || !at::GradMode::is_enabled()) {
        x = stages[i].forward(x);
        continue;
      }
      // --checkpointing: each checkpointed stage is a segment of its own.
      std::vector<at::Tensor> parameters;
      for (const auto& module : stages[i].modules) {
        for (const auto& p : module->parameters()) parameters.push_back(p);
      }
      x = memory::checkpoint(stages[i].forward, x, parameters, stages[i].generators);
    }
    return x;
  };
}

StepResult ZeroStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                    const LossFn& loss) {
  gather_wait_s_ = 0.0;
  StepResult result = ddp::DdpStrategy::train_step(micro_batches, loss);
  // How long the step waited for the parameter gathers: all of them after the update, or
  // (--overlap-param-gather) what the forward waited for.
  if (comm_->size() > 1) result.metrics["param_gather_wait_ms"] = gather_wait_s_ * 1e3;
  return result;
}

Model& ZeroStrategy::model() {
  shards_.wait();
  return model_;
}

void ZeroStrategy::save(const std::string& directory) {
  shards_.wait();
  ddp::DdpStrategy::save(directory);
}

void ZeroStrategy::load(const std::string& directory) {
  shards_.wait();  // a gather in flight would overwrite what the load puts in
  ddp::DdpStrategy::load(directory);
}

void ZeroStrategy::apply_update() {
  // Reduce-scattered: the pieces' gradients alias shard_grad_ already. Allreduced (zero1 with
  // TP partial sums): each piece's gradient is the matching slice of its parameter's averaged
  // gradient (which lives in the Reducer's buckets): no copies.
  shards_.wait();  // (the forward waited for every bucket already)
  if (!scatter_) {
    std::vector<at::Tensor> dense;
    const std::vector<at::Tensor> holders = reduced_gradient_holders();
    for (size_t k = 0; k < holders.size(); ++k) {
      if (!is_expert(k)) dense.push_back(holders[k]);
    }
    shards_.alias_parameter_gradients(FlatShards::gradients_of(dense));
  }
  optimizer_->step();
  if (shards_.has_master()) shards_.publish_master();
  if (expert_shards_.has_master()) expert_shards_.publish_master();
  if (has_experts()) gather_wait_s_ += expert_shards_.allgather(grid_->edp());
  if (options_.of<ZeroOverlapOptions>().param_gather) {
    shards_.start_allgather(comm_);
  } else {
    gather_wait_s_ += shards_.allgather(comm_);
  }
}

std::vector<PieceRef> ZeroStrategy::state_pieces() const {
  std::vector<PieceRef> pieces = shards_.state_pieces(dense_names_, dense_);
  for (auto& piece : expert_shards_.state_pieces(expert_names_, experts_)) {
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

MemoryReport ZeroStrategy::memory_report() const {
  MemoryReport report;
  for (const auto& p : parameters_) {
    report.parameter_bytes += p.numel() * p.element_size();
    report.gradient_bytes += p.numel() * gradient_element_size(p, precision_);
  }
  report.parameter_bytes += shards_.padding_bytes();
  if (stage_ >= 2) report.gradient_bytes = shard_grad_.numel() * shard_grad_.element_size();
  report.optimizer_bytes = shards_.master_bytes() + expert_shards_.master_bytes() +
                           optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel::zero
