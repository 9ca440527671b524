// How a tensor-parallel parameter relates to the full (serial) tensor: a contiguous range along
// one dimension, held by one rank or by several (replicas). Layers report their splits
// (TensorParallelModule) so strategies can save each rank's part as a piece of the full tensor,
// count replicated parameters once in the gradient norm, and record full shapes; a parameter
// without a split is replicated across the group.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtrain::nn::tensor {

struct ParameterSplit {
  /// The dimension of the full tensor that is split.
  int64_t dim = 0;
  /// This rank's range [start, start + length) along `dim`.
  int64_t start = 0;
  int64_t length = 0;
  /// The full tensor's shape.
  std::vector<int64_t> full_shape;
  /// How many ranks of the group hold this same block (key/value heads replicated when a
  /// grouped-query model has fewer of them than tensor-parallel ranks), and which of them this
  /// rank is. Each holder's gradient is a partial sum: strategies sum it over the holders, count
  /// it once in the gradient norm, and the first holder writes it to checkpoints.
  int replicas = 1;
  int replica = 0;
  /// Split over the expert-parallel group (a mixture of experts' stacked experts), not the
  /// tensor-parallel one.
  bool expert = false;
};

/// Parameter name (as in Module::named_parameters) -> its split.
using ParameterSplits = std::map<std::string, ParameterSplit>;

/// Rank `index` of `parts`' balanced contiguous share of `n` items: (start, length), the first
/// n % parts shares one longer.
std::pair<int64_t, int64_t> split_range(int64_t n, int parts, int index);

/// Implemented by modules whose parameters are parts of larger tensors.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  /// Splits of this module's own parameters, by their local names ("weight", "bias").
  virtual ParameterSplits local_splits() const = 0;
  /// Replicated parameters of this module or its descendants (names relative to it) whose
  /// gradient on each rank is only a partial sum (sequence parallelism: each rank's LayerNorms
  /// see part of the sequence). Strategies sum them over the group before the update.
  virtual std::vector<std::string> partial_gradients() const { return {}; }
};

/// Every split parameter of `root` and its descendants, by full name.
ParameterSplits parameter_splits(const torch::nn::Module& root);

/// Every parameter of `root` whose gradient is a partial sum over the group, by full name.
std::vector<std::string> partial_gradient_parameters(const torch::nn::Module& root);

/// The full shape of a parameter: its split's full_shape, or `local` when it has none.
std::vector<int64_t> full_shape(const ParameterSplits& splits, const std::string& name,
                                const std::vector<int64_t>& local);

}  // namespace dtrain::nn::tensor
