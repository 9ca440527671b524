// Secure aggregation (Bonawitz et al.): Shamir sharing, the masked sum equal to the plaintext
// sum with and without dropouts (on SecAgg+'s graph too), aborts below the threshold, masked
// uploads indistinguishable from noise, tampered shares, fixed point, the server's step machine,
// and simulated rounds equal to plaintext FedAvg. SecAgg+'s graph and its degree:
// federated_secagg_plus_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include <grpcpp/grpcpp.h>
#include <sodium.h>
#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"

#include <atomic>
#include <thread>

#include "FederatedTesting.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/services/federated/service/Server.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "services/federated/secagg/SecureServerRound.h"
#include "services/federated/service/FlWire.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

// ---- Secure aggregation ----

namespace {

struct SecAggRound {
  at::Tensor sum;                  // the server's result
  at::Tensor plain;                // the survivors' inputs summed in the clear (mod 2^32)
  std::vector<at::Tensor> masked;  // what the server saw from each survivor
};

// n clients with random int32 inputs; `drop_before_masking` of them share keys and then leave,
// `drop_before_reveal` send masked inputs and leave before revealing.
// With `degree` > 0: SecAgg+ on the graph drawn from `graph_seed`.
SecAggRound secure_round(int n, int threshold, int64_t elements, int drop_before_masking,
                         int drop_before_reveal, uint64_t seed = 1, int degree = 0,
                         uint64_t graph_seed = 7) {
  using namespace secagg;
  std::vector<std::unique_ptr<ClientSession>> clients;
  ServerSession server(elements, threshold);
  std::vector<uint32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<uint32_t>(100 + 7 * i));
  std::map<uint32_t, std::vector<uint32_t>> graph;
  if (degree > 0) {
    graph = neighbour_graph(ids, degree, graph_seed);
    server.set_graph(graph);
  }
  for (int i = 0; i < n; ++i) {
    clients.push_back(std::make_unique<ClientSession>(ids[i], elements, threshold));
    if (degree > 0) clients.back()->set_neighbours(graph.at(ids[i]));
    server.add_keys(clients.back()->advertise());
  }
  const auto u1 = server.advertised();
  for (auto& c : clients) server.add_shares(c->share_keys(u1));
  const auto u2 = server.shared();
  for (auto& c : clients) c->receive(server.shares_for(c->id()));
  SecAggRound out;
  out.plain = at::zeros({elements}, at::kLong);
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (int i = drop_before_masking; i < n; ++i) {
    const at::Tensor x =
        at::randint(-(int64_t{1} << 31), int64_t{1} << 31, {elements}, gen, at::kLong).to(at::kInt);
    const at::Tensor y = clients[i]->masked_input(x, u2);
    server.add_masked(clients[i]->id(), y);
    out.masked.push_back(y);
    out.plain += x.to(at::kLong);
  }
  const auto u3 = server.masked();
  for (int i = drop_before_masking + drop_before_reveal; i < n; ++i) {
    server.add_reveal(clients[i]->reveal(u3));
  }
  out.sum = server.finish();
  // The clear sum modulo 2^32, as int32.
  out.plain = (out.plain & int64_t{0xffffffff}).to(at::kInt);
  return out;
}

}  // namespace

