#include "dtrain/services/federated/secagg/SecureAggregation.h"

#include <ATen/ATen.h>
#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <unordered_map>

#include "dtrain/common/Error.h"
#include "services/federated/secagg/SecAggMasks.h"

namespace dtrain::services::federated::secagg {

namespace {

// ---- GF(2^61 - 1) ----
constexpr uint64_t kPrime = (uint64_t{1} << 61) - 1;
constexpr int kWords = 8;  // a 32-byte secret as 8 field elements of 4 bytes

uint64_t reduce(unsigned __int128 x) {
  uint64_t r = static_cast<uint64_t>(x & kPrime) + static_cast<uint64_t>(x >> 61);
  r = (r & kPrime) + (r >> 61);
  return r >= kPrime ? r - kPrime : r;
}
uint64_t mul(uint64_t a, uint64_t b) { return reduce(static_cast<unsigned __int128>(a) * b); }
uint64_t add(uint64_t a, uint64_t b) { return reduce(static_cast<unsigned __int128>(a) + b); }
uint64_t sub(uint64_t a, uint64_t b) { return add(a, kPrime - b); }
uint64_t power(uint64_t a, uint64_t e) {
  uint64_t r = 1;
  for (; e > 0; e >>= 1, a = mul(a, a)) {
    if (e & 1) r = mul(r, a);
  }
  return r;
}
uint64_t inverse(uint64_t a) { return power(a, kPrime - 2); }

uint64_t random_element() {
  for (;;) {
    uint64_t x = 0;
    randombytes_buf(&x, sizeof x);
    x &= kPrime;  // 61 bits
    if (x < kPrime) return x;
  }
}

void init_sodium() { DTRAIN_CHECK(sodium_init() >= 0, "libsodium failed to initialize"); }

std::vector<uint64_t> words_of(const Key& key) {
  std::vector<uint64_t> words(kWords);
  for (int i = 0; i < kWords; ++i) {
    uint32_t w = 0;
    std::memcpy(&w, key.data() + 4 * i, 4);
    words[i] = w;
  }
  return words;
}

Key key_of(const std::vector<uint64_t>& words) {
  Key key{};
  for (int i = 0; i < kWords; ++i) {
    DTRAIN_CHECK(words[i] <= 0xffffffffULL, "a rebuilt secret word is out of range (bad shares)");
    const auto w = static_cast<uint32_t>(words[i]);
    std::memcpy(key.data() + 4 * i, &w, 4);
  }
  return key;
}

// The pairwise mask seed of ids a and b: BLAKE2b-256 of the X25519 agreement and both public
// keys in id order (both sides compute the same).
Key pairwise_seed(const Key& my_secret, uint32_t me, const Key& my_public, uint32_t other,
                  const Key& other_public) {
  Key shared{};
  DTRAIN_CHECK_T(Error,
                 crypto_scalarmult(shared.data(), my_secret.data(), other_public.data()) == 0,
                 "secure aggregation: client ", other, "'s public key is degenerate");
  const Key& lo = me < other ? my_public : other_public;
  const Key& hi = me < other ? other_public : my_public;
  crypto_generichash_state state;
  crypto_generichash_init(&state, nullptr, 0, 32);
  crypto_generichash_update(&state, shared.data(), shared.size());
  crypto_generichash_update(&state, lo.data(), lo.size());
  crypto_generichash_update(&state, hi.data(), hi.size());
  Key seed{};
  crypto_generichash_final(&state, seed.data(), seed.size());
  sodium_memzero(shared.data(), shared.size());
  return seed;
}

uint32_t* words(at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()); }

constexpr size_t kShareBytes = 8 + 2 * kWords * 8;  // from, to, b share, s-key share

}  // namespace

// ---- fixed point ----

double fixed_bound(int frac_bits, int64_t clients) {
  DTRAIN_CHECK_INPUT(frac_bits >= 0 && frac_bits <= 30 && clients >= 1,
                     "fixed point needs 0 <= fraction bits <= 30 and >= 1 client");
  return (std::ldexp(1.0, 31) - 1) / (std::ldexp(1.0, frac_bits) * static_cast<double>(clients));
}

at::Tensor to_fixed(const at::Tensor& x, int frac_bits, double bound) {
  DTRAIN_CHECK(bound > 0 && bound * std::ldexp(1.0, frac_bits) < std::ldexp(1.0, 31),
               "a fixed-point bound of ", bound, " at ", frac_bits, " fraction bits overflows");
  return (x.to(at::kDouble).clamp(-bound, bound) * std::ldexp(1.0, frac_bits))
      .round()
      .to(at::kInt)
      .contiguous();
}

