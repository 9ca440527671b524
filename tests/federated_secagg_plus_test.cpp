// SecAgg+'s graph (Bell et al. 2020): regular, symmetric and drawn from the round's seed; its
// degree sized for the dropout rate (--secagg-graph auto) in the simulation and over gRPC's
// round, against the failure rate of rounds on the real graphs. The protocol on the graph (sums
// equal to the plaintext sum) is tested in federated_secure_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "FederatedTesting.h"
#include "dtrain/common/Error.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "services/federated/secagg/SecureServerRound.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

namespace {

// Rounds of n clients on SecAgg+'s graph of degree k (0: full), each client leaving with
// probability `dropout`: the share of rounds in which some secret keeps fewer than t of its
// holders (the condition ServerSession::finish aborts on: a survivor's self mask is held by it
// and its neighbours, a dropped client's key by its neighbours).
double rounds_that_cannot_unmask(int64_t n, int k, int t, double dropout, int rounds) {
  std::vector<uint32_t> ids(static_cast<size_t>(n));
  std::iota(ids.begin(), ids.end(), 1u);
  std::mt19937_64 rng(1234);
  int failed = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto graph = k > 0 ? secagg::neighbour_graph(ids, k, rng())
                             : std::map<uint32_t, std::vector<uint32_t>>{};
    std::vector<char> left(static_cast<size_t>(n) + 1);
    for (int64_t u = 1; u <= n; ++u) {
      left[static_cast<size_t>(u)] = static_cast<double>(rng() >> 11) * 0x1.0p-53 < dropout;
    }
    bool fails = false;
    if (k == 0) {
      fails = std::count(left.begin() + 1, left.end(), 0) < t;
    }
    for (const auto& [u, mine] : graph) {
      int holders = left[u] ? 0 : 1;
      for (const uint32_t v : mine) holders += left[v] ? 0 : 1;
      fails = fails || holders < t;
    }
    failed += fails ? 1 : 0;
  }
  return static_cast<double>(failed) / rounds;
}

}  // namespace

