// ZeRO's flat layout of a group's parameters, shared by ZeRO-1/2 and the pipeline's zero1: the
// parameters move into one flat buffer laid out by buckets (ddp::shard_layout: each bucket
// padded to a multiple of the group size, Megatron's distributed optimizer); this rank's shard is
// its equal part of every bucket, cut into one piece per parameter it overlaps (each a leaf
// aliasing the buffer) for its optimizer, so optimizer state exists for the shard only; after
// the optimizer step an all-gather per bucket gives every rank the updated parameters, either
// waited at once or left running until the next forward needs each bucket (overlap).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Model.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/ddp/Buckets.h"
#include "parallel/StrategySupport.h"

namespace dtrain::parallel::zero {

/// Whether ZeRO-1's gradients can be reduce-scattered into the shards (Megatron's distributed
/// optimizer) rather than allreduced: not where tensor parallelism leaves partial sums to add
/// whole after the reduction (shared key/value blocks; sequence parallelism's LayerNorms unless
/// `partial_summed_first`: the Reducer sums them over the TP group before it reduces), nor with
/// PowerSGD or the hierarchical allreduce, which work on whole buckets.
bool reduce_scatters_gradients(const StrategyOptions& options, const TensorParallelLayout& tp,
                               bool partial_summed_first = false);

class FlatShards {
 public:
  /// Part of parameter `parameter` (from element `offset`) inside this rank's shard.
  struct Piece {
    size_t parameter;
    int64_t offset;        // of the run within the parameter
    int64_t shard_offset;  // of the run within this rank's shard
    at::Tensor tensor;     // aliases the flat buffer; the optimizer's parameter without master
    at::Tensor master;     // make_master(): the full-precision copy the optimizer updates
    /// What the optimizer updates: the master copy where there is one.
    const at::Tensor& optimized() const { return master.defined() ? master : tensor; }
  };

  FlatShards() = default;
  /// Waits for gathers still in flight (they write into the buffer); errors are dropped here.
  ~FlatShards();
  FlatShards(FlatShards&&) = default;
  FlatShards& operator=(FlatShards&&) = default;
  FlatShards(const FlatShards&) = delete;
  FlatShards& operator=(const FlatShards&) = delete;
  /// Moves `parameters` (one dtype) into the flat buffer (they are re-pointed with set_, so
  /// their autograd nodes change) and cuts out the shard of `rank` of `ranks`, bucket by bucket
  /// (`buckets`: parameter index lists, as the Reducer makes them).
  /// `who` names the strategy in errors.
  FlatShards(std::vector<at::Tensor>& parameters, const std::vector<std::vector<size_t>>& buckets,
             int ranks, int rank, const std::string& who);

  const std::vector<Piece>& pieces() const { return pieces_; }
  /// The pieces of rank `rank`'s shard (fresh leaves aliasing the buffer): a rank that also
  /// keeps another's shard (a buddy copy) updates them too.
  std::vector<Piece> pieces_of(int rank) const;
  /// Rank `rank`'s shard of the buffer (its part of every bucket) into `out` (shard_numel
  /// elements), and back from `in`.
  void pack(int rank, at::Tensor out) const { pack(flat_, rank, out); }
  /// The same from `source`, a tensor laid out as the buffer (flat_numel elements or more).
  void pack(const at::Tensor& source, int rank, at::Tensor out) const;
  /// Each of `tensors` (one per parameter, as the constructor's; undefined: zeros) into `out`
  /// where its parameter lies in the buffer (the padding zeroed).
  void lay_out(const std::vector<at::Tensor>& tensors, at::Tensor out) const;
  /// `source` (laid out as the buffer) into `out` with each bucket's parts reordered: part g of
  /// `out` is part order[g] of `source`.
  void reorder_parts(const at::Tensor& source, const std::vector<int>& order, at::Tensor out) const;
  /// Reduce-scatters `input` (laid out as the buffer) over `comm`, bucket by bucket: this rank's
  /// part of each bucket's sum into `shard` (shard_numel elements); returns the works.
  std::vector<comm::WorkPtr> issue_reduce_scatter(const comm::CommunicatorPtr& comm,
                                                  const at::Tensor& input, at::Tensor shard) const;
  void unpack(int rank, const at::Tensor& in);
  /// The tensors the optimizer updates (the pieces', or their master copies).
  std::vector<at::Tensor> piece_tensors() const;
  /// Master weights (--precision bf16-master): from here on the optimizer updates a copy of
  /// this rank's shard in `dtype` (one tensor, the pieces aliasing it), whose values come from
  /// `initial` (each parameter's starting values at full precision, indexed as the
  /// constructor's parameters; the buffer holds them rounded). Gradients alias into the
  /// master pieces; publish_master() rounds the update into the buffer before the gather.
  void make_master(at::ScalarType dtype, const std::vector<at::Tensor>& initial);
  bool has_master() const { return master_.defined(); }
  /// Copies the master pieces into the buffer's pieces (this rank's shard, before a gather).
  void publish_master();
  /// Bytes of the master copy (0 without).
  int64_t master_bytes() const;
  int64_t shard_numel() const { return layout_.shard_numel; }
  const ddp::ShardLayout& layout() const { return layout_; }
  /// Bytes of padding at the end of the flat buffer.
  int64_t padding_bytes() const;