// The server's side of a secure round over gRPC, without gRPC: each step is taken only in its
// phase (a late one is named as late), a message whose fields are wrong is named by field, one
// the protocol refuses (a duplicate) is refused, and the replies carry what the phase produced.
TEST(SecureServerRound, StepsAreTakenInTheirPhaseAndBadOnesAreNamedByField) {
  using Request = dtrain::fl::SecAggRequest;
  using Result = SecureServerRound::StepResult;
  SecureServerRound round({"a", "b", "c"}, 0.0, 7, 4);
  EXPECT_EQ(round.threshold, 2);  // a majority of 3
  EXPECT_EQ(round.ids.at("c"), 3u);
  EXPECT_EQ(round.names.at(1), "a");
  EXPECT_EQ(round.ref, 7);
  std::vector<std::unique_ptr<secagg::ClientSession>> clients;
  for (uint32_t id = 1; id <= 3; ++id)
    clients.push_back(std::make_unique<secagg::ClientSession>(id, 6, 2));
  std::vector<secagg::PublicKeys> keys;
  for (auto& c : clients) keys.push_back(c->advertise());
  auto keys_request = [](const secagg::PublicKeys& k) {
    Request r;
    r.set_step(Request::KEYS);
    r.set_send(true);
    r.mutable_keys()->set_id(k.id);
    r.mutable_keys()->set_c_public(k.c_public.data(), 32);
    r.mutable_keys()->set_s_public(k.s_public.data(), 32);
    return r;
  };
  Request shares_early;
  shares_early.set_step(Request::SHARES);
  Result r = round.apply(shares_early, 1);
  EXPECT_EQ(r.kind, Result::Late);
  EXPECT_EQ(r.why, "SHARES");
  r = round.apply(keys_request(keys[1]), 1);  // client 1 sending client 2's keys
  EXPECT_EQ(r.kind, Result::Malformed);
  EXPECT_NE(r.why.find("field 'keys' must carry id 1"), std::string::npos) << r.why;
  Request short_key = keys_request(keys[0]);
  short_key.mutable_keys()->set_s_public("too short");
  EXPECT_EQ(round.apply(short_key, 1).kind, Result::Malformed);
  Request unknown;
  unknown.set_step(static_cast<Request::Step>(9));
  r = round.apply(unknown, 1);
  EXPECT_EQ(r.kind, Result::Malformed);
  EXPECT_NE(r.why.find("field 'step' is 9"), std::string::npos) << r.why;
  for (uint32_t id = 1; id <= 3; ++id) {
    EXPECT_EQ(round.apply(keys_request(keys[id - 1]), id).kind, Result::Applied);
  }
  r = round.apply(keys_request(keys[0]), 1);  // twice
  EXPECT_EQ(r.kind, Result::Refused);
  EXPECT_NE(r.why.find("advertised keys twice"), std::string::npos) << r.why;
  EXPECT_EQ(round.sent_keys, (std::set<uint32_t>{1, 2, 3}));

  round.u1 = round.session->advertised();
  round.phase = SecureServerRound::Shares;
  EXPECT_EQ(round.apply(keys_request(keys[0]), 1).kind, Result::Late);
  dtrain::fl::SecAggReply reply;
  round.fill_reply(Request::KEYS, 2, &reply);
  ASSERT_EQ(reply.keys_size(), 3);
  EXPECT_EQ(reply.keys(2).id(), 3u);
  EXPECT_EQ(reply.keys(2).s_public(),
            std::string(reinterpret_cast<const char*>(keys[2].s_public.data()), 32));
  auto shares_request = [](const std::vector<secagg::SealedShares>& sealed) {
    Request r;
    r.set_step(Request::SHARES);
    r.set_send(true);
    for (const auto& s : sealed) {
      auto* share = r.add_shares();
      share->set_from(s.from);
      share->set_to(s.to);
      share->set_ciphertext(s.ciphertext.data(), s.ciphertext.size());
    }
    return r;
  };
  const auto from_2 = clients[1]->share_keys(round.u1);
  r = round.apply(shares_request(from_2), 1);  // client 1 forwarding client 2's shares
  EXPECT_EQ(r.kind, Result::Malformed);
  EXPECT_NE(r.why.find("field 'from' is 2, not 1"), std::string::npos) << r.why;
  EXPECT_EQ(round.apply(shares_request(from_2), 2).kind, Result::Applied);
  EXPECT_EQ(round.apply(shares_request(clients[0]->share_keys(round.u1)), 1).kind, Result::Applied);
  round.u2 = round.session->shared();
  round.phase = SecureServerRound::Masking;
  reply.Clear();
  round.fill_reply(Request::SHARES, 1, &reply);
  EXPECT_EQ(std::vector<uint32_t>(reply.shared().begin(), reply.shared().end()),
            (std::vector<uint32_t>{1, 2}));
  ASSERT_EQ(reply.inbox_size(), 1);  // client 2's share for client 1 (client 3 sent none)
  EXPECT_EQ(reply.inbox(0).from(), 2u);
  EXPECT_EQ(reply.inbox(0).to(), 1u);

  EXPECT_EQ(SecureServerRound::ready_at(Request::KEYS), SecureServerRound::Shares);
  EXPECT_EQ(SecureServerRound::ready_at(Request::SHARES), SecureServerRound::Masking);
  EXPECT_EQ(SecureServerRound::ready_at(Request::SURVIVORS), SecureServerRound::Reveal);
}

TEST(SecureAggregation, ShamirRebuildsFromAnyThresholdSharesAndNotFromFewer) {
  const std::vector<uint64_t> secret{1, 0xffffffffULL, 12345, 0};
  const std::vector<uint32_t> points{3, 9, 27, 81, 243};
  const auto shares = secagg::shamir_split(secret, 3, points);
  for (const auto& pick :
       std::vector<std::vector<int>>{{0, 1, 2}, {4, 2, 0}, {1, 3, 4}, {0, 1, 2, 3, 4}}) {
    std::map<uint32_t, std::vector<uint64_t>> some;
    for (int i : pick) some[points[i]] = shares[i];
    EXPECT_EQ(secagg::shamir_join(some), secret);
  }
  std::map<uint32_t, std::vector<uint64_t>> two{{points[0], shares[0]}, {points[1], shares[1]}};
  EXPECT_NE(secagg::shamir_join(two), secret);
}

