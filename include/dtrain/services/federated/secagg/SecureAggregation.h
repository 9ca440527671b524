// Secure aggregation (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving
// Machine Learning", CCS 2017; the semi-honest protocol): the server learns the sum of the
// round's client inputs and nothing about any single one, even when clients drop out.
//
// Inputs are vectors of integers modulo 2^32 (updates in fixed point: to_fixed). Each client u
//  0. makes two X25519 key pairs, c (to encrypt shares) and s (to agree masks), and advertises
//     the public halves;
//  1. draws a self-mask seed b_u, cuts s_u's secret key and b_u into Shamir t-of-n shares (over
//     GF(2^61 - 1), 4 bytes of secret per field element), and sends each other client v its
//     shares encrypted for v (crypto_box with X25519 + XChaCha20-Poly1305; the server only
//     forwards ciphertexts);
//  2. sends y_u = x_u + PRG(b_u) + sum over v of +-PRG(s_uv) (mod 2^32), s_uv the X25519
//     agreement of u's and v's s keys, the sign by id order, PRG = the ChaCha20 keystream;
//  3. for the clients that sent y (U3), reveals its shares of their b; for those that shared
//     keys but sent no y (dropped), its shares of their s secret keys.
// The server rebuilds each survivor's b and each dropped client's s key from any t shares,
// removes the self masks and the pairwise masks left by dropped clients, and obtains exactly
// the sum of the survivors' x (pairwise masks between survivors cancel). With fewer than t
// clients at any step the round aborts with an error saying how many were left.
//
// SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
// CCS 2020): the same steps on a sparse graph. The round's clients sit on a random k-regular
// graph drawn from the round's seed (neighbour_graph); a client shares its secrets and agrees
// pairwise masks only with its k neighbours, t is a threshold within each neighbourhood (k + 1
// holders, the client's own share included), and recovery removes a dropped client's masks from
// its surviving neighbours only. A client's work grows with k ~ log n instead of n; the server's
// with dropped clients x k instead of dropped x survivors.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::services::federated::secagg {

using Key = std::array<uint8_t, 32>;

/// Fixed point modulo 2^32: round(x * 2^frac_bits), each element clipped to +-bound first (so
/// that `clients` inputs cannot overflow the sum: bound <= (2^31 - 1) / (2^frac_bits clients)).
/// Returns int32 (two's complement of the residue).
at::Tensor to_fixed(const at::Tensor& x, int frac_bits, double bound);
/// The largest bound for `clients` inputs at `frac_bits`.
double fixed_bound(int frac_bits, int64_t clients);
/// A sum of fixed-point values back to float64.
at::Tensor from_fixed(const at::Tensor& sum, int frac_bits);

struct PublicKeys {
  uint32_t id = 0;
  Key c_public{}, s_public{};
};

/// u's shares for v, encrypted for v.
struct SealedShares {
  uint32_t from = 0, to = 0;
  std::vector<uint8_t> ciphertext;
};

/// What a surviving client reveals in step 3: (owner id, share) pairs.
struct Reveal {
  uint32_t from = 0;
  std::map<uint32_t, std::vector<uint64_t>> b_shares;   // survivors' self-mask seeds
  std::map<uint32_t, std::vector<uint64_t>> sk_shares;  // dropped clients' s secret keys
};

