// Uneven shares as even ones: a reduce-scatter or allgather whose ranks hold different counts
// (ZeRO's shards) run by a backend that only has the even collective (NCCL's), over buffers in
// which every rank's share is padded to the largest. Private to src/comm; pure tensor code, so the
// CPU tests check it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dtrain::comm {

/// Every rank's count: `counts`, or equal shares of `total` when it is empty.
inline std::vector<int64_t> share_counts(std::vector<int64_t> counts, int64_t total, int size) {
  if (counts.empty()) counts.assign(size, total / size);
  return counts;
}

inline int64_t largest_share(const std::vector<int64_t>& counts) {
  return *std::max_element(counts.begin(), counts.end());
}

inline bool even_shares(const std::vector<int64_t>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); });
}

/// The flat `input` (the shares one after another) with each share padded to the largest:
/// size x largest elements, the padding zero. The input itself (flat) when the shares are even.
inline at::Tensor pad_shares(const at::Tensor& input, const std::vector<int64_t>& counts) {
  const at::Tensor flat = input.reshape({-1});
  if (even_shares(counts)) return flat.contiguous();
  const int64_t most = largest_share(counts);
  at::Tensor padded = at::zeros({most * static_cast<int64_t>(counts.size())}, input.options());
  int64_t offset = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    padded.narrow(0, static_cast<int64_t>(r) * most, counts[r])
        .copy_(flat.narrow(0, offset, counts[r]));
    offset += counts[r];
  }
  return padded;
}

/// The inverse: writes the shares of `padded` (each `largest` long) one after another into the
/// flat `output`.
inline void unpad_shares(const at::Tensor& padded, const std::vector<int64_t>& counts,
                         const at::Tensor& output) {
  const int64_t most = largest_share(counts);
  at::Tensor flat = output.view({-1});
  int64_t offset = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    flat.narrow(0, offset, counts[r])
        .copy_(padded.narrow(0, static_cast<int64_t>(r) * most, counts[r]));
    offset += counts[r];
  }
}

}  // namespace dtrain::comm
