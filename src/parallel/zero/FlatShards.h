// ZeRO's flat layout of a group's parameters, shared by ZeRO-1/2 and the pipeline's zero1: the
// parameters move into one flat buffer padded to a multiple of the group size; this rank's
// shard of it is cut into one piece per parameter it overlaps (each a leaf aliasing the buffer)
// for its optimizer, so optimizer state exists for the shard only; after the optimizer step an
// allgather gives every rank the updated parameters.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/parallel/StateShards.h"

namespace dtrain::parallel::zero {

class FlatShards {
 public:
  /// Part of parameter `parameter` (from element `offset`) inside this rank's shard.
  struct Piece {
    size_t parameter;
    int64_t offset;
    at::Tensor tensor;  // aliases the flat buffer; an optimizer parameter
  };

  FlatShards() = default;
  /// Moves `parameters` (one dtype) into the flat buffer (they are re-pointed with set_, so
  /// their autograd nodes change) and cuts out the shard of `rank` of `ranks`. `who` names the
  /// strategy in errors.
  FlatShards(std::vector<at::Tensor>& parameters, int ranks, int rank, const std::string& who);

  const std::vector<Piece>& pieces() const { return pieces_; }
  /// The pieces' tensors, for the optimizer.
  std::vector<at::Tensor> piece_tensors() const;
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_begin() const { return rank_ * shard_numel_; }
  int64_t offset_of(size_t parameter) const { return offsets_[parameter]; }
  /// Bytes of padding at the end of the flat buffer.
  int64_t padding_bytes() const;

  /// ZeRO-1: each piece's gradient becomes the matching slice of its parameter's (contiguous,
  /// averaged) gradient: no copies.
  void alias_parameter_gradients(const std::vector<at::Tensor>& parameters);
  /// ZeRO-2: each piece's gradient aliases `shard_grad` (shard_numel elements).
  void alias_shard_gradient(const at::Tensor& shard_grad);
  /// Collective over `comm` (the group the shards were cut for): every rank's updated shard to
  /// every rank.
  void allgather(const comm::CommunicatorPtr& comm);
  /// The pieces as checkpoint pieces (names and whole shapes from `names` / `parameters`).
  std::vector<PieceRef> state_pieces(const std::vector<std::string>& names,
                                     const std::vector<at::Tensor>& parameters) const;

 private:
  int rank_ = 0;
  at::Tensor flat_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> offsets_;  // of each parameter in flat_
  int64_t total_numel_ = 0;
  int64_t shard_numel_ = 0;
};

}  // namespace dtrain::parallel::zero