/// A client's side of one round. Ids are 1..2^32-1 (0 is not a Shamir point), unique per round.
class ClientSession {
 public:
  ClientSession(uint32_t id, int64_t elements, int threshold);
  ~ClientSession();
  uint32_t id() const;
  /// SecAgg+: this client's neighbours on the round's graph (before share_keys); shares and
  /// masks go to them only. Not called: every client of the round (the classic protocol).
  void set_neighbours(const std::vector<uint32_t>& neighbours);
  /// Step 0.
  PublicKeys advertise();
  /// Step 1: the round's advertised keys (U1, this client's included) -> its sealed shares,
  /// one per other client.
  std::vector<SealedShares> share_keys(const std::vector<PublicKeys>& u1);
  /// The sealed shares addressed to this client; throws Error naming the sender whose
  /// ciphertext does not open.
  void receive(const std::vector<SealedShares>& mine);
  /// Step 2: the masked input (int32 holding residues mod 2^32) for the clients that shared
  /// keys (U2, this client's included).
  at::Tensor masked_input(const at::Tensor& fixed, const std::vector<uint32_t>& u2);
  /// Step 3: the shares the server needs, given the clients that sent masked input (U3).
  Reveal reveal(const std::vector<uint32_t>& u3);
  /// Masks expanded so far (self and pairwise: the protocol's ChaCha20 work, in model sizes).
  int64_t mask_expansions() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// The server's side of one round: collects, routes and unmasks.
class ServerSession {
 public:
  ServerSession(int64_t elements, int threshold);
  ~ServerSession();
  /// SecAgg+: the round's graph (neighbour_graph); shares are routed along its edges only and a
  /// dropped client's masks removed from its neighbours only.
  void set_graph(std::map<uint32_t, std::vector<uint32_t>> graph);
  void add_keys(const PublicKeys& keys);
  /// U1 (at least `threshold` clients, else Error).
  std::vector<PublicKeys> advertised() const;
  void add_shares(const std::vector<SealedShares>& from_one_client);
  /// U2: the clients that sent shares; and what each of them is to receive.
  std::vector<uint32_t> shared() const;
  std::vector<SealedShares> shares_for(uint32_t client) const;
  /// Adds a survivor's masked input to the running sum (the server keeps one sum, not the inputs).
  void add_masked(uint32_t client, const at::Tensor& masked);
  /// U3 (at least `threshold`, else Error).
  std::vector<uint32_t> masked() const;
  void add_reveal(const Reveal& reveal);
  /// The sum of the survivors' inputs mod 2^32 (int32). Error when fewer than `threshold`
  /// clients revealed, naming how many did.
  at::Tensor finish();
  /// Clients whose inputs are in the sum.
  int64_t survivors() const;
  /// Masks finish() expanded (the survivors' self masks, the dropped clients' pairwise ones).
  int64_t mask_expansions() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Shamir sharing over GF(2^61 - 1), exposed for tests: `secret` (each element < 2^61 - 1) into
/// shares for points 1..n, any `threshold` of which rebuild it.
std::vector<std::vector<uint64_t>> shamir_split(const std::vector<uint64_t>& secret, int threshold,
                                                const std::vector<uint32_t>& points);
std::vector<uint64_t> shamir_join(const std::map<uint32_t, std::vector<uint64_t>>& shares);

/// SecAgg+'s graph over the round's client ids: a Harary graph H(k, n) on a random ring order
/// drawn from `seed` (each client joined to the k/2 before and the k/2 after it), so every
/// client has exactly k neighbours. InputError unless k is even and 2 <= k < n (k >= n - 1
/// would be the full graph: use the classic protocol).
std::map<uint32_t, std::vector<uint32_t>> neighbour_graph(std::vector<uint32_t> ids, int degree,
                                                          uint64_t seed);
/// The degree SecAgg+ uses by default for n clients: the smallest even k >= 2 log2(n), at most
/// the largest even degree below n - 1 (0 when n < 4: no graph sparser than the full one).
int default_degree(int64_t n);
/// --secagg-graph "auto" as parse_secagg_graph gives it.
constexpr int kAutoGraph = -2;
/// --secagg-graph: "full" (0: the classic protocol), "log" (-1: default_degree of the round),
/// "auto" (kAutoGraph: auto_degree) or an even degree K >= 2; InputError naming the flag
/// otherwise.
int parse_secagg_graph(const std::string& text);
/// The degree a round of n clients uses for the flag's value (0: the full graph); InputError
/// when a given K is not below n - 1 (larger than the round). "auto" sizes it for
/// `threshold_fraction` (--secagg-threshold) and the expected `dropout` rate.
int round_degree(int graph, int64_t n, double threshold_fraction = 0, double dropout = 0);
/// P(X < t) for X ~ Binomial(m, q).
double binomial_below(int64_t m, double q, int64_t t);
/// An upper bound on the probability that a round of n clients, each leaving independently with
/// probability `dropout` after sharing keys, cannot be unmasked (some secret has fewer than t
/// shares among its holders left): degree 0 is the full graph.
double unmask_failure_bound(int64_t n, int degree, int threshold, double dropout);
/// SecAgg+'s degree sized for a dropout rate (Bell et al. size k from it): the smallest even
/// k >= default_degree(n) (in steps of about 6%) whose unmask_failure_bound, with t =
/// secagg_threshold(threshold_fraction, k + 1), is at most `max_failure`; the full graph (0)
/// when no sparser one is enough (the most holders a round can have, even where that is not
/// enough either: check_auto_graph refuses that case up front). default_degree(n) when
/// `dropout` is 0.
int auto_degree(int64_t n, double threshold_fraction, double dropout, double max_failure = 1e-3);
/// InputError naming the flags when not even the full graph of n meets `max_failure` at that
/// dropout rate (the threshold above the survivors' share): the start-up check of "auto".
void check_auto_graph(int64_t n, double threshold_fraction, double dropout,
                      double max_failure = 1e-3);
/// One line for the user: the degree auto_degree chose, t, and the bound.
std::string describe_auto_degree(int64_t n, double threshold_fraction, double dropout,
                                 double max_failure = 1e-3);
/// t: `fraction` of the `holders` of a client's shares (all n, or degree + 1 with SecAgg+),
/// rounded up; 0 = a majority; at least 2.
int secagg_threshold(double fraction, int holders);

/// The ChaCha20 keystream of `seed` as `elements` int32 (the PRG), made a block at a time as
/// every mask is (the same words as one call over the whole length).
at::Tensor expand_mask(const Key& seed, int64_t elements);

}  // namespace dtrain::services::federated::secagg