at::Tensor from_fixed(const at::Tensor& sum, int frac_bits) {
  return sum.to(at::kDouble) / std::ldexp(1.0, frac_bits);
}

// ---- Shamir ----

std::vector<std::vector<uint64_t>> shamir_split(const std::vector<uint64_t>& secret, int threshold,
                                                const std::vector<uint32_t>& points) {
  init_sodium();
  DTRAIN_CHECK(threshold >= 1 && static_cast<size_t>(threshold) <= points.size(),
               "Shamir: threshold ", threshold, " of ", points.size(), " points");
  std::vector<std::vector<uint64_t>> shares(points.size(), std::vector<uint64_t>(secret.size()));
  std::vector<uint64_t> coefficients(static_cast<size_t>(threshold));
  for (size_t w = 0; w < secret.size(); ++w) {
    DTRAIN_CHECK(secret[w] < kPrime, "Shamir: a secret word outside the field");
    coefficients[0] = secret[w];
    for (int i = 1; i < threshold; ++i) coefficients[i] = random_element();
    for (size_t p = 0; p < points.size(); ++p) {
      DTRAIN_CHECK(points[p] != 0, "Shamir: point 0 would reveal the secret");
      uint64_t value = 0;  // Horner
      for (int i = threshold - 1; i >= 0; --i) value = add(mul(value, points[p]), coefficients[i]);
      shares[p][w] = value;
    }
  }
  sodium_memzero(coefficients.data(), coefficients.size() * sizeof(uint64_t));
  return shares;
}

std::vector<uint64_t> shamir_join(const std::map<uint32_t, std::vector<uint64_t>>& shares) {
  DTRAIN_CHECK(!shares.empty(), "Shamir: no shares");
  const size_t n_words = shares.begin()->second.size();
  std::vector<uint64_t> secret(n_words, 0);
  for (const auto& [xj, share] : shares) {
    DTRAIN_CHECK(share.size() == n_words, "Shamir: shares of different sizes");
    // The Lagrange basis at 0: prod over m != j of x_m / (x_m - x_j).
    uint64_t num = 1, den = 1;
    for (const auto& other : shares) {
      const uint32_t xm = other.first;
      if (xm == xj) continue;
      num = mul(num, xm);
      den = mul(den, sub(xm, xj));
    }
    const uint64_t basis = mul(num, inverse(den));
    for (size_t w = 0; w < n_words; ++w) secret[w] = add(secret[w], mul(share[w], basis));
  }
  return secret;
}

// ---- the client ----

struct ClientSession::State {
  uint32_t id = 0;
  int64_t elements = 0;
  int threshold = 0;
  Key c_public{}, c_secret{}, s_public{}, s_secret{}, b{};
  std::map<uint32_t, PublicKeys> keys;  // U1
  // Shares held for each owner (this client's own included): of b and of s's secret key.
  std::map<uint32_t, std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> held;
  std::set<uint32_t> masked_for;  // U2 as used for the masked input
  bool revealed = false;
  int64_t expansions = 0;
  bool graph = false;  // SecAgg+: only these neighbours
  std::set<uint32_t> neighbours;

  ~State() {
    sodium_memzero(c_secret.data(), c_secret.size());
    sodium_memzero(s_secret.data(), s_secret.size());
    sodium_memzero(b.data(), b.size());
  }
};

ClientSession::ClientSession(uint32_t id, int64_t elements, int threshold)
    : state_(std::make_unique<State>()) {
  init_sodium();
  DTRAIN_CHECK_INPUT(id != 0, "secure aggregation: client id 0 is reserved");
  DTRAIN_CHECK_INPUT(threshold >= 2, "secure aggregation needs a threshold >= 2, got ", threshold);
  State& s = *state_;
  s.id = id;
  s.elements = elements;
  s.threshold = threshold;
  crypto_box_curve25519xchacha20poly1305_keypair(s.c_public.data(), s.c_secret.data());
  randombytes_buf(s.s_secret.data(), s.s_secret.size());
  crypto_scalarmult_base(s.s_public.data(), s.s_secret.data());
  randombytes_buf(s.b.data(), s.b.size());
}

ClientSession::~ClientSession() = default;

uint32_t ClientSession::id() const { return state_->id; }

void ClientSession::set_neighbours(const std::vector<uint32_t>& neighbours) {
  state_->graph = true;
  state_->neighbours = std::set<uint32_t>(neighbours.begin(), neighbours.end());
  state_->neighbours.erase(state_->id);
}

