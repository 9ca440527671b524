// The masks of secure aggregation as they are applied: ChaCha20 keystreams (libsodium) added to
// or subtracted from sums of uint32 words, a cache-sized block at a time; used by the client
// sessions, the server's unmasking and expand_mask (SecureAggregation.cpp).
#pragma once

#include <sodium.h>

#include <cstdint>
#include <deque>

#include "dtrain/services/federated/secagg/SecureAggregation.h"

namespace dtrain::services::federated::secagg {

/// A pairwise (or self) mask to add to or subtract from a sum.
struct MaskPass {
  Key seed{};
  bool subtract = false;
};

/// The masks of one sum; their seeds are wiped however the sum ends (done or thrown out of). A
/// deque: growing it never copies a seed into memory it then frees unwiped.
struct MaskPasses : std::deque<MaskPass> {
  MaskPasses() = default;
  MaskPasses(const MaskPasses&) = delete;
  MaskPasses& operator=(const MaskPasses&) = delete;
  ~MaskPasses() {
    for (MaskPass& pass : *this) sodium_memzero(pass.seed.data(), pass.seed.size());
  }
};

/// out += m or out -= m, modulo 2^32, over `count` words.
void add_words(uint32_t* out, const uint32_t* m, int64_t count, bool subtract);

/// total +-= PRG(seed) for every pass, a tile of `total` at a time: the tile stays in L1 while
/// each pass makes its keystream for it (the same words as one model-sized expansion: the tile
/// at word `start` begins at ChaCha20 counter start / 16) and adds it, so a mask costs its
/// ChaCha20 work and a pass over an L1 tile instead of one over the whole sum.
void apply_masks(uint32_t* total, int64_t n, const MaskPasses& passes);

}  // namespace dtrain::services::federated::secagg
