// Federated learning's rounds without the network: partitions (IID, McMahan's shards, Dirichlet
// skew), FedAvg against centralized training in float64 (one client with E = 1 and its full batch
// is gradient descent; two clients' example-weighted mean is gradient descent on their union, and
// the oracle notices an update left out or weighted wrongly), the round server's checks (refusals
// change nothing, too few finishers retry the round), the aggregators and server optimizers
// (FedAvgM, FedAdam, FedProx), the simulation (resume, divergence), personalization and
// availability traces.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include <grpcpp/grpcpp.h>
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

TEST(Partition, IidDealsEveryExampleOnceInEvenParts) {
  const at::Tensor labels = balanced_labels(100);
  const auto parts = partition(labels, 7, parse_partition("iid"), 1, 0.2);
  ASSERT_EQ(parts.size(), 7u);
  std::set<int64_t> seen;
  for (const auto& p : parts) {
    const size_t n = p.train.size() + p.test.size();
    EXPECT_TRUE(n == 1000 / 7 || n == 1000 / 7 + 1) << n;
    EXPECT_EQ(p.test.size(), static_cast<size_t>(0.2 * n));  // floor
    for (auto i : p.train) EXPECT_TRUE(seen.insert(i).second);
    for (auto i : p.test) EXPECT_TRUE(seen.insert(i).second);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_GT(mean_classes(labels, parts), 9.5);
  // Deterministic in the seed, different across seeds.
  EXPECT_EQ(partition(labels, 7, parse_partition("iid"), 1, 0.2)[3].train, parts[3].train);
  EXPECT_NE(partition(labels, 7, parse_partition("iid"), 2, 0.2)[3].train, parts[3].train);
}

TEST(Partition, ShardsGiveEachClientAtMostKClasses) {
  const at::Tensor labels = balanced_labels(100);
  // 50 clients x 2 shards of 10 sorted examples: each shard is one class.
  const auto parts = partition(labels, 50, parse_partition("shards:2"), 3, 0.0);
  std::set<int64_t> seen;
  for (const auto& p : parts) {
    EXPECT_EQ(p.train.size(), 20u);
    EXPECT_TRUE(p.test.empty());
    EXPECT_LE(classes_among(labels, p.train), 2);
    for (auto i : p.train) EXPECT_TRUE(seen.insert(i).second);
  }
  EXPECT_EQ(seen.size(), 1000u);
  // --partition I/N of `dtrain fl client`: one slice of shards:2.
  const auto slice = partition_slice(labels, 4, 50, 0.2);
  EXPECT_LE(classes_among(labels, slice.train), 2);
  EXPECT_EQ(slice.train.size() + slice.test.size(), 20u);
}

TEST(Partition, DirichletSkewGrowsAsAlphaShrinks) {
  const at::Tensor labels = balanced_labels(200);
  const auto skewed = partition(labels, 20, parse_partition("dirichlet:0.1"), 4, 0.2);
  const auto mild = partition(labels, 20, parse_partition("dirichlet:100"), 4, 0.2);
  size_t total = 0;
  for (const auto& p : skewed) {
    EXPECT_GE(p.train.size(), 1u);
    total += p.train.size() + p.test.size();
  }
  EXPECT_EQ(total, 2000u);
  EXPECT_LT(mean_classes(labels, skewed), 5.0);
  EXPECT_GT(mean_classes(labels, mild), 9.5);
}

TEST(Partition, BadSpecsAreRefusedByName) {
  for (const char* bad : {"shards:0", "shards:1.5", "dirichlet:0", "dirichlet:-1", "dirichlet:x",
                          "iid:3", "pathological", ""}) {
    try {
      parse_partition(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--partition"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(to_string(parse_partition("dirichlet:0.3")), "dirichlet:0.3");
  EXPECT_THROW(partition(balanced_labels(1), 20, parse_partition("iid"), 0, 0.2), InputError);
  EXPECT_THROW(partition(balanced_labels(10), 60, parse_partition("shards:2"), 0, 0.0), InputError);
}

// FedSGD with one client: every round is one full-batch gradient step on the client's data.
TEST(FedAvg, OneClientWithOneFullBatchEpochIsCentralizedGradientDescent) {
  at::set_num_threads(1);
  const auto train = synthetic64(64, 1);
  SimulationOptions options;
  options.clients = 1;
  options.fraction = 1.0;
  options.rounds = 6;
  options.local_test_fraction = 0.0;
  options.round.local.lr = 0.3;
  options.round.aggregator.algorithm = "fedsgd";
  options.threads = 1;
  options.progress = false;
  options.round.seed = 9;
  const auto result = simulate(mlp_spec(), train, synthetic64(32, 2), options);
  EXPECT_EQ(result.rounds_done, 6);
  ASSERT_EQ(result.rounds.size(), 6u);
  const at::Tensor start = flatten_parameters(model64(9));
  // The one client holds every example (in its own order: full-batch gradients do not care).
  const at::Tensor expected = gradient_descent(train, range(0, 64), start, 0.3, 6);
  EXPECT_LE((result.global - expected).abs().max().item<double>(), kTightBound);
  EXPECT_GT((expected - start).abs().max().item<double>(), 1e-3);
  // One step fewer is far outside the bound.
  EXPECT_GT(
      (gradient_descent(train, range(0, 64), start, 0.3, 5) - expected).abs().max().item<double>(),
      1e6 * kTightBound);
  EXPECT_EQ(result.rounds[0].outcome.finished, 1);
  EXPECT_GE(result.rounds[5].test_accuracy, 0.0);
}

// Two clients of unequal size, one full-batch step each: their example-weighted mean update is
// one gradient step on their union. Leaving one out, or averaging unweighted, is not.
TEST(FedAvg, TheExampleWeightedMeanOfTwoClientsIsGradientDescentOnTheirUnion) {
  at::set_num_threads(1);
  const auto data = synthetic64(90, 3);
  const std::vector<int64_t> a = range(0, 30), b = range(30, 90);
  Model replica = model64(4);
  const at::Tensor start = flatten_parameters(replica);
  LocalTraining base;
  base.lr = 0.5;
  const LocalTraining local = make_aggregator("fedsgd", {})->configure(base, 0);
  auto run_round = [&](bool drop_b, bool unweighted) {
    RoundServerOptions options;
    options.clients_per_round = 2;
    RoundServer server(start, options);
    const auto chosen = server.select({"a", "b"});
    EXPECT_EQ(chosen.size(), 2u);
    const auto ua = train_locally(replica, start, data, a, local, 1);
    const auto ub = train_locally(replica, start, data, b, local, 2);
    EXPECT_EQ(server.submit("a", ua.delta, unweighted ? 1 : ua.examples), "");
    if (!drop_b) {
      EXPECT_EQ(server.submit("b", ub.delta, unweighted ? 1 : ub.examples), "");
    }
    const auto outcome = server.close();
    EXPECT_TRUE(outcome.applied);
    return server.global();
  };
  const at::Tensor expected = gradient_descent(data, range(0, 90), start, 0.5, 1);
  EXPECT_LE((run_round(false, false) - expected).abs().max().item<double>(), kTightBound);
  EXPECT_GT((run_round(true, false) - expected).abs().max().item<double>(), 1e6 * kTightBound);
  EXPECT_GT((run_round(false, true) - expected).abs().max().item<double>(), 1e6 * kTightBound);
}

TEST(RoundServer, RefusedUpdatesChangeNothingAndTooFewFinishersRetryTheRound) {
  const at::Tensor start = at::zeros({4}, at::kDouble);
  RoundServerOptions options;
  options.clients_per_round = 3;
  options.min_clients = 2;
  options.seed = 7;
  RoundServer server(start, options);
  std::vector<std::string> all{"a", "b", "c", "d", "e"};
  const auto chosen = server.select(all);
  ASSERT_EQ(chosen.size(), 3u);
  std::string outsider;
  for (const auto& c : all) {
    if (!server.selected(c)) outsider = c;
  }
  const at::Tensor good = at::ones({4}, at::kDouble);
  auto refused = [&](const std::string& why, const std::string& needle) {
    EXPECT_NE(why.find(needle), std::string::npos) << why;
  };
  refused(server.submit(outsider, good, 5), "was not selected");
  refused(server.submit(chosen[0], at::ones({5}, at::kDouble), 5), "holds 5 elements, the model 4");
  refused(server.submit(chosen[0], at::ones({4}, at::kFloat), 5), "the update is Float");
  refused(server.submit(chosen[0], at::full({4}, NAN, at::kDouble), 5), "NaN or Inf");
  refused(server.submit(chosen[0], at::full({4}, INFINITY, at::kDouble), 5), "NaN or Inf");
  refused(server.submit(chosen[0], good, 0), "0 examples");
  EXPECT_EQ(server.submit(chosen[0], good, 5), "");
  refused(server.submit(chosen[0], good, 5), "already sent");
  // One finisher of the 2 required: the round is retried, nothing applied.
  auto outcome = server.close();
  EXPECT_FALSE(outcome.applied);
  EXPECT_EQ(outcome.finished, 1);
  EXPECT_EQ(outcome.dropped, 2);
  EXPECT_EQ(server.round(), 0);
  EXPECT_TRUE(at::equal(server.global(), start));
  // The retry selects anew; two finishers apply the weighted mean (3 * 1 + 1 * 5) / 4 = 2.
  const auto again = server.select(all);
  ASSERT_EQ(again.size(), 3u);
  EXPECT_EQ(server.submit(again[0], good, 3), "");
  EXPECT_EQ(server.submit(again[1], good * 5, 1), "");
  outcome = server.close();
  EXPECT_TRUE(outcome.applied);
  EXPECT_EQ(server.round(), 1);
  EXPECT_TRUE(at::allclose(server.global(), at::full({4}, 2.0, at::kDouble)));
  // The selection is a function of (seed, round, attempt): a server with the same seed at the
  // same point selects the same clients.
  RoundServer twin(start, options);
  EXPECT_EQ(twin.select(all), chosen);
}

TEST(ServerOptimizer, FedAvgMAndFedAdamFollowTheirUpdateRules) {
  const at::Tensor d1 = at::tensor({1.0, -2.0}, at::kDouble);
  const at::Tensor d2 = at::tensor({0.5, 4.0}, at::kDouble);
  {
    ServerOptimizerSpec spec;
    spec.lr = 0.5;
    spec.momentum = 0.9;
    ServerOptimizer opt(spec);
    at::Tensor x = at::zeros({2}, at::kDouble);
    opt.step(x, d1);
    opt.step(x, d2);
    const at::Tensor v2 = d1 * 0.9 + d2;
    EXPECT_TRUE(at::allclose(x, d1 * 0.5 + v2 * 0.5, 0, 1e-15));
  }
  {
    ServerOptimizerSpec spec;
    spec.name = "adam";
    spec.lr = 0.1;
    ServerOptimizer opt(spec);
    at::Tensor x = at::zeros({2}, at::kDouble);
    opt.step(x, d1);
    const at::Tensor m = d1 * 0.1;
    const at::Tensor v = at::full({2}, 1e-6, at::kDouble) * 0.99 + d1 * d1 * 0.01;
    EXPECT_TRUE(at::allclose(x, m / (v.sqrt() + 1e-3) * 0.1, 0, 1e-15));
    // Its state goes into checkpoints and comes back.
    ServerOptimizer copy(spec);
    copy.load_state(opt.state());
    at::Tensor y = x.clone();
    opt.step(x, d2);
    copy.step(y, d2);
    EXPECT_TRUE(at::equal(x, y));
  }
  ServerOptimizerSpec bad;
  bad.name = "rmsprop";
  EXPECT_THROW(ServerOptimizer{bad}, InputError);
}

// The built-in aggregators: --algorithm's older spellings resolve to them, each configures the
// clients' plan as its algorithm says, and FedAvgM / FedAdam step as their server optimizers.
TEST(Aggregator, BuiltInsConfigureTheirPlansAndTheOldSpellingsResolve) {
  AggregatorOptions options;
  LocalTraining plan;
  plan.epochs = 5;
  plan.batch = 10;
  plan.lr = 0.1;
  plan.lr_decay = 0.5;
  EXPECT_EQ(resolve_algorithm("fedavg", options, plan), "fedavg");
  EXPECT_EQ(resolve_algorithm("fedsgd", options, plan), "fedsgd");
  LocalTraining prox = plan;
  prox.prox_mu = 0.01;
  EXPECT_EQ(resolve_algorithm("fedavg", options, prox), "fedprox");
  options.server.momentum = 0.9;
  EXPECT_EQ(resolve_algorithm("fedavg", options, plan), "fedavgm");
  options.server.name = "adam";
  EXPECT_EQ(resolve_algorithm("fedavg", options, plan), "fedadam");

  const AggregatorOptions plain;
  const LocalTraining sgd = make_aggregator("fedsgd", plain)->configure(plan, 2);
  EXPECT_EQ(sgd.epochs, 1);
  EXPECT_EQ(sgd.batch, 0);
  EXPECT_DOUBLE_EQ(sgd.lr, 0.1 * 0.25);  // the rate still decays by round
  EXPECT_EQ(make_aggregator("fedavg", plain)->configure(plan, 0).epochs, 5);
  EXPECT_THROW(make_aggregator("fedprox", plain)->configure(plan, 0), InputError);  // mu = 0
  EXPECT_DOUBLE_EQ(make_aggregator("fedprox", plain)->configure(prox, 0).prox_mu, 0.01);
  EXPECT_THROW(make_aggregator("fedavgm", plain), InputError);  // no momentum
  EXPECT_THROW(make_aggregator("bulyan", plain), InputError);   // not one of ours

  // FedAvgM: v = 0.9 v + mean, global += lr v.
  AggregatorOptions momentum;
  momentum.server.momentum = 0.9;
  auto fedavgm = make_aggregator("fedavgm", momentum);
  at::Tensor global = at::zeros({2}, at::kDouble);
  const at::Tensor mean = at::tensor({1.0, -2.0}, at::kDouble);
  RoundUpdates round;
  round.mean = mean;
  fedavgm->aggregate(global, round);
  round.round = 1;
  fedavgm->aggregate(global, round);
  EXPECT_TRUE(global.allclose(mean * 2.9));
  EXPECT_EQ(fedavgm->state_kind(), "sgd");
  EXPECT_EQ(make_aggregator("fedadam", plain)->state_kind(), "adam");
}

TEST(FedAvg, TheProximalTermKeepsTheLocalModelNearTheGlobalOne) {
  at::set_num_threads(1);
  const auto data = synthetic64(80, 5);
  Model replica = model64(6);
  const at::Tensor start = flatten_parameters(replica);
  LocalTraining local;
  local.epochs = 5;
  local.batch = 10;
  local.lr = 0.1;
  const double free =
      train_locally(replica, start, data, range(0, 80), local, 1).delta.norm().item<double>();
  local.prox_mu = 5.0;
  const auto prox = train_locally(replica, start, data, range(0, 80), local, 1);
  EXPECT_LT(prox.delta.norm().item<double>(), 0.5 * free);
  EXPECT_EQ(prox.steps, 40);
  EXPECT_EQ(prox.examples, 80);
}

// A run stopped after 3 rounds and resumed from its checkpoint ends where an uninterrupted
// 5-round run does, with partial participation, several local epochs and FedAvgM.
TEST(Simulation, AResumedRunEndsWhereAnUninterruptedOneDoes) {
  at::set_num_threads(1);
  const auto train = synthetic64(400, 7);
  const auto test = synthetic64(100, 8);
  SimulationOptions options;
  options.clients = 10;
  options.fraction = 0.3;
  options.rounds = 5;
  options.partition = parse_partition("shards:2");
  options.round.local.epochs = 2;
  options.round.local.batch = 8;
  options.round.local.lr = 0.05;
  options.round.aggregator.server.momentum = 0.5;
  options.dropout = 0.2;
  options.threads = 2;
  options.progress = false;
  const auto straight = simulate(mlp_spec(), train, test, options);
  EXPECT_EQ(straight.rounds_done, 5);
  int64_t dropped = 0;
  for (const auto& r : straight.rounds) {
    EXPECT_EQ(r.outcome.selected, 3);
    EXPECT_EQ(r.outcome.finished + r.outcome.dropped, 3);
    dropped += r.outcome.dropped;
    if (r.outcome.applied) {
      // Measured on the upload's messages: the float64 update and a few header bytes.
      const int64_t payload = r.outcome.finished * 8 * straight.global.numel();
      EXPECT_GE(r.uplink_bytes, payload);
      EXPECT_LE(r.uplink_bytes, payload + r.outcome.finished * 100);
    }
  }
  test::TempDir dir;
  options.checkpoint_dir = dir.path();
  options.metrics_file = dir / "metrics.jsonl";
  options.rounds = 3;
  EXPECT_EQ(simulate(mlp_spec(), train, test, options).rounds_done, 3);
  options.rounds = 5;
  const auto resumed = simulate(mlp_spec(), train, test, options);
  EXPECT_EQ(resumed.start_round, 3);
  EXPECT_EQ(resumed.rounds_done, 5);
  // Two threads add the updates in either order: equal up to float64 rounding.
  EXPECT_LE((resumed.global - straight.global).abs().max().item<double>(), kTightBound);
  std::ifstream metrics(dir / "metrics.jsonl");
  int evaluated = 0;
  for (std::string line; std::getline(metrics, line);) {
    evaluated += line.find("\"test_accuracy\"") != std::string::npos;
  }
  EXPECT_EQ(evaluated, 5);  // one line per applied round, evaluated, across the two runs
  EXPECT_GT(dropped, 0);
}

namespace {

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// `o` run straight through, and run to its middle round and resumed from the checkpoint there.
std::pair<SimulationResult, SimulationResult> straight_and_resumed(
    SimulationOptions o, const data::TensorDataset& train, const data::TensorDataset& test) {
  const auto straight = simulate(mlp_spec(), train, test, o);
  const test::TempDir dir;
  o.checkpoint_dir = dir.path();
  const int64_t rounds = o.rounds;
  o.rounds = rounds / 2;
  simulate(mlp_spec(), train, test, o);
  o.rounds = rounds;
  auto resumed = simulate(mlp_spec(), train, test, o);
  EXPECT_EQ(resumed.start_round, rounds / 2);
  return {straight, resumed};
}

}  // namespace

// A resumed simulation keeps what its clients carry between rounds (SCAFFOLD's and FedDyn's
// client state, top-k's error-feedback residuals) and so goes on as the uninterrupted run.
TEST(FederatedSimulation, AResumedRunKeepsTheClientsStateAndItsAttempts) {
  at::set_num_threads(1);
  const auto train = synthetic64(240, 37);
  const auto test = synthetic64(40, 37);
  for (const std::string algorithm : {"scaffold", "feddyn"}) {
    SimulationOptions o = one_thread_run(algorithm);
    o.clients = 6;
    o.fraction = 0.5;
    o.rounds = 6;
    o.threads = 1;  // the updates summed in one order: the runs are equal bit for bit
    o.compression = comm::parse_compression("topk:0.3");
    const auto [straight, resumed] = straight_and_resumed(o, train, test);
    EXPECT_TRUE(resumed.global.equal(straight.global))
        << algorithm << ": " << max_difference(resumed.global, straight.global);
  }
  // Retried rounds count in the simulated time that availability windows are read at: a
  // resumed run goes on from the attempts the checkpoint saved, not from its rounds.
  SimulationOptions o = one_thread_run("fedavg");
  o.clients = 24;
  o.fraction = 0.25;
  o.rounds = 6;
  o.dropout = 0.5;
  o.round.min_clients = 3;  // rounds where fewer than 3 finish are retried
  o.availability = parse_availability_trace("diurnal:8");
  const auto [straight, resumed] = straight_and_resumed(o, train, test);
  size_t retried_before_the_save = 0;  // attempts before the third applied round, not applied
  for (size_t i = 0, applied = 0; i < straight.rounds.size() && applied < 3; ++i) {
    applied += straight.rounds[i].outcome.applied ? 1 : 0;
    retried_before_the_save += straight.rounds[i].outcome.applied ? 0 : 1;
  }
  ASSERT_GT(retried_before_the_save, 0u);
  EXPECT_TRUE(resumed.global.equal(straight.global))
      << "retries: " << max_difference(resumed.global, straight.global);
}

// ---- Personalization ----

// Fine-tuning only the last layer leaves every other parameter at the global value; on clients
// of one class each, the fine-tuned models beat the global one on the clients' own tests.
TEST(Personalization, FineTuningTheLastLayerKeepsTheRestAndHelpsOnSkewedClients) {
  at::set_num_threads(1);
  const auto train = synthetic64(600, 41);
  Model model = model64(0);
  const auto groups = parameter_groups(model);
  ASSERT_GE(groups.size(), 2u);
  const at::Tensor global = flatten_parameters(model);
  LocalTraining plan;
  plan.epochs = 3;
  plan.batch = 10;
  plan.lr = 0.1;
  fine_tune(model, global, train, range(0, 100), plan, 1, 0);
  // Parameters in order: all but the last group's must not have moved.
  int64_t frozen = 0;
  for (size_t g = 0; g + 1 < groups.size(); ++g) {
    for (const auto& name : groups[g]) frozen += model.module->named_parameters()[name].numel();
  }
  const at::Tensor after = flatten_parameters(model);
  EXPECT_TRUE(at::equal(after.narrow(0, 0, frozen), global.narrow(0, 0, frozen)));
  EXPECT_GT((after.narrow(0, frozen, global.numel() - frozen) -
             global.narrow(0, frozen, global.numel() - frozen))
                .abs()
                .max()
                .item<double>(),
            1e-3);
  for (auto& p : model.module->parameters()) EXPECT_TRUE(p.requires_grad());
  EXPECT_THROW(fine_tune(model, global, train, range(0, 10), plan, 99, 0), InputError);
  // Clients of one class each (shards:1), the global model untrained: fine-tuning wins.
  const auto clients = partition(train.targets(), 8, parse_partition("shards:1"), 3, 0.3);
  const PersonalizationReport report =
      personalize(mlp_spec(), global, train, clients, plan, 0, 2, 7);
  ASSERT_EQ(report.global_accuracy.size(), 8u);
  EXPECT_GT(report.mean_personalized, report.mean_global + 0.3);
  EXPECT_GT(report.mean_personalized, 0.9);
}

// ---- Availability ----

// A diurnal trace: each client is available its `hours` a day (a fixed local window), clients'
// windows are spread over the day, and the simulation selects only among those available and
// loses those whose window closes mid-round.
TEST(Availability, DiurnalTracesDriveWhoCanBeSelected) {
  const AvailabilityTrace trace = parse_availability_trace("diurnal:6");
  for (int64_t c = 0; c < 20; ++c) {
    int on = 0;
    for (int minute = 0; minute < 1440; ++minute) on += trace.available(c, minute, 3);
    EXPECT_NEAR(on, 360, 1) << "client " << c;
  }
  for (const double minute : {0.0, 400.0, 1000.0}) {
    int on = 0;
    for (int64_t c = 0; c < 1000; ++c) on += trace.available(c, minute, 3);
    EXPECT_NEAR(on, 250, 60) << "at minute " << minute;  // a quarter, binomial sd 14
  }
  EXPECT_TRUE(parse_availability_trace("always").available(5, 123, 0));
  EXPECT_THROW(parse_availability_trace("diurnal:30"), InputError);
  EXPECT_THROW(parse_availability_trace("sometimes"), InputError);

  at::set_num_threads(1);
  const auto train = synthetic64(400, 51);
  const auto test = synthetic64(100, 52);
  SimulationOptions options;
  options.clients = 40;
  options.fraction = 0.25;
  options.rounds = 8;
  options.round.local.epochs = 1;
  options.availability = trace;
  options.availability.round_minutes = 90;
  options.threads = 1;
  options.progress = false;
  const auto result = simulate(mlp_spec(), train, test, options);
  int64_t dropped = 0;
  for (const auto& r : result.rounds) {
    EXPECT_GT(r.available, 0);
    EXPECT_LT(r.available, 40);
    EXPECT_EQ(r.outcome.selected, std::min<int64_t>(10, r.available));
    dropped += r.outcome.dropped;
  }
  // 90-minute rounds in 6-hour windows: about a quarter of the selected leave mid-round.
  EXPECT_GT(dropped, 0);
}

// Secure aggregation over gRPC: four client threads, every round all four selected; after two
// rounds the model is plaintext FedAvg's up to the fixed point. Then one client leaves each
// round after sharing its keys (it becomes unavailable when training starts): the survivors'
// reveals let the server remove its masks and the rounds are applied with three.

TEST(FedAvg, TheLocalRateDecaysByRound) {
  LocalTraining plan;
  plan.lr = 0.1;
  plan.lr_decay = 0.9;
  EXPECT_DOUBLE_EQ(plan_for_round(plan, 0).lr, 0.1);
  EXPECT_NEAR(plan_for_round(plan, 3).lr, 0.1 * 0.729, 1e-15);
  EXPECT_EQ(plan_for_round(plan, 3).lr_decay, 1.0);
  plan.lr_decay = 1.5;
  EXPECT_THROW(validate(plan), InputError);
}

// The client-tokens file: each bad line is named; a duplicate client or a bad id too.

TEST(Simulation, DivergedClientsLeaveTheRoundAndADivergedRunStops) {
  at::set_num_threads(1);
  const auto train = synthetic64(200, 95);
  const auto test = synthetic64(50, 96);
  SimulationOptions options;
  options.clients = 4;
  options.fraction = 1.0;
  options.rounds = 3;
  options.round.local.lr = 1e300;  // the first step overflows
  options.threads = 1;
  options.progress = false;
  try {
    simulate(mlp_spec(), train, test, options);
    ADD_FAILURE() << "a diverged run went on";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("round 1: only 0 of 4 clients finished, 10 times in a row"),
        std::string::npos)
        << e.what();
  }
}
