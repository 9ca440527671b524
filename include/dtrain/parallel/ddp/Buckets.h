// How the reducer groups gradients into buckets, as a pure function of the parameters' sizes,
// dtypes and module names: the Reducer calls it on its tensors and `dtrain plan` on a model's
// description, so the planner's buckets are the ones training makes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::parallel::ddp {

/// One parameter as the bucketing rule sees it, in the model's parameter order.
struct BucketedParameter {
  int64_t bytes = 0;
  int dtype = 0;       ///< any number naming the dtype (one open bucket per dtype)
  std::string module;  ///< the module holding it ("" at the top)
};

struct BucketRule {
  int64_t bucket_cap_bytes = 25LL * 1024 * 1024;
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  bool isolate_first_layer = true;
};

/// Parameter indices of each bucket, in launch order: reverse parameter order (roughly the
/// order backward produces gradients), one open bucket per dtype, a bucket closing once it
/// reaches its cap (PyTorch DDP's rule) and the first one at the small first-bucket cap; with
/// `isolate_first_layer`, parameter 0's module gets a bucket of its own when the rest of its
/// bucket is at least as large (it is ready last, when nothing is left to hide it).
std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketedParameter>& parameters,
                                                const BucketRule& rule);

/// ZeRO's sharded layout (Megatron's distributed optimizer): the parameters laid out flat in
/// their order, each bucket padded to a multiple of the ranks; rank r owns the r-th equal part of
/// every bucket, so each bucket's reduce-scatter and all-gather is balanced (every rank sends and
/// receives (ranks - 1) / ranks of it) and can run on its own. A rank's shard is its parts, in
/// flat order. Used by the Reducer's reduce-scatter, ZeRO-1/2's parameter shards and the planner.
struct ShardedBucket {
  int64_t flat_begin = 0;          ///< first element in the flat layout
  int64_t numel = 0;               ///< its parameters' elements
  int64_t part = 0;                ///< elements each rank owns: numel rounded up to ranks, / ranks
  int64_t shard_offset = 0;        ///< where every rank's part of it sits in that rank's shard
  std::vector<size_t> parameters;  ///< ascending, contiguous
};
struct ShardLayout {
  std::vector<ShardedBucket> buckets;     ///< in flat order
  std::vector<int64_t> parameter_offset;  ///< flat offset of each parameter
  std::vector<size_t> bucket_of;          ///< each parameter's bucket (index into buckets)
  int64_t flat_numel = 0;                 ///< with padding
  int64_t shard_numel = 0;                ///< sum of the parts
};
/// `groups` (bucket parameter lists, any order) must each be a contiguous run of indices into
/// `numels` and together cover them once; an Error names the first that is not.
ShardLayout shard_layout(const std::vector<int64_t>& numels,
                         const std::vector<std::vector<size_t>>& groups, int ranks);

/// The module part of a parameter's dotted name ("blocks.0.fc.weight" -> "blocks.0.fc").
std::string module_of(const std::string& parameter_name);

}  // namespace dtrain::parallel::ddp