// The unmasked aggregate is the plaintext sum bit for bit: with everyone, with 30% leaving
// after sharing keys (their pairwise masks rebuilt and removed), and with some leaving after
// sending their masked input (their self masks rebuilt from the others' shares).
TEST(SecureAggregation, TheAggregateIsThePlaintextSumExactlyWithAndWithoutDropouts) {
  const int64_t elements = 1000;
  const SecAggRound all = secure_round(10, 6, elements, 0, 0);
  EXPECT_TRUE(at::equal(all.sum, all.plain));
  const SecAggRound dropped = secure_round(10, 6, elements, 3, 0);  // 30% gone before masking
  EXPECT_TRUE(at::equal(dropped.sum, dropped.plain));
  const SecAggRound late = secure_round(10, 6, elements, 2, 2);  // 2 before masking, 2 after
  EXPECT_TRUE(at::equal(late.sum, late.plain));
  // A masked input alone says nothing: it is not its input (the clear sum of survivors differs
  // from the sum of masked inputs unless the masks are removed).
  at::Tensor raw = at::zeros({elements}, at::kLong);
  for (const auto& y : dropped.masked) raw += y.to(at::kLong);
  EXPECT_FALSE(at::equal((raw & int64_t{0xffffffff}).to(at::kInt), dropped.plain));
}

// SecAgg+ sums equal the plaintext sum exactly with no dropouts and with 30% (before masking,
// and some after masking), the masks and shares only along the graph's edges.
TEST(SecAggPlus, SumsEqualThePlaintextSumExactlyWith0And30PercentDropouts) {
  const int64_t elements = 500;
  const int k = secagg::default_degree(50);  // 12: neighbourhoods of 13
  const SecAggRound all = secure_round(50, 7, elements, 0, 0, 1, k);
  EXPECT_TRUE(at::equal(all.sum, all.plain));
  // 15 of 50 leave after sharing keys; t = 4 of a neighbourhood's 13 (a lower threshold keeps
  // every neighbourhood above it at this dropout rate).
  const SecAggRound dropped = secure_round(50, 4, elements, 15, 0, 2, k);
  EXPECT_TRUE(at::equal(dropped.sum, dropped.plain));
  const SecAggRound late = secure_round(50, 4, elements, 10, 5, 3, k);
  EXPECT_TRUE(at::equal(late.sum, late.plain));
  // The masks are there: summing the masked inputs without removing them is not the sum.
  at::Tensor raw = at::zeros({elements}, at::kLong);
  for (const auto& y : dropped.masked) raw += y.to(at::kLong);
  EXPECT_FALSE(at::equal((raw & int64_t{0xffffffff}).to(at::kInt), dropped.plain));
  // A neighbourhood with fewer than t survivors cannot be unmasked: the round aborts naming it.
  try {
    secure_round(50, 12, elements, 15, 0, 2, k);
    ADD_FAILURE() << "a neighbourhood below its threshold was unmasked";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fewer than the threshold 12"), std::string::npos)
        << e.what();
    // ... and says what makes it rarer.
    EXPECT_NE(std::string(e.what()).find("a larger --secagg-graph degree or a lower "
                                         "--secagg-threshold"),
              std::string::npos)
        << e.what();
  }
}

TEST(SecureAggregation, BelowTheThresholdTheRoundAbortsSayingHowManyWereLeft) {
  try {
    secure_round(10, 6, 100, 5, 0);  // 5 masked inputs < 6
    ADD_FAILURE() << "a round below the threshold was aggregated";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("5 clients sent masked inputs, fewer than the threshold 6"),
        std::string::npos)
        << e.what();
  }
  try {
    secure_round(10, 6, 100, 2, 3);  // 8 masked, 5 reveal
    ADD_FAILURE() << "masks were removed with too few reveals";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("5 clients revealed their shares, fewer than the threshold 6"),
        std::string::npos)
        << e.what();
  }
}

