// Federated learning's core: partitions (IID, McMahan's shards, Dirichlet skew), FedAvg against
// centralized training in float64 (one client with E = 1 and its full batch is gradient descent;
// two clients' example-weighted mean is gradient descent on their union, and the oracle notices
// an update left out or weighted wrongly), the server's checks and rounds (refusals change
// nothing, too few finishers retry the round, selection by seed and round, resume from the
// checkpoint), the server optimizers (FedAvgM, FedAdam) and FedProx.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <numeric>
#include <set>

#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/federated/FedAvg.h"
#include "dtrain/parallel/federated/Partition.h"
#include "dtrain/parallel/federated/RoundServer.h"
#include "dtrain/parallel/federated/Simulation.h"

using namespace dtrain;
using namespace dtrain::federated;

namespace {

constexpr double kTightBound = 1e-12;

// 10 classes of `per_class` examples each, labels in a shuffled order.
at::Tensor balanced_labels(int64_t per_class) {
  at::Tensor labels = at::arange(10, at::kLong).repeat_interleave(per_class);
  return labels.index_select(0, at::randperm(labels.numel(), at::detail::createCPUGenerator(5)));
}

double mean_classes(const at::Tensor& labels, const std::vector<ClientIndices>& parts) {
  double sum = 0;
  for (const auto& p : parts) {
    std::vector<int64_t> all = p.train;
    all.insert(all.end(), p.test.begin(), p.test.end());
    sum += static_cast<double>(classes_among(labels, all));
  }
  return sum / static_cast<double>(parts.size());
}

models::ModelSpec mlp_spec() {
  models::ModelSpec spec;
  spec.name = "mlp";
  spec.input_shape = {12};
  spec.hidden = {16};
  spec.classes = 4;
  return spec;
}

data::TensorDataset synthetic64(int64_t n, uint64_t seed) {
  const auto d = data::make_synthetic(n, {12}, 4, seed);
  return data::TensorDataset(d.raw_inputs().to(at::kDouble), d.targets());
}

Model model64(uint64_t seed) {
  torch::manual_seed(seed);
  Model model = models::make_model(mlp_spec());
  model.module->to(at::kDouble);
  return model;
}

// Full-batch gradient descent on examples `indices` from `start`, `steps` steps.
at::Tensor gradient_descent(const data::TensorDataset& data, const std::vector<int64_t>& indices,
                            const at::Tensor& start, double lr, int steps) {
  Model model = model64(0);
  load_flat_parameters(model, start);
  auto params = model.module->parameters();
  const data::Batch b = data.get(indices);
  for (int s = 0; s < steps; ++s) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    parallel::cross_entropy(model(b.inputs), b.targets).backward();
    torch::NoGradGuard no_grad;
    for (auto& p : params) p.add_(p.grad(), -lr);
  }
  return flatten_parameters(model);
}

std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

}  // namespace

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
  options.local.lr = 0.3;
  apply_algorithm("fedsgd", &options.local);
  options.threads = 1;
  options.progress = false;
  options.seed = 9;
  const auto result = simulate(mlp_spec(), train, synthetic64(32, 2), options);
  EXPECT_EQ(result.rounds_done, 6);
  ASSERT_EQ(result.rounds.size(), 6u);
  const at::Tensor start = flatten_parameters(model64(9));
  // The one client holds every example (in its own order: full-batch gradients do not care).
  const at::Tensor expected = gradient_descent(train, range(0, 64), start, 0.3, 6);
  EXPECT_LE((result.global - expected).abs().max().item<double>(), kTightBound);
  EXPECT_GT((expected - start).abs().max().item<double>(), 1e-3);
  // One step fewer is far outside the bound.
  EXPECT_GT((gradient_descent(train, range(0, 64), start, 0.3, 5) - expected).abs().max().item<double>(),
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
  LocalTraining local;
  local.lr = 0.5;
  apply_algorithm("fedsgd", &local);
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

TEST(FedAvg, TheProximalTermKeepsTheLocalModelNearTheGlobalOne) {
  at::set_num_threads(1);
  const auto data = synthetic64(80, 5);
  Model replica = model64(6);
  const at::Tensor start = flatten_parameters(replica);
  LocalTraining local;
  local.epochs = 5;
  local.batch = 10;
  local.lr = 0.1;
  const double free = train_locally(replica, start, data, range(0, 80), local, 1).delta.norm().item<double>();
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
  options.local.epochs = 2;
  options.local.batch = 8;
  options.local.lr = 0.05;
  options.server.momentum = 0.5;
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
      EXPECT_EQ(r.uplink_bytes, r.outcome.finished * 8 * straight.global.numel());
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