  /// ZeRO-1: each piece's gradient becomes the matching slice of its parameter's (contiguous,
  /// averaged) gradient, `gradients[k]` for the constructor's parameter k: no copies.
  void alias_parameter_gradients(const std::vector<at::Tensor>& gradients) {
    alias_parameter_gradients(pieces_, gradients);
  }
  static void alias_parameter_gradients(std::vector<Piece>& pieces,
                                        const std::vector<at::Tensor>& gradients);
  /// The same with each parameter's own .grad.
  static std::vector<at::Tensor> gradients_of(const std::vector<at::Tensor>& parameters);
  /// ZeRO-2: each piece's gradient aliases `shard_grad` (shard_numel elements).
  void alias_shard_gradient(const at::Tensor& shard_grad) {
    alias_shard_gradient(pieces_, shard_grad);
  }
  static void alias_shard_gradient(std::vector<Piece>& pieces, const at::Tensor& shard_grad);
  /// Collective over `comm` (the group the shards were cut for): every rank's updated shard to
  /// every rank, bucket by bucket; waits for all (returns how long, in seconds).
  double allgather(const comm::CommunicatorPtr& comm);
  /// The same all-gathers, started in flat order (a model's first layers first) and left
  /// running: wait() before reading the parameters of the buckets concerned.
  void start_allgather(const comm::CommunicatorPtr& comm);
  /// The same gathers, returned to the caller (who waits for them) instead of kept.
  std::vector<comm::WorkPtr> issue_allgather(const comm::CommunicatorPtr& comm);
  /// Waits for the gathers of buckets 0..`bucket` (all: -1 or past the end); how long it waited
  /// in seconds. Nothing when none is in flight.
  double wait(int64_t bucket = -1);
  bool gathering() const { return !gathers_.empty(); }
  /// For each of `stages` in order, the last bucket that it or a stage before it needs
  /// (`parameters`: the sharded ones, as given to the constructor; -1: none yet), for waiting
  /// bucket by bucket in a forward; `all_named` (optional) says whether every parameter belongs
  /// to one of the stages.
  std::vector<int64_t> buckets_needed(const std::vector<Stage>& stages,
                                      const std::vector<at::Tensor>& parameters,
                                      bool* all_named = nullptr) const;
  /// The pieces as checkpoint pieces (names and whole shapes from `names` / `parameters`).
  std::vector<PieceRef> state_pieces(const std::vector<std::string>& names,
                                     const std::vector<at::Tensor>& parameters) const {
    return state_pieces(pieces_, names, parameters);
  }
  static std::vector<PieceRef> state_pieces(const std::vector<Piece>& pieces,
                                            const std::vector<std::string>& names,
                                            const std::vector<at::Tensor>& parameters);

 private:
  int rank_ = 0;
  std::vector<int64_t> numels_;  // the parameters'
  at::Tensor flat_;
  at::Tensor master_;  // make_master(): shard_numel elements
  std::vector<Piece> pieces_;
  ddp::ShardLayout layout_;
  int64_t total_numel_ = 0;
  std::vector<comm::WorkPtr> gathers_;  // in flight, one per bucket from gathered_ on
  size_t gathered_ = 0;                 // buckets whose gather is waited
};

}  // namespace dtrain::parallel::zero
