// ZeRO-3: units from the model's stages, the sharder, and checkpoints of this rank's shard.
#include "parallel/zero/Zero3Strategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <unordered_map>

#include "common/StorageMemory.h"
#include "dtrain/common/Error.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/optim/Offload.h"
#include "dtrain/optim/StateSize.h"
#include "parallel/Alias.h"
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
  info.context_parallel = true;
  info.expert_parallel = true;
  info.master_weights = true;
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
  const bool master = precision::has_master_weights(precision_);
  const bool deferred = model_.deferred && model_.deferred->pending();
  // A model of placeholders: each rank draws its shard of each parameter, nothing else (with
  // master weights, into the fp32 master, which the bf16 shard is rounded from).
  ParameterSharder::Fill fill;
  if (deferred && master) {
    fill = [](size_t, int64_t, const at::Tensor&) {};
  } else if (deferred) {
    fill = [init = model_.deferred, names = names_](size_t k, int64_t begin, at::Tensor out) {
      init->fill(names[k], begin, std::move(out));
    };
  }
  sharder_ = std::make_unique<ParameterSharder>(
      parameters_, names_, make_units(), comm_, zero3_.prefetch,
      options_.error_on_unused_parameters, block_quantization(options_), std::move(fill),
      master ? at::kFloat : at::ScalarType::Undefined, expert_,
      has_experts() ? grid_->edp() : nullptr);
  model_.forward = [sharder = sharder_.get()](const at::Tensor& x) { return sharder->run(x); };
  std::vector<at::Tensor> shard;
  for (const auto& piece : sharder_->pieces()) shard.push_back(piece.tensor);
  if (master) {
    make_master(deferred);
    shard = master_pieces_;
  }
  optimizer_ = make_optimizer(shard);
}

void Zero3Strategy::make_master(bool deferred) {
  torch::NoGradGuard no_grad;
  const at::Tensor& flat = sharder_->shard_parameters();
  master_flat_ = at::empty({flat.numel()}, flat.options().dtype(at::kFloat));
  for (const auto& piece : sharder_->pieces()) {
    const int64_t numel = piece.tensor.numel();
    at::Tensor m =
        alias_storage(master_flat_, piece.tensor.storage_offset() - flat.storage_offset(), {numel});
    if (deferred) {
      model_.deferred->fill(names_[piece.parameter], piece.offset, m);
    } else {
      m.copy_(initial_master_.at(piece.parameter).reshape({-1}).narrow(0, piece.offset, numel));
    }
    piece.tensor.copy_(m);
    m.requires_grad_(true);
    m.mutable_grad() = piece.tensor.grad();
    master_grads_.push_back(piece.tensor.grad());
    master_pieces_.push_back(m);
  }
}

void Zero3Strategy::prepare_master() {
  if (master_pieces_.empty()) return;
  if (!master_synced_ && !master_in_file_) round_master_into_shard();
  master_synced_ = true;
  auto* offloaded = dynamic_cast<optim::OffloadedOptimizer*>(optimizer_.get());
  if (master_in_file_ || offloaded == nullptr || offloaded->spec().dir.empty()) return;
  std::vector<at::Tensor> rounded;
  for (const auto& piece : sharder_->pieces()) rounded.push_back(piece.tensor);
  offloaded->keep_parameters_in_file(std::move(rounded));
  master_in_file_ = true;
  take_memory(master_flat_);
}

template <typename Body>
void Zero3Strategy::with_master_in_memory(bool read, Body&& body) {
  if (!master_in_file_) {
    body();
    return;
  }
  give_memory(master_flat_);
  try {
    if (read) dynamic_cast<optim::OffloadedOptimizer&>(*optimizer_).read_parameters();
    body();
  } catch (...) {
    take_memory(master_flat_);
    throw;
  }
  take_memory(master_flat_);
}

void Zero3Strategy::round_master_into_shard() {
  torch::NoGradGuard no_grad;
  const auto& pieces = sharder_->pieces();
  for (size_t i = 0; i < pieces.size(); ++i) pieces[i].tensor.copy_(master_pieces_[i]);
}

StepResult Zero3Strategy::train_step(const std::vector<data::Batch>& micro_batches,
                                     const LossFn& loss) {
  prepare_master();
  return ddp::DdpStrategy::train_step(micro_batches, loss);
}

void Zero3Strategy::apply_update() {
  if (master_pieces_.empty()) {
    ddp::DdpStrategy::apply_update();
    return;
  }
  gradient_holders();  // the master's gradients point at the fp32 shard again
  optimizer_->step();
  if (!master_in_file_) round_master_into_shard();  // (in the file: each bucket's was rounded)
}

at::Tensor Zero3Strategy::evaluate_forward(const at::Tensor& inputs) {
  prepare_master();
  return ddp::DdpStrategy::evaluate_forward(inputs);
}

void Zero3Strategy::save(const std::string& directory) {
  with_master_in_memory(/*read=*/true, [&] { ddp::DdpStrategy::save(directory); });
}

void Zero3Strategy::load(const std::string& directory) {
  with_master_in_memory(/*read=*/false, [&] {
    ddp::DdpStrategy::load(directory);
    if (master_in_file_) dynamic_cast<optim::OffloadedOptimizer&>(*optimizer_).write_parameters();
  });
  master_synced_ = master_in_file_;
}

void Zero3Strategy::load_values(const std::string& directory) {
  with_master_in_memory(/*read=*/false, [&] {
    ddp::DdpStrategy::load_values(directory);
    if (master_in_file_) dynamic_cast<optim::OffloadedOptimizer&>(*optimizer_).write_parameters();
  });
  master_synced_ = master_in_file_;
}

std::vector<at::Tensor> Zero3Strategy::gradient_holders() const {
  if (!master_pieces_.empty()) {
    // An optimizer's zero_grad may have reset them.
    for (size_t i = 0; i < master_pieces_.size(); ++i) {
      master_pieces_[i].mutable_grad() = master_grads_[i];
    }
    return master_pieces_;
  }
  std::vector<at::Tensor> holders;
  for (const auto& piece : sharder_->pieces()) holders.push_back(piece.tensor);
  return holders;
}

void Zero3Strategy::materialize() {
  prepare_master();
  sharder_->gather_all();
}

std::vector<PieceRef> Zero3Strategy::state_pieces() const {
  std::vector<PieceRef> pieces;
  const auto& shard = sharder_->pieces();
  for (size_t i = 0; i < shard.size(); ++i) {
    const auto& piece = shard[i];
    pieces.push_back({names_[piece.parameter], piece.offset,
                      master_pieces_.empty() ? piece.tensor : master_pieces_[i],
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
  if (master_flat_.defined() && !master_in_file_) {
    report.optimizer_bytes += master_flat_.numel() * static_cast<int64_t>(sizeof(float));
  }
  return report;
}

}  // namespace dtrain::parallel::zero
