// Asynchronous buffered aggregation (FedBuff) and the virtual clock: the buffer equals
// synchronous FedAvg when it waits for every client and nothing is stale; stale updates are
// discounted by the rule; a resumed server continues the same asynchronous state; runs on the
// virtual clock are deterministic whatever the threads do; the combinations it cannot serve are
// refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "FederatedTesting.h"
#include "TempDir.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/common/Error.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Buffered.h"
#include "dtrain/services/federated/simulation/Simulation.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

namespace {

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

SimulationOptions small_run() {
  SimulationOptions o;
  o.clients = 6;
  o.fraction = 1.0;
  o.rounds = 4;
  o.threads = 2;
  o.progress = false;
  o.local_test_fraction = 0.0;
  o.round.local.epochs = 2;
  o.round.local.batch = 10;
  o.round.local.lr = 0.1;
  o.partition = parse_partition("shards:2");
  o.eval_every = 1000;
  return o;
}

std::string refusal(const std::function<void()>& make) {
  try {
    make();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST(Buffered, StalenessRulesWeighAndParse) {
  EXPECT_EQ(parse_staleness("constant").weight(7), 1.0);
  const StalenessRule poly = parse_staleness("poly:0.5");
  EXPECT_DOUBLE_EQ(poly.weight(0), 1.0);
  EXPECT_DOUBLE_EQ(poly.weight(3), 0.5);  // (1 + 3)^-0.5
  const StalenessRule hinge = parse_staleness("hinge:2,3");
  EXPECT_EQ(hinge.weight(3), 1.0);
  EXPECT_DOUBLE_EQ(hinge.weight(5), 0.2);  // 1 / (2 (5 - 3) + 1)
  EXPECT_EQ(to_string(hinge), "hinge:2,3");
  for (const std::string bad : {"poly", "poly:x", "poly:-1", "hinge:1", "linear:2", "hinge:1,-2"}) {
    const std::string why = refusal([&] { parse_staleness(bad); });
    EXPECT_NE(why.find("--staleness '" + bad + "'"), std::string::npos) << why;
  }
  EXPECT_NE(refusal([] { parse_client_speed("lognormal:0"); }).find("--client-speed"),
            std::string::npos);
  // Heavy-tailed speeds: a log-normal's median is 1, a Pareto's floor is 1.
  const ClientSpeed lognormal = parse_client_speed("lognormal:1");
  const ClientSpeed pareto = parse_client_speed("pareto:1.5");
  std::vector<double> s;
  for (int64_t c = 0; c < 4001; ++c) {
    s.push_back(lognormal.slowness(c, 3));
    EXPECT_GE(pareto.slowness(c, 3), 1.0);
  }
  std::nth_element(s.begin(), s.begin() + 2000, s.end());
  EXPECT_NEAR(s[2000], 1.0, 0.1);
  EXPECT_EQ(lognormal.slowness(17, 3), lognormal.slowness(17, 3));  // fixed per client
}

// K = C = every client and no staleness discount: nobody starts again before the buffer is
// applied (one update per client per buffer), so every step is a synchronous round - with any
// device speeds.
TEST(Buffered, WithKEqualToTheClientsAndNoStalenessItIsSynchronousFedAvg) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 61);
  const auto test = synthetic64(40, 61);
  SimulationOptions o = small_run();
  const at::Tensor synchronous = simulate(mlp_spec(), train, test, o).global;
  o.speed = parse_client_speed("lognormal:1");
  o.round.buffer.size = o.clients;
  o.round.buffer.concurrency = o.clients;
  o.round.buffer.staleness = parse_staleness("constant");
  const auto buffered = simulate(mlp_spec(), train, test, o);
  EXPECT_EQ(buffered.rounds_done, 4);
  EXPECT_LE(max_diff(buffered.global, synchronous), kTightBound);
  // A smaller buffer is not synchronous (the check can fail): clients start from newer models
  // while others still train on older ones.
  o.round.buffer.size = 3;
  const auto smaller = simulate(mlp_spec(), train, test, o);
  EXPECT_GT(max_diff(smaller.global, synchronous), 1e-6);
  double staleness = 0;
  for (const auto& r : smaller.rounds) staleness += r.outcome.staleness;
  EXPECT_GT(staleness, 0);  // some updates were computed from older models
}

TEST(Buffered, StaleUpdatesAreDiscountedAndAResumedServerContinuesTheSameState) {
  RoundServerOptions options;
  options.buffer.size = 2;
  options.buffer.concurrency = 3;
  options.buffer.staleness = parse_staleness("poly:1");
  const auto make = [&] { return RoundServer(at::zeros({3}, at::kDouble), options); };
  RoundServer server = make();
  const at::Tensor a = at::tensor({1.0, 0.0, 0.0}, at::kDouble);
  const at::Tensor b = at::tensor({0.0, 1.0, 0.0}, at::kDouble);
  const at::Tensor c = at::tensor({0.0, 0.0, 1.0}, at::kDouble);
  for (const char* id : {"a", "b", "c"}) EXPECT_EQ(server.start(id), "");
  EXPECT_NE(server.start("d").find("3 clients are training (--concurrency)"), std::string::npos);
  EXPECT_NE(server.start("a").find("already training"), std::string::npos);
  EXPECT_NE(server.submit("d", a, 10).find("not training"), std::string::npos);
  EXPECT_EQ(server.submit("a", a, 10), "");
  EXPECT_NE(server.start("a").find("already has an update"), std::string::npos);
  EXPECT_FALSE(server.buffer_full());
  EXPECT_EQ(server.submit("b", b, 30), "");
  ASSERT_TRUE(server.buffer_full());
  RoundOutcome step = server.close();
  EXPECT_TRUE(step.applied);
  EXPECT_EQ(step.staleness, 0.0);
  // FedAvg's example-weighted mean: (10 a + 30 b) / 40.
  EXPECT_TRUE(server.global().equal(at::tensor({0.25, 0.75, 0.0}, at::kDouble)));
  // c started before that step: staleness 1, weight (1 + 1)^-1.
  EXPECT_EQ(server.start("a"), "");
  EXPECT_EQ(server.submit("c", c, 20), "");
  const test::TempDir dir;
  const std::string file = dir.path() + "/server.pt";
  server.save(file);
  RoundServer resumed = make();
  resumed.load(file);
  EXPECT_EQ(resumed.training_steps(), (std::map<std::string, int64_t>{{"a", 1}}));
  for (RoundServer* s : {&server, &resumed}) {
    EXPECT_NE(s->start("c").find("already has an update"), std::string::npos);
    EXPECT_EQ(s->submit("a", a, 20), "");
    const RoundOutcome next = s->close();
    EXPECT_EQ(next.staleness, 0.5);
    // (20 x 0.5 c + 20 x a) / 40 on top.
    EXPECT_LE(max_diff(s->global(), at::tensor({0.75, 0.75, 0.25}, at::kDouble)), 1e-15);
  }
}

TEST(Buffered, VirtualClockRunsAreDeterministicWhateverTheThreadsDo) {
  at::set_num_threads(1);
  const auto train = synthetic64(240, 63);
  const auto test = synthetic64(40, 63);
  SimulationOptions o = small_run();
  o.clients = 12;
  o.rounds = 5;
  o.speed = parse_client_speed("pareto:1.2");
  o.availability = parse_availability_trace("diurnal:8");
  o.dropout = 0.2;
  o.round.buffer.size = 3;
  o.round.buffer.concurrency = 6;
  o.threads = 1;
  const auto one = simulate(mlp_spec(), train, test, o);
  o.threads = 3;
  const auto three = simulate(mlp_spec(), train, test, o);
  EXPECT_TRUE(one.global.equal(three.global));
  ASSERT_EQ(one.rounds.size(), three.rounds.size());
  for (size_t i = 0; i < one.rounds.size(); ++i) {
    EXPECT_EQ(one.rounds[i].sim_minutes, three.rounds[i].sim_minutes);
    EXPECT_GT(one.rounds[i].sim_minutes, i > 0 ? one.rounds[i - 1].sim_minutes : 0.0);
  }
  // Synchronous rounds on the clock: with every device alike a round takes its plan's steps x
  // --step-seconds (2 epochs of 4 batches of 10).
  SimulationOptions s = small_run();
  s.speed = parse_client_speed("constant");
  s.speed.step_seconds = 30;
  s.partition = parse_partition("iid");
  s.client_examples = 40;  // dealt: 40 examples each
  s.rounds = 2;
  const auto sync = simulate(mlp_spec(), train, test, s);
  const int64_t steps = local_steps(s.round.local, train.size() / s.clients);  // 40 examples each
  EXPECT_DOUBLE_EQ(sync.rounds[0].sim_minutes, static_cast<double>(steps) * 30 / 60);
  EXPECT_DOUBLE_EQ(sync.rounds[1].sim_minutes, 2 * static_cast<double>(steps) * 30 / 60);
}

// A buffered run saved at a step and resumed goes on as the uninterrupted run: the clients in
// flight train again from the models they started from (with their error-feedback residuals as
// they were then), on the same clock, and later starts draw the same clients.
TEST(Buffered, AResumedRunGoesOnAsAnUninterruptedOne) {
  at::set_num_threads(1);
  const auto train = synthetic64(240, 71);
  SimulationOptions o = small_run();
  o.clients = 12;
  o.rounds = 6;
  o.speed = parse_client_speed("lognormal:0.8");
  o.dropout = 0.2;
  o.round.buffer.size = 3;
  o.round.buffer.concurrency = 6;
  o.round.buffer.staleness = parse_staleness("poly:0.5");
  o.compression = comm::parse_compression("topk:0.2");
  const auto straight = simulate(mlp_spec(), train, train, o);
  ASSERT_EQ(straight.rounds_done, 6);
  const test::TempDir dir;
  o.checkpoint_dir = dir.path();
  o.rounds = 3;
  const auto first = simulate(mlp_spec(), train, train, o);
  ASSERT_EQ(first.rounds_done, 3);
  o.rounds = 6;
  const auto resumed = simulate(mlp_spec(), train, train, o);
  EXPECT_EQ(resumed.start_round, 3);
  ASSERT_EQ(resumed.rounds.size(), 3u);
  EXPECT_TRUE(resumed.global.equal(straight.global)) << max_diff(resumed.global, straight.global);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.rounds[i].sim_minutes, straight.rounds[i + 3].sim_minutes) << i;
    EXPECT_EQ(resumed.rounds[i].outcome.staleness, straight.rounds[i + 3].outcome.staleness) << i;
  }
}