PublicKeys ClientSession::advertise() {
  return PublicKeys{state_->id, state_->c_public, state_->s_public};
}

std::vector<SealedShares> ClientSession::share_keys(const std::vector<PublicKeys>& u1) {
  State& s = *state_;
  s.keys.clear();
  for (const auto& k : u1) {
    DTRAIN_CHECK_T(Error, k.id != 0 && s.keys.emplace(k.id, k).second,
                   "secure aggregation: client ", k.id, " is advertised twice (or is 0)");
  }
  DTRAIN_CHECK_T(Error, s.keys.count(s.id) == 1 && s.keys.at(s.id).s_public == s.s_public,
                 "secure aggregation: client ", s.id, "'s own keys are not among those advertised");
  DTRAIN_CHECK_T(Error, static_cast<int>(s.keys.size()) >= s.threshold,
                 "secure aggregation: ", s.keys.size(),
                 " clients advertised keys, fewer than the threshold ", s.threshold);
  std::vector<uint32_t> points;
  for (const auto& entry : s.keys) {
    if (!s.graph || entry.first == s.id || s.neighbours.count(entry.first) > 0) {
      points.push_back(entry.first);
    }
  }
  DTRAIN_CHECK_T(Error, static_cast<int>(points.size()) >= s.threshold,
                 "secure aggregation: client ", s.id, " has ", points.size() - 1,
                 " neighbours with keys, fewer than the threshold ", s.threshold, " needs");
  const auto b_shares = shamir_split(words_of(s.b), s.threshold, points);
  const auto sk_shares = shamir_split(words_of(s.s_secret), s.threshold, points);
  std::vector<SealedShares> out;
  for (size_t p = 0; p < points.size(); ++p) {
    const uint32_t to = points[p];
    if (to == s.id) {
      s.held[s.id] = {b_shares[p], sk_shares[p]};
      continue;
    }
    std::vector<uint8_t> plain(kShareBytes);
    std::memcpy(plain.data(), &s.id, 4);
    std::memcpy(plain.data() + 4, &to, 4);
    std::memcpy(plain.data() + 8, b_shares[p].data(), kWords * 8);
    std::memcpy(plain.data() + 8 + kWords * 8, sk_shares[p].data(), kWords * 8);
    SealedShares sealed;
    sealed.from = s.id;
    sealed.to = to;
    sealed.ciphertext.resize(crypto_box_curve25519xchacha20poly1305_NONCEBYTES + plain.size() +
                             crypto_box_curve25519xchacha20poly1305_MACBYTES);
    uint8_t* nonce = sealed.ciphertext.data();
    randombytes_buf(nonce, crypto_box_curve25519xchacha20poly1305_NONCEBYTES);
    DTRAIN_CHECK(crypto_box_curve25519xchacha20poly1305_easy(
                     nonce + crypto_box_curve25519xchacha20poly1305_NONCEBYTES, plain.data(),
                     plain.size(), nonce, s.keys.at(to).c_public.data(), s.c_secret.data()) == 0,
                 "secure aggregation: encrypting shares for client ", to, " failed");
    sodium_memzero(plain.data(), plain.size());
    out.push_back(std::move(sealed));
  }
  return out;
}

void ClientSession::receive(const std::vector<SealedShares>& mine) {
  State& s = *state_;
  for (const auto& sealed : mine) {
    const auto sender = s.keys.find(sealed.from);
    DTRAIN_CHECK_T(Error, sealed.to == s.id && sender != s.keys.end(),
                   "secure aggregation: shares from client ", sealed.from, " for client ",
                   sealed.to, " reached client ", s.id);
    constexpr size_t overhead = crypto_box_curve25519xchacha20poly1305_NONCEBYTES +
                                crypto_box_curve25519xchacha20poly1305_MACBYTES;
    std::vector<uint8_t> plain(kShareBytes);
    const bool opened =
        sealed.ciphertext.size() == kShareBytes + overhead &&
        crypto_box_curve25519xchacha20poly1305_open_easy(
            plain.data(),
            sealed.ciphertext.data() + crypto_box_curve25519xchacha20poly1305_NONCEBYTES,
            sealed.ciphertext.size() - crypto_box_curve25519xchacha20poly1305_NONCEBYTES,
            sealed.ciphertext.data(), sender->second.c_public.data(), s.c_secret.data()) == 0;
    uint32_t from = 0, to = 0;
    std::memcpy(&from, plain.data(), 4);
    std::memcpy(&to, plain.data() + 4, 4);
    DTRAIN_CHECK_T(Error, opened && from == sealed.from && to == s.id,
                   "secure aggregation: the shares from client ", sealed.from,
                   " do not open (tampered with, or not for client ", s.id, ")");
    std::vector<uint64_t> b(kWords), sk(kWords);
    std::memcpy(b.data(), plain.data() + 8, kWords * 8);
    std::memcpy(sk.data(), plain.data() + 8 + kWords * 8, kWords * 8);
    sodium_memzero(plain.data(), plain.size());
    s.held[sealed.from] = {std::move(b), std::move(sk)};
  }
}

