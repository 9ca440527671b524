#include "parallel/zero/FlatShards.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "parallel/Alias.h"

namespace dtrain::parallel::zero {

FlatShards::FlatShards(std::vector<at::Tensor>& parameters, int ranks, int rank,
                       const std::string& who)
    : rank_(rank) {
  DTRAIN_CHECK(!parameters.empty(), who, ": no parameters to shard");
  const auto dtype = parameters.front().scalar_type();
  for (const auto& p : parameters) {
    DTRAIN_CHECK_INPUT(p.scalar_type() == dtype, who, " needs parameters of one dtype; found ",
                       dtype, " and ", p.scalar_type());
    offsets_.push_back(total_numel_);
    total_numel_ += p.numel();
  }
  shard_numel_ = (total_numel_ + ranks - 1) / ranks;
  flat_ = at::zeros({shard_numel_ * ranks}, parameters.front().options().requires_grad(false));
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < parameters.size(); ++k) {
      at::Tensor& p = parameters[k];
      flat_.narrow(0, offsets_[k], p.numel()).copy_(p.reshape({-1}));
      // The parameter now lives in flat_ (its autograd node changes; the Reducer re-attaches).
      p.set_(flat_.storage(), offsets_[k], p.sizes(), c10::contiguous_strides(p.sizes()));
    }
  }
  // One piece per parameter the shard overlaps (each a leaf aliasing flat_): optimizers loop
  // over parameters, so their temporaries stay the size of one parameter instead of the whole
  // shard, and each piece's gradient can alias the Reducer's bucket storage directly.
  const int64_t begin = shard_begin();
  const int64_t end = std::min(begin + shard_numel_, total_numel_);
  for (size_t k = 0; k < parameters.size(); ++k) {
    const int64_t lo = std::max(begin, offsets_[k]);
    const int64_t hi = std::min(end, offsets_[k] + parameters[k].numel());
    if (lo >= hi) continue;
    pieces_.push_back(
        {k, lo - offsets_[k], alias_storage(flat_, lo, {hi - lo}).requires_grad_(true)});
  }
}

std::vector<at::Tensor> FlatShards::piece_tensors() const {
  std::vector<at::Tensor> tensors;
  for (const auto& piece : pieces_) tensors.push_back(piece.tensor);
  return tensors;
}

int64_t FlatShards::padding_bytes() const {
  return flat_.defined() ? (flat_.numel() - total_numel_) * flat_.element_size() : 0;
}

void FlatShards::alias_parameter_gradients(const std::vector<at::Tensor>& parameters) {
  for (auto& piece : pieces_) {
    const at::Tensor& grad = parameters[piece.parameter].grad();
    DTRAIN_CHECK(grad.defined() && grad.is_contiguous(), "zero1: parameter ", piece.parameter,
                 " has no contiguous gradient after the reduction");
    piece.tensor.mutable_grad() = alias_storage(grad, piece.offset, {piece.tensor.numel()});
  }
}

void FlatShards::alias_shard_gradient(const at::Tensor& shard_grad) {
  for (auto& piece : pieces_) {
    const int64_t lo = offsets_[piece.parameter] + piece.offset;
    piece.tensor.mutable_grad() =
        alias_storage(shard_grad, lo - shard_begin(), {piece.tensor.numel()});
  }
}

void FlatShards::allgather(const comm::CommunicatorPtr& comm) {
  torch::NoGradGuard no_grad;
  comm->allgather(flat_, flat_.narrow(0, shard_begin(), shard_numel_))->wait();
}

std::vector<PieceRef> FlatShards::state_pieces(const std::vector<std::string>& names,
                                               const std::vector<at::Tensor>& parameters) const {
  std::vector<PieceRef> pieces;
  for (const auto& piece : pieces_) {
    pieces.push_back({names[piece.parameter], piece.offset, piece.tensor,
                      parameters[piece.parameter].sizes().vec()});
  }
  return pieces;
}

}  // namespace dtrain::parallel::zero