// What buffered aggregation works with: compressed uploads (q8, read back as the server reads
// them) and differential privacy (clipped updates, noise on the buffer's sum, epsilon reported).
TEST(Buffered, WorksWithCompressionAndDifferentialPrivacy) {
  at::set_num_threads(1);
  const auto train = synthetic64(240, 67);
  SimulationOptions o = small_run();
  o.clients = 12;
  o.rounds = 3;
  o.speed = parse_client_speed("lognormal:0.5");
  o.round.buffer.size = 3;
  o.round.buffer.concurrency = 6;
  o.compression = comm::parse_compression("q8");
  o.round.dp.clip = 1.0;
  o.round.dp.noise_multiplier = 0.5;
  const auto run = simulate(mlp_spec(), train, train, o);
  ASSERT_EQ(run.rounds_done, 3);
  const int64_t numel = run.global.numel();
  for (const auto& r : run.rounds) {
    EXPECT_TRUE(r.outcome.applied);
    EXPECT_EQ(r.outcome.finished, 3);
    EXPECT_GT(r.dp_epsilon, 0.0);
    // q8: about a byte per parameter for each of the step's 3 updates, not 8 (float64).
    EXPECT_LT(r.uplink_bytes, 3 * 2 * numel);
    EXPECT_GT(r.uplink_bytes, 3 * numel);
  }
  EXPECT_TRUE(comm::all_finite(run.global));
}