at::Tensor ClientSession::masked_input(const at::Tensor& fixed, const std::vector<uint32_t>& u2) {
  State& s = *state_;
  DTRAIN_CHECK(fixed.scalar_type() == at::kInt && fixed.dim() == 1 && fixed.numel() == s.elements,
               "secure aggregation: the input must be ", s.elements, " int32 (fixed point)");
  std::set<uint32_t> others;
  for (const uint32_t v : u2) {
    if (!s.graph || v == s.id || s.neighbours.count(v) > 0) others.insert(v);
  }
  DTRAIN_CHECK_T(Error, others.count(s.id) == 1, "secure aggregation: client ", s.id,
                 " is not among the clients that shared keys");
  DTRAIN_CHECK_T(Error, static_cast<int>(others.size()) >= s.threshold,
                 "secure aggregation: ", others.size(),
                 " clients shared keys, fewer than the threshold ", s.threshold);
  at::Tensor y = fixed.clone();
  MaskPasses passes;
  passes.emplace_back().seed = s.b;
  for (uint32_t v : others) {
    if (v == s.id) continue;
    const auto k = s.keys.find(v);
    DTRAIN_CHECK_T(Error, k != s.keys.end(), "secure aggregation: client ", v,
                   " shared keys without advertising them");
    MaskPass& pass = passes.emplace_back();
    pass.seed = pairwise_seed(s.s_secret, s.id, s.s_public, v, k->second.s_public);
    pass.subtract = s.id > v;
  }
  apply_masks(words(y), s.elements, passes);
  s.expansions += static_cast<int64_t>(passes.size());
  s.masked_for = others;
  return y;
}

Reveal ClientSession::reveal(const std::vector<uint32_t>& u3) {
  State& s = *state_;
  const std::set<uint32_t> survivors(u3.begin(), u3.end());
  DTRAIN_CHECK_T(Error, !s.masked_for.empty(), "secure aggregation: client ", s.id,
                 " is asked to reveal before it sent its masked input");
  DTRAIN_CHECK_T(Error, !s.revealed, "secure aggregation: client ", s.id,
                 " is asked to reveal twice");
  DTRAIN_CHECK_T(Error, static_cast<int>(survivors.size()) >= s.threshold,
                 "secure aggregation: ", survivors.size(),
                 " clients sent masked inputs, fewer than the threshold ", s.threshold);
  s.revealed = true;
  Reveal out;
  out.from = s.id;
  for (const uint32_t owner : s.masked_for) {
    const auto held = s.held.find(owner);
    if (held == s.held.end()) continue;
    // Never both for one client: b only for those whose input is in the sum, the mask key
    // only for those whose input is not.
    if (survivors.count(owner) > 0) {
      out.b_shares[owner] = held->second.first;
    } else {
      out.sk_shares[owner] = held->second.second;
    }
  }
  return out;
}

// ---- the server ----

struct ServerSession::State {
  int64_t elements = 0;
  int threshold = 0;
  // Hash maps: routing n (k + 1) shares looks a client up three times each (at n = 1000 the
  // routing took ~45 ms of the server's 0.35 s through std::maps, ~30 ms through these).
  std::unordered_map<uint32_t, PublicKeys> keys;
  std::unordered_map<uint32_t, std::vector<SealedShares>> inbox;  // recipient -> sealed shares
  std::set<uint32_t> shared;
  std::set<uint32_t> masked;  // who sent a masked input
  at::Tensor sum;             // their sum, added as they arrive (int32 words, modulo 2^32)
  std::vector<Reveal> reveals;
  int64_t survivors = 0, expansions = 0;
  std::unordered_map<uint32_t, std::vector<uint32_t>> graph;  // SecAgg+ (empty: full graph)
  bool joined(uint32_t u, uint32_t v) const {
    if (graph.empty()) return true;
    const auto found = graph.find(u);
    return found != graph.end() &&
           std::binary_search(found->second.begin(), found->second.end(), v);
  }
};

