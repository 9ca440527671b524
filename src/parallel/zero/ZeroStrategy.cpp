// ZeRO-1: the flat parameter buffer, the shard optimizer, and the allgather after each update.
#include "parallel/zero/ZeroStrategy.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/optim/StateSize.h"
#include "parallel/Alias.h"

namespace dtrain::parallel {


ZeroStrategy::ZeroStrategy(StrategyOptions options, int stage)
    : DdpStrategy(std::move(options)), stage_(stage) {
  DTRAIN_CHECK(stage_ == 1 || stage_ == 2, "ZeroStrategy stage must be 1 or 2, got ", stage_);
  DTRAIN_CHECK_INPUT(precision_ != precision::Precision::Bf16, name(),
                     " keeps fp32 master weights; use --precision bf16-mixed, not bf16");
}

void ZeroStrategy::configure_reducer(ReducerOptions& options) {
  if (stage_ < 2) return;
  options.shard_numel = shard_numel_;
  options.shard_grad = shard_grad_;
}

std::vector<at::Tensor> ZeroStrategy::gradient_holders() const {
  if (stage_ < 2) return parameters_;
  std::vector<at::Tensor> holders;
  for (const auto& piece : pieces_) holders.push_back(piece.tensor);
  return holders;
}

void ZeroStrategy::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  const int world = comm_->size();
  const int rank = comm_->rank();
  const auto dtype = parameters_.front().scalar_type();
  for (const auto& p : parameters_) {
    DTRAIN_CHECK_INPUT(p.scalar_type() == dtype, "zero1 needs parameters of one dtype; ",
                       "found ", dtype, " and ", p.scalar_type());
    offsets_.push_back(total_numel_);
    total_numel_ += p.numel();
  }
  shard_numel_ = (total_numel_ + world - 1) / world;
  flat_ = at::zeros({shard_numel_ * world}, parameters_.front().options().requires_grad(false));
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      at::Tensor& p = parameters_[k];
      flat_.narrow(0, offsets_[k], p.numel()).copy_(p.reshape({-1}));
      // The parameter now lives in flat_ (its autograd node changes; the Reducer re-attaches).
      p.set_(flat_.storage(), offsets_[k], p.sizes(), c10::contiguous_strides(p.sizes()));
    }
  }
  // The optimizer gets this rank's shard as one piece per parameter it overlaps (each a leaf
  // aliasing flat_): optimizers loop over parameters, so their temporaries stay the size of one
  // parameter instead of the whole shard, and each piece's gradient can alias the Reducer's
  // bucket storage directly.
  const int64_t begin = rank * shard_numel_;
  const int64_t end = std::min(begin + shard_numel_, total_numel_);
  for (size_t k = 0; k < parameters_.size(); ++k) {
    const int64_t lo = std::max(begin, offsets_[k]);
    const int64_t hi = std::min(end, offsets_[k] + parameters_[k].numel());
    if (lo >= hi) continue;
    pieces_.push_back({k, lo - offsets_[k], alias_storage(flat_, lo, {hi - lo}).requires_grad_(true)});
  }
  if (stage_ >= 2) {  // the gradient shard the Reducer reduce-scatters into
    shard_grad_ = at::zeros({shard_numel_}, flat_.options());
    for (auto& piece : pieces_) {
      const int64_t lo = offsets_[piece.parameter] + piece.offset;
      piece.tensor.mutable_grad() = alias_storage(shard_grad_, lo - begin, {piece.tensor.numel()});
    }
  }
  std::vector<at::Tensor> shard;
  for (const auto& piece : pieces_) shard.push_back(piece.tensor);
  optimizer_ = make_optimizer(shard);
}

void ZeroStrategy::apply_update() {
  // Stage 1: each piece's gradient is the matching slice of its parameter's averaged gradient
  // (which lives in the Reducer's buckets): no copies. Stage 2: they alias shard_grad_ already.
  for (auto& piece : pieces_) {
    if (stage_ >= 2) break;
    const at::Tensor& grad = parameters_[piece.parameter].grad();
    DTRAIN_CHECK(grad.defined() && grad.is_contiguous(), "zero1: parameter ",
                 piece.parameter, " has no contiguous gradient after the reduction");
    piece.tensor.mutable_grad() = alias_storage(grad, piece.offset, {piece.tensor.numel()});
  }
  optimizer_->step();
  torch::NoGradGuard no_grad;
  comm_->allgather(flat_, flat_.narrow(0, comm_->rank() * shard_numel_, shard_numel_))->wait();
}

std::vector<PieceRef> ZeroStrategy::state_pieces() const {
  std::vector<PieceRef> pieces;
  for (const auto& piece : pieces_) {
    pieces.push_back({names_[piece.parameter], piece.offset, piece.tensor,
                      parameters_[piece.parameter].sizes().vec()});
  }
  return pieces;
}

MemoryReport ZeroStrategy::memory_report() const {
  MemoryReport report;
  for (const auto& p : parameters_) {
    report.parameter_bytes += p.numel() * p.element_size();
    report.gradient_bytes += p.numel() * p.element_size();
  }
  report.parameter_bytes += (flat_.numel() - total_numel_) * flat_.element_size();  // padding
  if (stage_ >= 2) report.gradient_bytes = shard_grad_.numel() * shard_grad_.element_size();
  report.optimizer_bytes = optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel
