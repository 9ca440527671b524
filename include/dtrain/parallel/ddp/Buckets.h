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

/// The module part of a parameter's dotted name ("blocks.0.fc.weight" -> "blocks.0.fc").
std::string module_of(const std::string& parameter_name);

}  // namespace dtrain::parallel::ddp