ServerSession::ServerSession(int64_t elements, int threshold) : state_(std::make_unique<State>()) {
  init_sodium();
  DTRAIN_CHECK_INPUT(threshold >= 2, "secure aggregation needs a threshold >= 2, got ", threshold);
  state_->elements = elements;
  state_->threshold = threshold;
}

ServerSession::~ServerSession() = default;

void ServerSession::set_graph(std::map<uint32_t, std::vector<uint32_t>> graph) {
  state_->graph.clear();
  for (auto& entry : graph) {
    std::sort(entry.second.begin(), entry.second.end());
    state_->graph.emplace(entry.first, std::move(entry.second));
  }
}

void ServerSession::add_keys(const PublicKeys& keys) {
  DTRAIN_CHECK_T(Error, keys.id != 0 && state_->keys.emplace(keys.id, keys).second,
                 "secure aggregation: client ", keys.id, " advertised keys twice (or is 0)");
}

std::vector<PublicKeys> ServerSession::advertised() const {
  DTRAIN_CHECK_T(Error, static_cast<int>(state_->keys.size()) >= state_->threshold,
                 "secure aggregation: ", state_->keys.size(),
                 " clients advertised keys, fewer than the threshold ", state_->threshold,
                 "; the round is aborted");
  std::vector<PublicKeys> out;
  for (const auto& entry : state_->keys) out.push_back(entry.second);
  std::sort(out.begin(), out.end(),
            [](const PublicKeys& a, const PublicKeys& b) { return a.id < b.id; });
  return out;
}

void ServerSession::add_shares(const std::vector<SealedShares>& from_one_client) {
  State& s = *state_;
  if (from_one_client.empty()) return;
  const uint32_t from = from_one_client.front().from;
  DTRAIN_CHECK_T(Error, s.keys.count(from) == 1 && s.shared.insert(from).second,
                 "secure aggregation: shares from client ", from,
                 " (not advertised, or sent twice)");
  for (const auto& sealed : from_one_client) {
    DTRAIN_CHECK_T(Error,
                   sealed.from == from && s.keys.count(sealed.to) == 1 && s.joined(from, sealed.to),
                   "secure aggregation: client ", from, " sent shares for client ", sealed.to,
                   s.graph.empty() ? "" : " (not its neighbour)");
    s.inbox[sealed.to].push_back(sealed);
  }
}

std::vector<uint32_t> ServerSession::shared() const {
  DTRAIN_CHECK_T(Error, static_cast<int>(state_->shared.size()) >= state_->threshold,
                 "secure aggregation: ", state_->shared.size(),
                 " clients shared their keys, fewer than the threshold ", state_->threshold,
                 "; the round is aborted");
  return {state_->shared.begin(), state_->shared.end()};
}

std::vector<SealedShares> ServerSession::shares_for(uint32_t client) const {
  std::vector<SealedShares> out;
  const auto found = state_->inbox.find(client);
  if (found == state_->inbox.end()) return out;
  for (const auto& sealed : found->second) {
    if (state_->shared.count(sealed.from)) out.push_back(sealed);
  }
  return out;
}

void ServerSession::add_masked(uint32_t client, const at::Tensor& masked) {
  State& s = *state_;
  DTRAIN_CHECK_T(Error, s.shared.count(client) == 1, "secure aggregation: a masked input from ",
                 "client ", client, ", which did not share keys");
  DTRAIN_CHECK_T(
      Error, masked.scalar_type() == at::kInt && masked.dim() == 1 && masked.numel() == s.elements,
      "secure aggregation: client ", client, "'s masked input holds ", masked.numel(), " ",
      masked.scalar_type(), " elements, expected ", s.elements, " int32");
  DTRAIN_CHECK_T(Error, s.masked.insert(client).second, "secure aggregation: client ", client,
                 " sent its masked input twice");
  // Summed on arrival: the server holds one model-sized sum, not an input per client.
  if (!s.sum.defined()) s.sum = at::zeros({s.elements}, at::kInt);
  const at::Tensor y = masked.contiguous();
  add_words(words(s.sum), reinterpret_cast<const uint32_t*>(y.data_ptr<int32_t>()), s.elements,
            false);
}