// What the server sees of one client looks like uniform noise whatever the input: a constant
// or a ramp input gives masked words whose bytes are uniform (chi-square) and uncorrelated with
// the input.
TEST(SecureAggregation, OneMaskedUploadIsIndistinguishableFromUniformNoise) {
  using namespace secagg;
  const int64_t elements = 65536;
  const int n = 4, threshold = 3;
  std::vector<std::unique_ptr<ClientSession>> clients;
  ServerSession server(elements, threshold);
  for (int i = 0; i < n; ++i) {
    clients.push_back(std::make_unique<ClientSession>(i + 1, elements, threshold));
    server.add_keys(clients.back()->advertise());
  }
  const auto u1 = server.advertised();
  for (auto& c : clients) server.add_shares(c->share_keys(u1));
  for (auto& c : clients) c->receive(server.shares_for(c->id()));
  const at::Tensor ramp = at::arange(elements, at::kInt);
  const at::Tensor y = clients[0]->masked_input(ramp, server.shared());
  // Byte histogram: 256 bins of 4 * elements bytes; chi-square with 255 degrees of freedom has
  // mean 255 and sd 22.6: far above 400 would mean structure.
  const at::Tensor bytes = at::from_blob(y.data_ptr(), {elements * 4}, at::kByte).to(at::kLong);
  const at::Tensor counts = at::bincount(bytes, {}, 256).to(at::kDouble);
  const double expected = static_cast<double>(elements * 4) / 256;
  const double chi2 = ((counts - expected).pow(2) / expected).sum().item<double>();
  EXPECT_LT(chi2, 400.0);
  // The ramp itself is perfectly "structured": the same statistic is enormous.
  const at::Tensor ramp_bytes =
      at::from_blob(ramp.data_ptr(), {elements * 4}, at::kByte).to(at::kLong);
  const at::Tensor ramp_counts = at::bincount(ramp_bytes, {}, 256).to(at::kDouble);
  EXPECT_GT(((ramp_counts - expected).pow(2) / expected).sum().item<double>(), 1e4);
  // Correlation of the masked words (as unsigned) with the input: |r| < 4 / sqrt(n).
  const at::Tensor u = (y.to(at::kLong) & int64_t{0xffffffff}).to(at::kDouble);
  const at::Tensor x = ramp.to(at::kDouble);
  const double r =
      (((u - u.mean()) * (x - x.mean())).mean() / (u.std(false) * x.std(false))).item<double>();
  EXPECT_LT(std::abs(r), 4.0 / std::sqrt(static_cast<double>(elements)));
}

// Shares are sealed for their recipient: one altered byte, or a ciphertext replayed to another
// client, is refused naming the sender.
TEST(SecureAggregation, TamperedOrMisroutedSharesDoNotOpen) {
  using namespace secagg;
  std::vector<std::unique_ptr<ClientSession>> clients;
  ServerSession server(10, 2);
  for (int i = 0; i < 3; ++i) {
    clients.push_back(std::make_unique<ClientSession>(i + 1, 10, 2));
    server.add_keys(clients.back()->advertise());
  }
  const auto u1 = server.advertised();
  std::vector<std::vector<SealedShares>> sent;
  for (auto& c : clients) sent.push_back(c->share_keys(u1));
  auto tampered = sent[1][0];  // client 2 -> client 1
  ASSERT_EQ(tampered.to, 1u);
  tampered.ciphertext[40] ^= 1;
  EXPECT_THROW(clients[0]->receive({tampered}), Error);
  auto misrouted = sent[1][1];  // client 2 -> client 3, handed to client 1
  misrouted.to = 1;
  try {
    clients[0]->receive({misrouted});
    ADD_FAILURE() << "shares for another client opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("from client 2 do not open"), std::string::npos)
        << e.what();
  }
}

TEST(SecureAggregation, FixedPointRoundTripsWithinItsResolution) {
  const int bits = 16;
  const double bound = secagg::fixed_bound(bits, 100);
  const at::Tensor x = at::randn({1000}, at::detail::createCPUGenerator(2), at::kDouble);
  at::Tensor sum = at::zeros({1000}, at::kLong);
  for (int i = 0; i < 100; ++i) sum += secagg::to_fixed(x * 0.01 * i, bits, bound).to(at::kLong);
  const at::Tensor back = secagg::from_fixed(sum.to(at::kInt), bits);
  EXPECT_LE((back - x * 0.01 * 4950).abs().max().item<double>(), 100 * 0.5 / 65536 + 1e-12);
  // Clipped at the bound.
  EXPECT_EQ(secagg::to_fixed(at::full({1}, 1e9, at::kDouble), bits, bound).item<int32_t>(),
            static_cast<int32_t>(std::llround(bound * 65536)));
}