// SecAgg+'s graph: every client has exactly k neighbours, the relation is symmetric, and the
// same seed draws the same graph (the server and every client draw it from the round's seed).
TEST(SecAggPlus, TheGraphIsRegularSymmetricAndDrawnFromTheSeed) {
  std::vector<uint32_t> ids;
  for (uint32_t i = 1; i <= 100; ++i) ids.push_back(i * 3);
  const int k = secagg::default_degree(100);
  EXPECT_EQ(k, 14);  // the smallest even k >= 2 log2(100) = 13.3
  EXPECT_EQ(secagg::default_degree(1000), 20);
  EXPECT_EQ(secagg::default_degree(3), 0);  // no graph sparser than the full one
  const auto graph = secagg::neighbour_graph(ids, k, 42);
  ASSERT_EQ(graph.size(), 100u);
  for (const auto& [u, mine] : graph) {
    EXPECT_EQ(mine.size(), static_cast<size_t>(k)) << u;
    EXPECT_EQ(std::set<uint32_t>(mine.begin(), mine.end()).size(), mine.size()) << u;
    for (const uint32_t v : mine) {
      EXPECT_NE(u, v);
      const auto& theirs = graph.at(v);
      EXPECT_TRUE(std::binary_search(theirs.begin(), theirs.end(), u)) << u << "-" << v;
    }
  }
  std::vector<uint32_t> shuffled(ids.rbegin(), ids.rend());
  EXPECT_EQ(secagg::neighbour_graph(shuffled, k, 42), graph);  // the order given does not matter
  EXPECT_NE(secagg::neighbour_graph(ids, k, 43), graph);
  const auto refused = [&](int degree, int64_t n) {
    try {
      secagg::round_degree(degree, n);
      secagg::neighbour_graph(std::vector<uint32_t>(ids.begin(), ids.begin() + n), degree, 1);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(refused(10, 10).find("SecAgg+ degree larger than the round allows (10 clients"),
            std::string::npos);
  EXPECT_NE(refused(3, 10).find("an even degree >= 2"), std::string::npos);
  EXPECT_EQ(secagg::parse_secagg_graph("full"), 0);
  EXPECT_EQ(secagg::parse_secagg_graph("log"), -1);
  EXPECT_EQ(secagg::parse_secagg_graph("20"), 20);
  for (const std::string bad : {"sparse", "7", "0", "-2"}) {
    try {
      secagg::parse_secagg_graph(bad);
      ADD_FAILURE() << "--secagg-graph " << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--secagg-graph '" + bad + "'"), std::string::npos);
    }
  }
}

// --secagg-graph auto: the degree is sized from the dropout rate so that a round can be
// unmasked but for a bounded chance (Bell et al. size k from it); the bound is an upper bound
// of what rounds on the real graph do, and the log degree fails often where auto does not.
TEST(SecAggPlus, AutoSizesTheDegreeForTheDropoutRate) {
  EXPECT_EQ(secagg::parse_secagg_graph("auto"), secagg::kAutoGraph);
  // Binomial tails against sums done by hand: P(Bin(3, 0.5) < 2) = 4 / 8.
  EXPECT_NEAR(secagg::binomial_below(3, 0.5, 2), 0.5, 1e-12);
  EXPECT_NEAR(secagg::binomial_below(10, 0.7, 1), std::pow(0.3, 10), 1e-18);
  EXPECT_EQ(secagg::binomial_below(10, 0.7, 0), 0.0);
  EXPECT_EQ(secagg::binomial_below(10, 0.7, 11), 1.0);
  // Without dropouts: the log degree.
  EXPECT_EQ(secagg::auto_degree(500, 0.4, 0.0), secagg::default_degree(500));
  EXPECT_EQ(secagg::round_degree(secagg::kAutoGraph, 500, 0.4, 0.0), 18);
  // 30% dropouts, t = 0.4 of a neighbourhood: the log degree (18) cannot unmask about 3 rounds
  // in 10 (measured on its graphs here: 0.29); auto's degree almost never.
  const int64_t n = 500;
  const int log_k = secagg::default_degree(n);
  const int auto_k = secagg::auto_degree(n, 0.4, 0.3);
  EXPECT_GT(auto_k, log_k);
  EXPECT_LT(auto_k, n / 4);  // still sparse
  const int log_t = secagg::secagg_threshold(0.4, log_k + 1);
  const int auto_t = secagg::secagg_threshold(0.4, auto_k + 1);
  const double log_failed = rounds_that_cannot_unmask(n, log_k, log_t, 0.3, 400);
  const double auto_failed = rounds_that_cannot_unmask(n, auto_k, auto_t, 0.3, 400);
  EXPECT_GT(log_failed, 0.2) << "log degree " << log_k;
  EXPECT_LE(auto_failed, 0.01) << "auto degree " << auto_k;
  EXPECT_LE(secagg::unmask_failure_bound(n, auto_k, auto_t, 0.3), 1e-3);
  // The degree below auto's does not meet the bound (auto is the smallest).
  EXPECT_GT(
      secagg::unmask_failure_bound(n, auto_k - 2, secagg::secagg_threshold(0.4, auto_k - 1), 0.3),
      1e-3);
  // The bound is above what the graph does where failures are frequent enough to measure.
  for (const auto& [k, dropout] : std::vector<std::pair<int, double>>{{14, 0.3}, {20, 0.35}}) {
    const int t = secagg::secagg_threshold(0.4, k + 1);
    const double measured = rounds_that_cannot_unmask(100, k, t, dropout, 400);
    EXPECT_GT(measured, 0.0) << k;
    EXPECT_LE(measured, secagg::unmask_failure_bound(100, k, t, dropout) + 0.05) << k;
  }
  // A majority of holders at 30% dropouts needs a denser graph; at 100 clients the full one.
  EXPECT_GT(secagg::auto_degree(n, 0.0, 0.3), auto_k);
  EXPECT_EQ(secagg::auto_degree(100, 0.0, 0.3), 0);
  EXPECT_LE(rounds_that_cannot_unmask(100, 0, 51, 0.3, 400), 0.01);
  // A threshold above the survivors' share: no graph unmasks reliably; a round takes the full
  // graph (the most holders), and the start-up check refuses it in one line naming the flags.
  EXPECT_EQ(secagg::round_degree(secagg::kAutoGraph, 100, 0.4, 0.7), 0);
  try {
    secagg::check_auto_graph(100, 0.4, 0.7);
    ADD_FAILURE() << "auto accepted a threshold above the survivors' share";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--secagg-graph auto: with 70% dropouts "
                                         "(--secagg-dropout) and a threshold of 0.4"),
              std::string::npos)
        << e.what();
  }
  // The gRPC server's round sizes it the same way (from --secagg-dropout).
  std::vector<std::string> chosen;
  for (int i = 0; i < 60; ++i) chosen.push_back("client-" + std::to_string(i));
  const SecureServerRound served(chosen, 0.4, 1, 10, secagg::kAutoGraph, 7, 0.3);
  EXPECT_EQ(served.degree, secagg::auto_degree(60, 0.4, 0.3));
  EXPECT_EQ(served.threshold, secagg::secagg_threshold(0.4, served.degree + 1));
  EXPECT_NE(secagg::describe_auto_degree(n, 0.4, 0.3)
                .find("degree " + std::to_string(auto_k) + " for rounds of 500 clients at 30%"),
            std::string::npos);
}

// In simulation, auto takes its rate from --dropout: with 30% dropouts every round unmasks at
// the degree it chose (a client's masks: its neighbours' and its own).
TEST(SecAggPlus, SimulatedRoundsWithAutoDegreeUnmaskAt30PercentDropouts) {
  at::set_num_threads(1);
  SimulationOptions options;
  options.clients = 60;
  options.fraction = 1.0;
  options.rounds = 6;
  options.round.local.epochs = 1;
  options.round.local.batch = 0;
  options.dropout = 0.3;
  options.threads = 2;
  options.progress = false;
  options.round.secure_aggregation = true;
  options.secagg_threshold = 0.4;
  options.secagg_graph = secagg::kAutoGraph;
  const int k = secagg::auto_degree(60, 0.4, 0.3);
  ASSERT_GT(k, secagg::default_degree(60));
  const auto run = simulate(mlp_spec(), synthetic64(600, 41), synthetic64(100, 42), options);
  ASSERT_EQ(run.rounds.size(), 6u);  // none aborted and retried
  for (const auto& round : run.rounds) {
    EXPECT_TRUE(round.outcome.applied);
    EXPECT_GT(round.outcome.dropped, 0);
    EXPECT_EQ(round.client_masks, k + 1);
  }
}