std::vector<uint32_t> ServerSession::masked() const {
  DTRAIN_CHECK_T(Error, static_cast<int>(state_->masked.size()) >= state_->threshold,
                 "secure aggregation: ", state_->masked.size(),
                 " clients sent masked inputs, fewer than the threshold ", state_->threshold,
                 "; the round is aborted");
  std::vector<uint32_t> out;
  for (const uint32_t id : state_->masked) out.push_back(id);
  return out;
}

void ServerSession::add_reveal(const Reveal& reveal) {
  DTRAIN_CHECK_T(Error, state_->masked.count(reveal.from) == 1,
                 "secure aggregation: shares revealed by client ", reveal.from,
                 ", whose input is not in the sum");
  state_->reveals.push_back(reveal);
}

at::Tensor ServerSession::finish() {
  State& s = *state_;
  DTRAIN_CHECK_T(Error, static_cast<int>(s.reveals.size()) >= s.threshold,
                 "secure aggregation: ", s.reveals.size(),
                 " clients revealed their shares, fewer than the threshold ", s.threshold,
                 "; the masks cannot be removed and the round is aborted");
  at::Tensor sum = s.sum.defined() ? std::move(s.sum) : at::zeros({s.elements}, at::kInt);
  // The revealed shares of each owner's secret, in the order the reveals came (one pass over
  // them, instead of one per owner).
  using Held = std::vector<std::pair<uint32_t, const std::vector<uint64_t>*>>;
  std::unordered_map<uint32_t, Held> b_held, sk_held;
  for (const auto& r : s.reveals) {
    for (const auto& [owner, share] : r.b_shares) b_held[owner].emplace_back(r.from, &share);
    for (const auto& [owner, share] : r.sk_shares) sk_held[owner].emplace_back(r.from, &share);
  }
  // Any `threshold` shares of one owner's secret.
  auto rebuild = [&](uint32_t owner, bool self_mask) {
    std::map<uint32_t, std::vector<uint64_t>> shares;
    const auto& held = self_mask ? b_held : sk_held;
    const auto found = held.find(owner);
    if (found != held.end()) {
      for (const auto& [from, share] : found->second) {
        if (share->size() == kWords) shares[from] = *share;
        if (static_cast<int>(shares.size()) == s.threshold) break;
      }
    }
    DTRAIN_CHECK_T(Error, static_cast<int>(shares.size()) >= s.threshold,
                   "secure aggregation: ", shares.size(), " shares of client ", owner, "'s ",
                   self_mask ? "self mask" : "mask key", ", fewer than the threshold ", s.threshold,
                   "; the round is aborted",
                   s.graph.empty() ? ""
                                   : " (SecAgg+: too few of its neighbours survived; a larger "
                                     "--secagg-graph degree or a lower --secagg-threshold makes "
                                     "this rarer at this dropout rate)");
    return key_of(shamir_join(shares));
  };
  // Every mask to take out of the inputs' sum, taken out together a tile at a time
  // (apply_masks): the survivors' self masks, then the dropped clients' pairwise masks.
  MaskPasses passes;
  for (const uint32_t id : s.masked) {
    MaskPass& pass = passes.emplace_back();
    pass.seed = rebuild(id, true);
    pass.subtract = true;
  }
  for (const uint32_t v : s.shared) {
    if (s.masked.count(v)) continue;
    // Dropped after sharing keys: its pairwise masks stay in the survivors' inputs.
    Key secret = rebuild(v, false);
    Key check{};
    crypto_scalarmult_base(check.data(), secret.data());
    DTRAIN_CHECK_T(Error, check == s.keys.at(v).s_public,
                   "secure aggregation: the shares of "
                   "client ",
                   v, "'s mask key do not rebuild it (a client revealed bad shares)");
    for (const uint32_t u : s.masked) {
      if (!s.joined(v, u)) continue;  // SecAgg+: only its neighbours hold its masks
      MaskPass& pass = passes.emplace_back();
      pass.seed = pairwise_seed(secret, v, s.keys.at(v).s_public, u, s.keys.at(u).s_public);
      // u added +PRG when u < v, -PRG otherwise: take it back out.
      pass.subtract = u < v;
    }
    sodium_memzero(secret.data(), secret.size());
  }
  apply_masks(words(sum), s.elements, passes);
  s.expansions += static_cast<int64_t>(passes.size());
  s.survivors = static_cast<int64_t>(s.masked.size());
  return sum;
}

int64_t ServerSession::survivors() const { return state_->survivors; }

int64_t ServerSession::mask_expansions() const { return state_->expansions; }

int64_t ClientSession::mask_expansions() const { return state_->expansions; }

}  // namespace dtrain::services::federated::secagg
