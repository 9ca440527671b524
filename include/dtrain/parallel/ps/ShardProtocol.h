// What the parameter server's shards and their clients (the Downpour and Sandblaster workers,
// the L-BFGS coordinator) agree on, apart from the wire format (proto/dtrain/ps.proto): how the
// flat parameter vector is split over shards, the vector commands, the bounds a shard enforces
// and how a non-finite gradient is named. Both sides include this; neither includes the other.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace dtrain::parallel::ps {

/// Balanced contiguous ranges of `total` elements over `shards`: shard i gets
/// [i * total / shards, (i + 1) * total / shards) (a large tensor may span shards).
std::pair<int64_t, int64_t> shard_range(int64_t total, int shard, int shards);

/// A vector command on the shard's slice (Sandblaster L-BFGS): the coordinator sends these so
/// that parameter-sized vectors never leave the shards. Vectors are named; "x" is the
/// parameters themselves, others are created by the first Zero or Copy into them.
struct VectorOp {
  enum Kind { Zero, Copy, Scale, Axpy, Dot };
  Kind kind = Zero;
  /// Zero/Scale: dst; Copy: dst = src; Axpy: dst += alpha * src; Dot: dst . src (a partial sum
  /// over the slice, in float64).
  std::string dst, src;
  double alpha = 0.0;
  /// Zero only, when > 0: opens accumulation round `round` of dst (see accumulate()).
  int64_t round = 0;
};

/// Largest work-unit number a keyed accumulate may carry (a bound on what a round records).
constexpr int64_t kMaxUnits = int64_t{1} << 20;

/// Most named vectors a shard keeps (besides "x"): a bound on what a request can allocate.
constexpr int kMaxVectors = 256;

/// Longest vector name (Sandblaster's named vectors, a push's `accumulate`).
constexpr size_t kMaxVectorName = 64;

/// How every refusal of a gradient holding NaN or Inf begins (the service answers those with
/// the error details "non-finite", so a worker can skip the update instead of stopping).
constexpr const char* kNonFiniteGradient = "non-finite gradient";

/// "" when every element of `values` is finite, else kNonFiniteGradient and the first bad
/// element, numbered from `first_index` (its index in the model's flat parameters).
std::string check_finite(const at::Tensor& values, int64_t first_index);

}  // namespace dtrain::parallel::ps
