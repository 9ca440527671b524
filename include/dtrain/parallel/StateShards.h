// The one checkpoint format of every data-parallel strategy (DDP, ZeRO-1/2/3), so a checkpoint
// loads into any of them at any world size. Each rank writes `state-R-of-N.pt`: the pieces of
// parameters it owns, a piece being a run of one parameter's elements (in its flattened order)
// with the matching run of every element-wise optimizer state tensor, plus scalars such as
// Adam's step. A tensor-parallel rank's parameter is a block of the full tensor along one
// dimension (tensor/Split.h): its pieces are runs of that block, recorded with the block
// ("split": [dim, start, length]) so any other layout can find its elements. DDP's rank 0 owns
// whole parameters; a ZeRO rank owns its shard. Loading asks for runs (a whole parameter, or a
// shard's piece) and assembles them from whichever files overlap, so N ranks resume what M ranks
// wrote. Files are torch::pickle_save dicts (Python reads them with torch.load): {"pieces":
// [{"name", "offset", "tensors": {"param", "exp_avg", ...}}], "buffers": {name: tensor}}.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/nn/tensor/Split.h"

namespace torch::optim {
class Optimizer;
}

namespace dtrain::parallel {

/// A run of parameter `name`'s elements [offset, offset + tensor.numel()). Writing: `tensor`
/// holds the values (and keys the optimizer state when an optimizer is given). Reading:
/// values are copied into `tensor`, or the optimizer state of `tensor` is set.
struct PieceRef {
  std::string name;
  int64_t offset = 0;
  at::Tensor tensor;
  /// The whole parameter's shape (checked against the checkpoint's when loading): under
  /// tensor parallelism the full tensor's.
  std::vector<int64_t> shape;
  /// split_dim >= 0: the parameter is the block [split_start, split_start + split_length) of
  /// the full tensor along split_dim, and `offset` counts elements of that block.
  int64_t split_dim = -1;
  int64_t split_start = 0;
  int64_t split_length = 0;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Each of `parameters` whole (offset 0), named by `names`.
std::vector<PieceRef> whole_pieces(const std::vector<std::string>& names,
                                   const std::vector<at::Tensor>& parameters);

/// `pieces` with the splits of the parameters that have one (full shape and block recorded).
/// `keep_replicated` = false drops the pieces of parameters without a split: a tensor-parallel
/// group writes its replicated parameters once (from its rank 0).
std::vector<PieceRef> with_splits(std::vector<PieceRef> pieces,
                                  const nn::tensor::ParameterSplits& splits,
                                  bool keep_replicated = true);

/// The file rank `rank` of `ranks` writes in `directory`.
std::string state_file(const std::string& directory, int rank, int ranks);

/// Writes `pieces` (values, and their state in `optimizer` when not null) and `buffers` to
/// state_file(directory, rank, ranks), under a temporary name then renamed.
void write_state_shard(const std::string& directory, int rank, int ranks,
                       const std::vector<PieceRef>& pieces,
                       const torch::optim::Optimizer* optimizer, const NamedTensors& buffers);

/// Reads every state file of `directory` and fills `values` (each piece's tensor receives those
/// elements of the named parameter) and, when `optimizer` is given, the optimizer state of each
/// of `states` (state of those elements; empty when the checkpoint has none). Fills `buffers`
/// (by name, copied in) when not null. InputError naming the file, parameter and range when a
/// file is missing or does not cover what is asked.
void read_state_shards(const std::string& directory, const std::vector<PieceRef>& values,
                       torch::optim::Optimizer* optimizer, const std::vector<PieceRef>& states,
                       const NamedTensors* buffers);

}  // namespace dtrain::parallel
