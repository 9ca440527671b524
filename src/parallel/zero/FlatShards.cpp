#include "parallel/zero/FlatShards.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "dtrain/common/Error.h"
#include "parallel/Alias.h"

namespace dtrain::parallel::zero {

bool reduce_scatters_gradients(const StrategyOptions& options, const TensorParallelLayout& tp,
                               bool partial_summed_first) {
  return (tp.partial.empty() || partial_summed_first) && !tp.has_shared_blocks() &&
         options.grad_compression.rfind("powersgd", 0) != 0 && !options.hierarchical_allreduce;
}

FlatShards::FlatShards(std::vector<at::Tensor>& parameters,
                       const std::vector<std::vector<size_t>>& buckets, int ranks, int rank,
                       const std::string& who)
    : rank_(rank) {
  DTRAIN_CHECK(!parameters.empty(), who, ": no parameters to shard");
  const auto dtype = parameters.front().scalar_type();
  std::vector<int64_t> numels;
  for (const auto& p : parameters) {
    DTRAIN_CHECK_INPUT(p.scalar_type() == dtype, who, " needs parameters of one dtype; found ",
                       dtype, " and ", p.scalar_type());
    numels.push_back(p.numel());
    total_numel_ += p.numel();
  }
  layout_ = ddp::shard_layout(numels, buckets, ranks);
  flat_ = at::zeros({layout_.flat_numel}, parameters.front().options().requires_grad(false));
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < parameters.size(); ++k) {
      at::Tensor& p = parameters[k];
      const int64_t offset = layout_.parameter_offset[k];
      flat_.narrow(0, offset, p.numel()).copy_(p.reshape({-1}));
      // The parameter now lives in flat_ (its autograd node changes; the Reducer re-attaches).
      p.set_(flat_.storage(), offset, p.sizes(), c10::contiguous_strides(p.sizes()));
    }
  }
  numels_ = numels;
  pieces_ = pieces_of(rank_);
}

std::vector<FlatShards::Piece> FlatShards::pieces_of(int rank) const {
  // One piece per parameter each part of the shard overlaps (each a leaf aliasing flat_):
  // optimizers loop over parameters, so their temporaries stay the size of one parameter
  // instead of the whole shard, and each piece's gradient can alias the Reducer's storage.
  std::vector<Piece> pieces;
  for (const auto& bucket : layout_.buckets) {
    const int64_t begin = bucket.flat_begin + rank * bucket.part;
    const int64_t end = std::min(begin + bucket.part, bucket.flat_begin + bucket.numel);
    for (size_t k : bucket.parameters) {
      const int64_t offset = layout_.parameter_offset[k];
      const int64_t lo = std::max(begin, offset);
      const int64_t hi = std::min(end, offset + numels_[k]);
      if (lo >= hi) continue;
      pieces.push_back({k, lo - offset, bucket.shard_offset + (lo - begin),
                        alias_storage(flat_, lo, {hi - lo}).requires_grad_(true), at::Tensor()});
    }
  }
  return pieces;
}

void FlatShards::pack(const at::Tensor& source, int rank, at::Tensor out) const {
  torch::NoGradGuard no_grad;
  for (const auto& bucket : layout_.buckets) {
    out.narrow(0, bucket.shard_offset, bucket.part)
        .copy_(source.narrow(0, bucket.flat_begin + rank * bucket.part, bucket.part));
  }
}

void FlatShards::lay_out(const std::vector<at::Tensor>& tensors, at::Tensor out) const {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < tensors.size(); ++k) {
    at::Tensor into = out.narrow(0, layout_.parameter_offset[k], numels_[k]);
    if (tensors[k].defined()) {
      into.copy_(tensors[k].reshape({-1}));
    } else {
      into.zero_();
    }
  }
  // Each bucket's padding (after its parameters, up to the next bucket).
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bucket = layout_.buckets[b];
    const int64_t end =
        b + 1 < layout_.buckets.size() ? layout_.buckets[b + 1].flat_begin : layout_.flat_numel;
    const int64_t begin = bucket.flat_begin + bucket.numel;
    if (end > begin) out.narrow(0, begin, end - begin).zero_();
  }
}

void FlatShards::reorder_parts(const at::Tensor& source, const std::vector<int>& order,
                               at::Tensor out) const {
  torch::NoGradGuard no_grad;
  for (const auto& bucket : layout_.buckets) {
    for (size_t g = 0; g < order.size(); ++g) {
      out.narrow(0, bucket.flat_begin + static_cast<int64_t>(g) * bucket.part, bucket.part)
          .copy_(source.narrow(0, bucket.flat_begin + order[g] * bucket.part, bucket.part));
    }
  }
}

std::vector<comm::WorkPtr> FlatShards::issue_reduce_scatter(const comm::CommunicatorPtr& comm,
                                                            const at::Tensor& input,
                                                            at::Tensor shard) const {
  std::vector<comm::WorkPtr> works;
  for (const auto& bucket : layout_.buckets) {
    works.push_back(comm->reduce_scatter(shard.narrow(0, bucket.shard_offset, bucket.part),
                                         input.narrow(0, bucket.flat_begin,
                                                      bucket.part * comm->size())));
  }
  return works;
}

void FlatShards::unpack(int rank, const at::Tensor& in) {
  torch::NoGradGuard no_grad;
  for (const auto& bucket : layout_.buckets) {
    flat_.narrow(0, bucket.flat_begin + rank * bucket.part, bucket.part)
        .copy_(in.narrow(0, bucket.shard_offset, bucket.part));
  }
}