// The simulation with secure aggregation trains the model plaintext FedAvg trains, up to the
// fixed point's resolution (2^-16 per weighted element), with 30% of the clients dropping out
// after the keys were shared; the server saw only masked inputs.
TEST(SecureAggregation, SimulatedRoundsWithSecureAggregationMatchPlaintextFedAvg) {
  at::set_num_threads(1);
  const auto train = synthetic64(400, 31);
  const auto test = synthetic64(100, 32);
  SimulationOptions options;
  options.clients = 10;
  options.fraction = 1.0;
  options.rounds = 3;
  options.round.local.epochs = 2;
  options.round.local.batch = 10;
  options.dropout = 0.3;
  options.threads = 2;
  options.progress = false;
  const auto plain = simulate(mlp_spec(), train, test, options);
  options.round.secure_aggregation = true;
  options.secagg_threshold = 0.5;  // t = 5 of 10
  const auto secure = simulate(mlp_spec(), train, test, options);
  int64_t dropped = 0;
  ASSERT_EQ(secure.rounds.size(), plain.rounds.size());
  for (size_t r = 0; r < plain.rounds.size(); ++r) {
    EXPECT_TRUE(secure.rounds[r].outcome.applied);
    EXPECT_EQ(secure.rounds[r].outcome.finished, plain.rounds[r].outcome.finished);
    EXPECT_NEAR(secure.rounds[r].outcome.train_loss, plain.rounds[r].outcome.train_loss, 1e-4);
    EXPECT_GT(secure.rounds[r].client_aggregation_s, 0.0);
    dropped += secure.rounds[r].outcome.dropped;
  }
  EXPECT_GT(dropped, 0);
  const double difference = (secure.global - plain.global).abs().max().item<double>();
  EXPECT_LT(difference, 1e-4);
  // Not the same computation: the fixed point's rounding is there.
  EXPECT_GT(difference, 0.0);
  // SecAgg+ (degree 6: neighbourhoods of 7, t = 2) sums the same fixed-point inputs exactly:
  // the same model bit for bit, with the same dropouts.
  options.secagg_graph = 6;
  options.secagg_threshold = 0.25;
  const auto plus = simulate(mlp_spec(), train, test, options);
  EXPECT_TRUE(plus.global.equal(secure.global));
  // A neighbourhood left with fewer than t survivors (t = 7 of 7 here, with dropouts) cannot be
  // unmasked: its round is retried like any other that fell short, until the run gives up.
  options.secagg_threshold = 1.0;
  try {
    simulate(mlp_spec(), train, test, options);
    ADD_FAILURE() << "a neighbourhood below its threshold was unmasked";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("clients finished, 10 times in a row"), std::string::npos)
        << e.what();
  }
  options.secagg_graph = 0;
  options.secagg_threshold = 0.5;
  // With t = 10 of 10 and nearly everyone dropping out, no round is applied, each is retried,
  // and after 10 tries in a row the run stops saying why.
  options.secagg_threshold = 1.0;
  options.dropout = 0.95;
  try {
    simulate(mlp_spec(), train, test, options);
    ADD_FAILURE() << "rounds below the threshold were applied";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("clients finished, 10 times in a row"), std::string::npos)
        << e.what();
  }
  options.secagg_threshold = 0.5;
  options.dropout = 0.3;
  // Compression cannot be combined with it.
  options.compression = comm::parse_compression("q8");
  EXPECT_THROW(simulate(mlp_spec(), train, test, options), InputError);
}

// The masks are made a 4 KiB tile of keystream at a time, each tile from its own ChaCha20
// counter: the words must be those of one keystream over the whole length (a wrong counter would
// repeat or skip keystream; where client and server share the mistake the sums still come out
// right, so only this can tell).
TEST(SecureAggregation, MasksAreTheWholeKeystreamMadeABlockAtATime) {
  ASSERT_GE(sodium_init(), 0);
  secagg::Key seed{};
  for (size_t i = 0; i < seed.size(); ++i) seed[i] = static_cast<uint8_t>(7 * i + 1);
  const int64_t elements = 8 * 1024 + 1000;  // eight whole tiles and a partial one
  const at::Tensor mask = secagg::expand_mask(seed, elements);
  std::vector<int32_t> whole(static_cast<size_t>(elements));
  const unsigned char nonce[crypto_stream_chacha20_ietf_NONCEBYTES] = {};
  crypto_stream_chacha20_ietf(reinterpret_cast<unsigned char*>(whole.data()),
                              static_cast<unsigned long long>(elements) * 4, nonce, seed.data());
  ASSERT_EQ(mask.numel(), elements);
  EXPECT_EQ(std::memcmp(mask.data_ptr<int32_t>(), whole.data(), whole.size() * 4), 0);
}
