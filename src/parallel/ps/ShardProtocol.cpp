#include "dtrain/parallel/ps/ShardProtocol.h"

#include <ATen/ATen.h>

#include <cmath>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ps {

std::pair<int64_t, int64_t> shard_range(int64_t total, int shard, int shards) {
  return {total * shard / shards, total * (shard + 1) / shards};
}

std::string check_finite(const at::Tensor& values, int64_t first_index) {
  // One reduction answers for the common case: a sum is finite only if every element is (or
  // it overflowed, which the exact look below tells apart).
  if (values.numel() == 0 || std::isfinite(values.sum().item<double>())) return "";
  const at::Tensor bad = at::isfinite(values).logical_not_().nonzero();
  if (bad.numel() == 0) return "";
  const int64_t i = bad[0][0].item<int64_t>();
  const double value = values[i].item<double>();
  return concat(kNonFiniteGradient, ": element ", first_index + i, " of the model's parameters is ",
                std::isnan(value) ? "nan"
                : value > 0       ? "inf"
                                  : "-inf");
}

}  // namespace dtrain::parallel::ps
