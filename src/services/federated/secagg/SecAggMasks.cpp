#include "services/federated/secagg/SecAggMasks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated::secagg {

namespace {

// Four words at a time (GCC's and Clang's vector extensions): at -O2 the compiler leaves these
// loops scalar (out and m might alias), and then adding a keystream costs half as much as
// making it.
using Words4 = uint32_t __attribute__((vector_size(16)));
Words4 load4(const uint32_t* p) {
  Words4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store4(uint32_t* p, Words4 v) { std::memcpy(p, &v, sizeof v); }

}  // namespace

void add_words(uint32_t* out, const uint32_t* m, int64_t count, bool subtract) {
  int64_t i = 0;
  if (subtract) {
    for (; i + 4 <= count; i += 4) store4(out + i, load4(out + i) - load4(m + i));
    for (; i < count; ++i) out[i] -= m[i];
  } else {
    for (; i + 4 <= count; i += 4) store4(out + i, load4(out + i) + load4(m + i));
    for (; i < count; ++i) out[i] += m[i];
  }
}

// total +-= PRG(seed) for every pass, a tile of `total` at a time: the tile stays in L1 while
// each pass makes its keystream for it (the same words as one model-sized expansion: the tile
// at word `start` begins at ChaCha20 counter start / 16) and adds it, so a mask costs its
// ChaCha20 work and a pass over an L1 tile instead of one over the whole sum.
void apply_masks(uint32_t* total, int64_t n, const MaskPasses& passes) {
  constexpr int64_t kTile = 1024;  // words: 4 KiB, with the keystream and the zeros in L1
  static const uint32_t zeros[kTile] = {};
  alignas(64) uint32_t m[kTile];
  const unsigned char nonce[crypto_stream_chacha20_ietf_NONCEBYTES] = {};
  for (int64_t start = 0; start < n; start += kTile) {
    const int64_t count = std::min(kTile, n - start);
    for (const MaskPass& pass : passes) {
      crypto_stream_chacha20_ietf_xor_ic(reinterpret_cast<unsigned char*>(m),
                                         reinterpret_cast<const unsigned char*>(zeros),
                                         static_cast<unsigned long long>(count) * 4, nonce,
                                         static_cast<uint32_t>(start / 16), pass.seed.data());
      add_words(total + start, m, count, pass.subtract);
    }
  }
  sodium_memzero(m, sizeof m);
}

at::Tensor expand_mask(const Key& seed, int64_t elements) {
  DTRAIN_CHECK(sodium_init() >= 0, "libsodium failed to initialize");
  // The keystream is what adding one mask to zeros gives, tile by tile (so a test of this
  // against one whole libsodium expansion tests the tiles' counters too).
  at::Tensor out = at::zeros({elements}, at::kInt);
  MaskPasses pass;
  pass.emplace_back().seed = seed;
  apply_masks(reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), elements, pass);
  return out;
}

}  // namespace dtrain::services::federated::secagg
