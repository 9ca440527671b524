// ZeRO-3: units from the model's stages, the sharder, and checkpoints of this rank's shard.
#include "parallel/zero/Zero3Strategy.h"

#include <torch/torch.h>

#include <iostream>
#include <unordered_map>

#include "dtrain/common/Error.h"
#include "dtrain/optim/StateSize.h"

namespace dtrain::parallel {

Zero3Strategy::Zero3Strategy(StrategyOptions options) : DdpStrategy(std::move(options)) {
  DTRAIN_CHECK_INPUT(precision_ != precision::Precision::Bf16,
                     "zero3 keeps fp32 master weights; use --precision bf16-mixed, not bf16");
  DTRAIN_CHECK_INPUT(options_.grad_compression == "none", "zero3 reduce-scatters gradients in "
                     "their own dtype; --grad-compression ", options_.grad_compression,
                     " is for ddp, zero1 and zero2");
  DTRAIN_CHECK_INPUT(options_.zero3_min_unit_params >= 0,
                     "zero3 minimum unit size must be >= 0 parameters");
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
    if (!unit.parameters.empty() && open_numel >= options_.zero3_min_unit_params) open = false;
  }
  if (units.size() > 1 && units.back().parameters.empty()) {  // trailing parameter-free stages
    ShardUnit tail = std::move(units.back());
    units.pop_back();
    units.back().name += "+" + tail.name;
    for (auto& forward : tail.forwards) units.back().forwards.push_back(std::move(forward));
    units.back().checkpoint = units.back().checkpoint || tail.checkpoint;
  }
  return units;
}

void Zero3Strategy::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  sharder_ = std::make_unique<ParameterSharder>(parameters_, names_, make_units(), comm_,
                                                options_.zero3_prefetch,
                                                options_.error_on_unused_parameters);
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

}  // namespace dtrain::parallel