TEST(Buffered, CombinationsItCannotServeAreRefused) {
  const auto refused = [](RoundServerOptions options) {
    return refusal([&] { RoundServer server(at::zeros({4}, at::kDouble), options); });
  };
  RoundServerOptions options;
  options.buffer.size = 2;
  options.secure_aggregation = true;
  EXPECT_NE(refused(options).find("buffered secure aggregation is not implemented"),
            std::string::npos);
  options.secure_aggregation = false;
  for (const std::string algorithm : {"scaffold", "feddyn", "median"}) {
    options.aggregator.algorithm = algorithm;
    EXPECT_NE(refused(options).find("--buffer-size with --algorithm " + algorithm),
              std::string::npos)
        << algorithm;
  }
  options.aggregator.algorithm = "fedavg";
  options.buffer.concurrency = 1;
  EXPECT_NE(refused(options).find("the buffer could never fill"), std::string::npos);
  // The simulation: the buffer needs the virtual clock, and no more than the clients.
  const auto train = synthetic64(60, 65);
  SimulationOptions o = small_run();
  o.round.buffer.size = 2;
  EXPECT_NE(refusal([&] { simulate(mlp_spec(), train, train, o); }).find("give --client-speed"),
            std::string::npos);
  o.speed = parse_client_speed("constant");
  o.round.buffer.size = 7;
  EXPECT_NE(refusal([&] {
              simulate(mlp_spec(), train, train, o);
            }).find("--buffer-size 7 is more than the 6 clients"),
            std::string::npos);
}
