// Compression of updates where bytes are precious (federated clients' updates, DiLoCo's outer
// gradients across slow links): 8-bit uniform
// quantization with stochastic rounding (unbiased: the expected decoded value is the update),
// in blocks of kQuantBlock elements each with its own minimum and step, and top-k
// sparsification (the k largest magnitudes, as int32 indices and values) with error feedback:
// what was not sent stays in the client's residual and is added to its next update (Seide et al.
// 2014, Lin et al. 2018), so nothing is lost, only delayed. An encoded update is a few named
// tensors; the server decodes it into the dense update after checking every part.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::comm {

struct CompressionSpec {
  enum Kind { None, Quant8, TopK };
  Kind kind = None;
  /// TopK: the fraction of elements sent (k = ceil(fraction x n), at least 1).
  double fraction = 0.01;
  /// TopK: keep what was not sent and add it to the next update.
  bool error_feedback = true;
};

/// Whether every element of `t` is finite: one pass (the float64 sum is finite exactly when no
/// element is NaN or Inf, for float32 and for float64 values below 1e300), where at::isfinite
/// makes several and allocates (3-4x slower on a model-sized update).
bool all_finite(const at::Tensor& t);

/// "none", "q8" or "topk:FRACTION" (e.g. topk:0.01); InputError naming `flag` otherwise.
CompressionSpec parse_compression(const std::string& text,
                                  const std::string& flag = "--compression");
std::string to_string(const CompressionSpec& spec);

/// Elements per quantization block (each block: its minimum and step as float32).
constexpr int64_t kQuantBlock = 1024;

/// An update as it travels: named parts ("delta"; "q", "lo", "step"; "indices", "values").
struct EncodedUpdate {
  std::string encoding;  // "none", "q8", "topk"
  std::vector<std::pair<std::string, at::Tensor>> parts;
  int64_t payload_bytes() const;
};

/// Encodes `delta` (flat float32 or float64). `residual`: TopK's error-feedback state (an
/// undefined tensor starts at zero; updated in place: what this update did not send); `seed`
/// drives Quant8's stochastic rounding.
EncodedUpdate encode_update(const at::Tensor& delta, const CompressionSpec& spec,
                            at::Tensor* residual, uint64_t seed);

/// Differential privacy bounds what the server receives, not what the client meant to send: an
/// update clipped to `max_norm` and then quantized can decode to a larger norm (stochastic
/// rounding adds variance), and top-k with error feedback sends values from the update plus
/// its residual. This scales what `encoded` carries (q8: each block's minimum and step; topk:
/// the values; none: the delta) so that it decodes, in `dtype`, to an L2 norm of at most
/// `max_norm`; what a top-k scale takes off goes back into `residual` (when defined), so error
/// feedback still loses nothing. A no-op when the norm is already within.
void fit_within_norm(EncodedUpdate* encoded, int64_t numel, at::ScalarType dtype, double max_norm,
                     at::Tensor* residual);

/// The dense update of `numel` elements in `dtype` from `encoded`, into *out; "" or why the
/// encoding is refused (unknown encoding or part, a part of the wrong dtype or size, indices out
/// of range or not increasing, NaN/Inf).
std::string decode_update(const EncodedUpdate& encoded, int64_t numel, at::ScalarType dtype,
                          at::Tensor* out);

}  // namespace dtrain::comm
