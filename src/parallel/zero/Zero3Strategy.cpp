// ZeRO-3: units from the model's stages, the sharder, and checkpoints of this rank's shard.
#include "parallel/zero/Zero3Strategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <unordered_map>

#include "dtrain/common/Error.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/optim/StateSize.h"
#include "parallel/zero/ZeroStrategy.h"

namespace dtrain::parallel::zero {

namespace {

// Appends the generators of `from` that `to` does not hold yet (the blocks of a model share its
// dropout generators).
void add_generators(std::vector<at::Generator>& to, const std::vector<at::Generator>& from) {
  for (const at::Generator& g : from) {
    const bool held = std::any_of(to.begin(), to.end(), [&g](const at::Generator& h) {
      return h.unsafeGetGeneratorImpl() == g.unsafeGetGeneratorImpl();
    });
    if (!held) to.push_back(g);
  }
}

void check_options(const Zero3Options& o) {
  DTRAIN_CHECK_INPUT(o.min_unit_params >= 0, "--zero3-min-unit-params must be >= 0, got ",
                     o.min_unit_params);
}

void declare_flags(FlagSet& flags, Zero3Options& o) {
  flags.add("--zero3-min-unit-params", o.min_unit_params,
            "zero3: merge consecutive model stages into units of at least this many parameters "
            "(0 = one unit per stage)");
  flags.add_negated("--no-zero3-prefetch", o.prefetch,
                    "zero3: do not gather the next unit while the current one computes");
}

}  // namespace

StrategyInfo zero3_strategy() {
  StrategyInfo info;
  info.name = "zero3";
  info.summary = "ZeRO stage 3 (FSDP): parameters sharded too, gathered unit by unit";
  info.whole_model_on_rank0 = false;
  info.shards_parameters = true;
  info.draws_deferred = true;
  info.cost.traffic = StepCost::Traffic::kGatherEachLayer;
  info.cost.shards_optimizer = true;
  info.cost.shards_gradients = true;
  info.cost.layer_buffers = 2;  // the gathered layer and the prefetched next
  info.options = {option_group<Zero3Options>("zero3", declare_flags, check_options),
                  zero_quantized_options()};
  info.check_layout = [](const StrategyOptions&, const Layout& layout) {
    DTRAIN_CHECK_INPUT(!layout.tied_parameters,
                       "--tied-embeddings with zero3: the shared weight would be gathered by two "
                       "units; leave --tied-embeddings out or use zero1/zero2");
    check_no_sequence_parallel("zero3", layout);
  };
  info.make = make_from_options<Zero3Strategy>;
  return info;
}

Zero3Strategy::Zero3Strategy(StrategyOptions options)
    : ddp::DdpStrategy(std::move(options)), zero3_(options_.of<Zero3Options>()) {
  check_options(zero3_);
  DTRAIN_CHECK_INPUT(precision_ != precision::Precision::Bf16,
                     "zero3 keeps fp32 master weights; use --precision bf16-mixed, not bf16");
  DTRAIN_CHECK_INPUT(!precision::has_master_weights(precision_),
                     "--precision bf16-master is built for ddp, zero1 and zero2, not zero3 (use "
                     "bf16-mixed)");
  DTRAIN_CHECK_INPUT(options_.grad_compression == "none",
                     "zero3 reduce-scatters gradients in "
                     "their own dtype; --grad-compression ",
                     options_.grad_compression, " is for ddp, zero1 and zero2");
}

std::vector<ShardUnit> Zero3Strategy::make_units() const {
  std::unordered_map<const void*, size_t> index;  // parameter (TensorImpl) -> index
  for (size_t k = 0; k < parameters_.size(); ++k) index[parameters_[k].unsafeGetTensorImpl()] = k;
  std::vector<ShardUnit> units;
  if (model_.stages.empty()) {
    if (comm_->rank() == 0) {
      std::cerr << "dtrain: warning: the model has no stages (Model::stages); zero3 gathers it "
                   "as one unit, so full parameters exist during forward and backward\n";
    }
    ShardUnit unit{"model", {}, {model_.forward}};
    for (size_t k = 0; k < parameters_.size(); ++k) unit.parameters.push_back(k);
    units.push_back(std::move(unit));
    return units;
  }
  int64_t open_numel = 0;
  bool open = false;
  for (const auto& stage : model_.stages) {
    if (!open) {
      units.push_back({stage.name, {}, {}});
      open = true;
      open_numel = 0;
    } else {
      units.back().name += "+" + stage.name;
    }
    ShardUnit& unit = units.back();
    unit.forwards.push_back(stage.forward);
    unit.checkpoint = unit.checkpoint || stage.checkpoint;
    add_generators(unit.generators, stage.generators);
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end()) continue;  // frozen
        if (std::find(unit.parameters.begin(), unit.parameters.end(), it->second) ==
            unit.parameters.end()) {
          unit.parameters.push_back(it->second);
          open_numel += p.numel();
        }
      }
    }
    // A unit closes once it has parameters (stages without any, such as activations, join
    // their neighbours) and reaches the minimum size.
    if (!unit.parameters.empty() && open_numel >= zero3_.min_unit_params) open = false;
  }
  if (units.size() > 1 && units.back().parameters.empty()) {  // trailing parameter-free stages
    ShardUnit tail = std::move(units.back());
    units.pop_back();
    units.back().name += "+" + tail.name;
    for (auto& forward : tail.forwards) units.back().forwards.push_back(std::move(forward));
    units.back().checkpoint = units.back().checkpoint || tail.checkpoint;
    add_generators(units.back().generators, tail.generators);
  }
  return units;
}

void Zero3Strategy::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  // A model of placeholders: each rank draws its shard of each parameter, nothing else.
  ParameterSharder::Fill fill;
  if (model_.deferred && model_.deferred->pending()) {
    fill = [init = model_.deferred, names = names_](size_t k, int64_t begin, at::Tensor out) {
      init->fill(names[k], begin, std::move(out));
    };
  }
  sharder_ = std::make_unique<ParameterSharder>(
      parameters_, names_, make_units(), comm_, zero3_.prefetch,
      options_.error_on_unused_parameters, block_quantization(options_), std::move(fill));
  model_.forward = [sharder = sharder_.get()](const at::Tensor& x) { return sharder->run(x); };
  std::vector<at::Tensor> shard;
  for (const auto& piece : sharder_->pieces()) shard.push_back(piece.tensor);
  optimizer_ = make_optimizer(shard);
}

std::vector<at::Tensor> Zero3Strategy::gradient_holders() const {
  std::vector<at::Tensor> holders;
  for (const auto& piece : sharder_->pieces()) holders.push_back(piece.tensor);
  return holders;
}

void Zero3Strategy::materialize() { sharder_->gather_all(); }

std::vector<PieceRef> Zero3Strategy::state_pieces() const {
  std::vector<PieceRef> pieces;
  for (const auto& piece : sharder_->pieces()) {
    pieces.push_back({names_[piece.parameter], piece.offset, piece.tensor,
                      parameters_[piece.parameter].sizes().vec()});
  }
  return pieces;
}

MemoryReport Zero3Strategy::memory_report() const {
  MemoryReport report;
  report.parameter_bytes = sharder_->shard_parameters().numel() *
                           static_cast<int64_t>(sharder_->shard_parameters().element_size());
  report.gradient_bytes = sharder_->shard_gradients().numel() *
                          static_cast<int64_t>(sharder_->shard_gradients().element_size());
  report.optimizer_bytes = optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel::zero