FlatShards::~FlatShards() {
  try {
    wait();
  } catch (...) {  // (a failed gather was or will be reported by whoever waits on the group)
  }
}

std::vector<at::Tensor> FlatShards::piece_tensors() const {
  std::vector<at::Tensor> tensors;
  for (const auto& piece : pieces_) tensors.push_back(piece.optimized());
  return tensors;
}

void FlatShards::make_master(at::ScalarType dtype, const std::vector<at::Tensor>& initial) {
  torch::NoGradGuard no_grad;
  master_ = at::zeros({layout_.shard_numel}, flat_.options().dtype(dtype));
  for (auto& piece : pieces_) {
    const int64_t n = piece.tensor.numel();
    piece.master = alias_storage(master_, piece.shard_offset, {n});
    piece.master.copy_(initial.at(piece.parameter).reshape({-1}).narrow(0, piece.offset, n));
    piece.master.requires_grad_(true);
  }
}

void FlatShards::publish_master() {
  torch::NoGradGuard no_grad;
  for (auto& piece : pieces_) piece.tensor.copy_(piece.master);
}

int64_t FlatShards::master_bytes() const {
  return master_.defined() ? master_.numel() * master_.element_size() : 0;
}

std::vector<at::Tensor> FlatShards::gradients_of(const std::vector<at::Tensor>& parameters) {
  std::vector<at::Tensor> gradients;
  for (const auto& p : parameters) gradients.push_back(p.grad());
  return gradients;
}

int64_t FlatShards::padding_bytes() const {
  return flat_.defined() ? (flat_.numel() - total_numel_) * flat_.element_size() : 0;
}

void FlatShards::alias_parameter_gradients(std::vector<Piece>& pieces,
                                           const std::vector<at::Tensor>& gradients) {
  for (auto& piece : pieces) {
    const at::Tensor& grad = gradients.at(piece.parameter);
    DTRAIN_CHECK(grad.defined() && grad.is_contiguous(), "zero1: parameter ", piece.parameter,
                 " has no contiguous gradient after the reduction");
    const at::Tensor& target = piece.optimized();
    DTRAIN_CHECK(grad.scalar_type() == target.scalar_type(), "zero1: parameter ", piece.parameter,
                 "'s gradient is ", grad.scalar_type(), ", its update ", target.scalar_type());
    target.mutable_grad() = alias_storage(grad, piece.offset, {piece.tensor.numel()});
  }
}

void FlatShards::alias_shard_gradient(std::vector<Piece>& pieces, const at::Tensor& shard_grad) {
  for (auto& piece : pieces) {
    piece.optimized().mutable_grad() =
        alias_storage(shard_grad, piece.shard_offset, {piece.tensor.numel()});
  }
}

double FlatShards::allgather(const comm::CommunicatorPtr& comm) {
  start_allgather(comm);
  return wait();
}

void FlatShards::start_allgather(const comm::CommunicatorPtr& comm) {
  DTRAIN_CHECK(gathers_.empty(), "FlatShards: a gather started while the last is in flight");
  gathers_ = issue_allgather(comm);
  gathered_ = 0;
}

std::vector<comm::WorkPtr> FlatShards::issue_allgather(const comm::CommunicatorPtr& comm) {
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  for (const auto& bucket : layout_.buckets) {
    at::Tensor whole = flat_.narrow(0, bucket.flat_begin, bucket.part * comm->size());
    works.push_back(comm->allgather(whole, whole.narrow(0, rank_ * bucket.part, bucket.part)));
  }
  return works;
}

double FlatShards::wait(int64_t bucket) {
  if (gathers_.empty()) return 0.0;
  const auto start = std::chrono::steady_clock::now();
  const size_t until =
      bucket < 0 ? gathers_.size() : std::min(gathers_.size(), static_cast<size_t>(bucket) + 1);
  for (; gathered_ < until; ++gathered_) gathers_[gathered_]->wait();
  if (gathered_ == gathers_.size()) {
    gathers_.clear();
    gathered_ = 0;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<int64_t> FlatShards::buckets_needed(const std::vector<Stage>& stages,
                                                const std::vector<at::Tensor>& parameters,
                                                bool* all_named) const {
  std::unordered_map<const void*, size_t> index_of;
  for (size_t k = 0; k < parameters.size(); ++k) index_of[parameters[k].unsafeGetTensorImpl()] = k;
  std::vector<bool> named(parameters.size(), false);
  std::vector<int64_t> needed;
  int64_t last = -1;
  for (const auto& stage : stages) {
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) {
        const auto it = index_of.find(p.unsafeGetTensorImpl());
        if (it == index_of.end()) continue;
        named[it->second] = true;
        last = std::max(last, static_cast<int64_t>(layout_.bucket_of.at(it->second)));
      }
    }
    needed.push_back(last);
  }
  if (all_named) *all_named = std::all_of(named.begin(), named.end(), [](bool n) { return n; });
  return needed;
}

std::vector<PieceRef> FlatShards::state_pieces(const std::vector<Piece>& pieces,
                                               const std::vector<std::string>& names,
                                               const std::vector<at::Tensor>& parameters) {
  std::vector<PieceRef> refs;
  for (const auto& piece : pieces) {
    refs.push_back({names[piece.parameter], piece.offset, piece.optimized(),
                    parameters[piece.parameter].sizes().vec()});
  }
  return refs;
}

}  // namespace dtrain::parallel::zero
