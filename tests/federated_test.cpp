// Federated learning's core: partitions (IID, McMahan's shards, Dirichlet skew), FedAvg against
// centralized training in float64 (one client with E = 1 and its full batch is gradient descent;
// two clients' example-weighted mean is gradient descent on their union, and the oracle notices
// an update left out or weighted wrongly), the server's checks and rounds (refusals change
// nothing, too few finishers retry the round, selection by seed and round, resume from the
// checkpoint), the server optimizers (FedAvgM, FedAdam) and FedProx.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <numeric>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <thread>

#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/Client.h"
#include "dtrain/services/federated/Compression.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Partition.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/SecureAggregation.h"
#include "dtrain/services/federated/Server.h"
#include "dtrain/services/federated/Simulation.h"
#include "services/federated/FlWire.h"
#include "services/federated/SecureServerRound.h"

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

models::ModelSpec mlp_spec() { return test::small_mlp(12, 16, 4); }

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
  options.algorithm = "fedsgd";
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
  EXPECT_THROW(make_aggregator("trimmed-mean", plain), InputError);

  // FedAvgM: v = 0.9 v + mean, global += lr v.
  AggregatorOptions momentum;
  momentum.server.momentum = 0.9;
  auto fedavgm = make_aggregator("fedavgm", momentum);
  at::Tensor global = at::zeros({2}, at::kDouble);
  const at::Tensor mean = at::tensor({1.0, -2.0}, at::kDouble);
  fedavgm->aggregate(global, {0, mean, {}});
  fedavgm->aggregate(global, {1, mean, {}});
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

// The bytes an encoded update takes in its upload's messages.
int64_t upload_bytes(const EncodedUpdate& encoded) {
  int64_t bytes = 0;
  for (const auto& m : wire::update_messages(encoded, "c", 1, 10, 0.0, 1 << 20)) {
    bytes += wire::message_bytes(m);
  }
  return bytes;
}

// Through the upload's messages and back, as the server reads them.
at::Tensor round_trip(const EncodedUpdate& encoded, int64_t n, at::ScalarType dtype) {
  dtrain::fl::UpdateChunk header;
  EncodedUpdate received;
  at::Tensor out;
  const auto messages = wire::update_messages(encoded, "c", 1, 10, 0.0, 4096);
  EXPECT_EQ(wire::read_update(messages, n, &header, &received), "");
  EXPECT_EQ(decode_update(received, n, dtype, &out), "");
  return out;
}

}  // namespace

// 8-bit quantization with stochastic rounding: every decoded element is within one step of the
// value, the mean of many decodings converges to it (unbiased; rounding to the nearest level
// would not, and the bound sees that), and the upload is >= 3.9x smaller than float32's.
TEST(Compression, EightBitStochasticRoundingIsUnbiasedAndFourTimesSmaller) {
  const int64_t n = 2500;  // two whole blocks and a partial one
  at::Generator gen = at::detail::createCPUGenerator(3);
  const at::Tensor x = at::randn({n}, gen, at::kFloat) * 0.01;
  const CompressionSpec spec = parse_compression("q8");
  const int trials = 400;
  at::Tensor sum = at::zeros({n}, at::kDouble);
  at::Tensor step;
  for (int t = 0; t < trials; ++t) {
    const EncodedUpdate encoded = encode_update(x, spec, nullptr, 100 + t);
    const at::Tensor* s = &encoded.parts[2].second;
    ASSERT_EQ(encoded.parts[2].first, "step");
    step = s->to(at::kDouble).repeat_interleave(kQuantBlock).slice(0, 0, n);
    const at::Tensor decoded = round_trip(encoded, n, at::kFloat).to(at::kDouble);
    EXPECT_TRUE(((decoded - x.to(at::kDouble)).abs() <= step * (1 + 1e-6)).all().item<bool>());
    sum += decoded;
  }
  // Each rounding's error has a standard deviation <= step / 2: the mean's is step / (2 sqrt T).
  const at::Tensor bound = 6 * step / (2 * std::sqrt(static_cast<double>(trials)));
  const at::Tensor mean_error = (sum / trials - x.to(at::kDouble)).abs();
  EXPECT_TRUE((mean_error <= bound).all().item<bool>())
      << "largest bias " << (mean_error / bound).max().item<double>() << " of the bound";
  // Rounding to the nearest level is biased by up to half a step: the same bound catches it.
  const EncodedUpdate first = encode_update(x, spec, nullptr, 1);
  const at::Tensor lo = first.parts[1].second.to(at::kDouble).repeat_interleave(kQuantBlock).slice(0, 0, n);
  const at::Tensor nearest = lo + at::round((x.to(at::kDouble) - lo) / step) * step;
  EXPECT_FALSE(((nearest - x.to(at::kDouble)).abs() <= bound).all().item<bool>());
  // Bytes: 1 per element and 8 per block against 4 per element (a model of 100k parameters).
  const at::Tensor big = at::randn({100000}, gen, at::kFloat);
  const double ratio = static_cast<double>(upload_bytes(encode_update(big, {}, nullptr, 0))) /
                       static_cast<double>(upload_bytes(encode_update(big, spec, nullptr, 0)));
  EXPECT_GE(ratio, 3.9);
  EXPECT_LT(ratio, 4.0);
}

// Top-k with error feedback loses nothing, it only delays: after several updates, what was sent
// plus the residual left on the client is exactly the sum of the updates (float64). Without
// error feedback the unsent part is gone, and the same check fails.
TEST(Compression, TopKWithErrorFeedbackSendsEverythingEventually) {
  const int64_t n = 1000;
  const CompressionSpec spec = parse_compression("topk:0.02");
  CompressionSpec no_feedback = spec;
  no_feedback.error_feedback = false;
  for (const CompressionSpec& s : {spec, no_feedback}) {
    at::Tensor residual, sent = at::zeros({n}, at::kDouble), total = at::zeros({n}, at::kDouble);
    for (int round = 0; round < 6; ++round) {
      const at::Tensor delta = at::randn({n}, at::detail::createCPUGenerator(40 + round), at::kDouble);
      const EncodedUpdate encoded = encode_update(delta, s, &residual, 0);
      EXPECT_EQ(encoded.parts[0].second.numel(), 20);  // ceil(0.02 n)
      EXPECT_EQ(encoded.parts[0].second.scalar_type(), at::kInt);
      sent += round_trip(encoded, n, at::kDouble);
      total += delta;
    }
    const at::Tensor left = residual.defined() ? residual : at::zeros({n}, at::kDouble);
    const double error = (sent + left - total).abs().max().item<double>();
    if (s.error_feedback) {
      EXPECT_LE(error, kTightBound);
    } else {
      EXPECT_GT(error, 1.0);
    }
  }
  // 2% of float32 elements as (int32 index, float32 value): >= 20x fewer bytes.
  const at::Tensor x = at::randn({100000}, at::detail::createCPUGenerator(9));
  at::Tensor r;
  EXPECT_GE(static_cast<double>(upload_bytes(encode_update(x, {}, nullptr, 0))) /
                static_cast<double>(upload_bytes(encode_update(x, spec, &r, 0))),
            24.0);
}

// A malformed encoding or upload is refused with the field named; nothing is decoded.
TEST(Compression, MalformedUpdatesAreRefusedByName) {
  const int64_t n = 10;
  at::Tensor out;
  auto why = [&](EncodedUpdate e) {
    out = at::Tensor();
    const std::string reason = decode_update(e, n, at::kFloat, &out);
    EXPECT_FALSE(out.defined()) << reason;
    return reason;
  };
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  EXPECT_TRUE(has(why({"none", {{"delta", at::ones({9})}}}), "holds 9 elements, expected 10"));
  EXPECT_TRUE(has(why({"none", {{"delta", at::full({10}, NAN)}}}), "NaN or Inf"));
  EXPECT_TRUE(has(why({"none", {{"delta", at::ones({10}, at::kLong)}}}), "part 'delta'"));
  EXPECT_TRUE(has(why({"zip", {{"delta", at::ones({10})}}}), "unknown encoding 'zip'"));
  EXPECT_TRUE(has(why({"q8", {{"q", at::ones({10}, at::kByte)}, {"lo", at::zeros({1})}}}), "2 parts, not 3"));
  EXPECT_TRUE(has(why({"q8", {{"q", at::ones({10}, at::kByte)}, {"lo", at::zeros({1})},
                              {"step", -at::ones({1})}}}), "negative step"));
  EXPECT_TRUE(has(why({"topk", {{"indices", at::tensor({3, 10}, at::kInt)}, {"values", at::ones({2})}}}),
                  "outside [0, 10)"));
  EXPECT_TRUE(has(why({"topk", {{"indices", at::tensor({3, 3}, at::kInt)}, {"values", at::ones({2})}}}),
                  "not strictly increasing"));
  EXPECT_TRUE(has(why({"topk", {{"indices", at::tensor({3}, at::kInt)}, {"values", at::ones({2})}}}),
                  "holds 2 elements, expected 1"));
  // The messages: an unknown part, a part longer than the model, a gap, a part cut short.
  wire::PartsReader reader({{"delta", n}});
  dtrain::rpc::TensorChunk chunk;
  chunk.set_name("weights");
  EXPECT_TRUE(has(reader.add(chunk, "chunk 0"), "field 'name' is 'weights'"));
  chunk.set_name("delta");
  chunk.set_dtype(dtrain::rpc::FLOAT32);
  chunk.add_shape(11);
  EXPECT_TRUE(has(reader.add(chunk, "chunk 0"), "field 'shape'"));
  chunk.set_shape(0, 10);
  chunk.set_data(std::string(16, '\0'));
  EXPECT_EQ(reader.add(chunk, "chunk 0"), "");
  chunk.set_offset(5);
  EXPECT_TRUE(has(reader.add(chunk, "chunk 1"), "part 'delta' continues at 4"));
  wire::Parts parts;
  EXPECT_TRUE(has(reader.finish(&parts), "ended after 4 of its 10 elements"));
  chunk.set_offset(4);
  chunk.set_data(std::string(28, '\0'));
  EXPECT_TRUE(has(reader.add(chunk, "chunk 1"), "outside [0, 10)"));
}

// Top-k of 5% with error feedback converges, only later: in twice the rounds it gets the global
// model's training loss below what sending everything reaches; dropping what was not sent (no
// error feedback) ends at least 1.5x higher in the same rounds. Float64, a fixed seed: the same on any CPU.
TEST(Compression, TopKWithErrorFeedbackConvergesAndWithoutItLags) {
  at::set_num_threads(1);
  const auto train = synthetic64(800, 17);
  const auto test = synthetic64(400, 18);
  SimulationOptions options;
  options.clients = 10;
  options.fraction = 0.5;
  options.rounds = 30;
  options.local.epochs = 1;
  options.local.batch = 20;
  options.local.lr = 0.1;
  options.threads = 1;
  options.progress = false;
  auto final_loss = [&](const std::string& compression, bool feedback) {
    options.compression = parse_compression(compression);
    options.compression.error_feedback = feedback;
    const auto result = simulate(mlp_spec(), train, test, options);
    // The global model's loss on all training examples: what the rounds minimize.
    Model model = model64(0);
    load_flat_parameters(model, result.global);
    return evaluate_model(model, train).first;
  };
  const double plain = final_loss("none", true);
  options.rounds = 60;
  const double with_feedback = final_loss("topk:0.05", true);
  const double without = final_loss("topk:0.05", false);
  std::printf("training loss: uncompressed after 30 rounds %.4f; top-5%% after 60 rounds: with "
              "error feedback %.4f, without %.4f\n", plain, with_feedback, without);
  EXPECT_LT(with_feedback, plain);
  EXPECT_GT(without, with_feedback * 1.5);
}

// ---- The gRPC server and clients (in-process, on 127.0.0.1) ----

namespace {

// The client's model: the test's float64 MLP, whatever the server names.
Client::ModelFactory test_model() {
  return [](const std::string&, const std::vector<int64_t>&) { return model64(0); };
}

ServerOptions server_options(int64_t rounds, int64_t k) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.rounds = rounds;
  o.clients_per_round = k;
  o.local.epochs = 1;
  o.local.batch = 0;  // full batch: the order of examples does not matter
  o.local.lr = 0.1;
  o.round_timeout_s = 30;
  o.wait_timeout_s = 30;
  o.progress = false;
  return o;
}

ClientOptions client_options(const Server& server, const std::string& id) {
  ClientOptions o;
  o.server = server.address();
  o.client_id = id;
  o.wait = std::chrono::milliseconds(500);
  o.retry_window = std::chrono::milliseconds(5000);
  return o;
}

// Runs `clients` (each its id, examples and options tweak) against `server` in threads.
std::vector<ClientReport> run_clients(
    Server& server, const data::TensorDataset& train,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& clients,
    ServerResult* result, const std::function<void(ClientOptions&)>& tweak = nullptr) {
  std::vector<ClientReport> reports(clients.size());
  std::vector<std::string> errors(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        at::set_num_threads(1);
        ClientOptions o = client_options(server, clients[i].first);
        if (tweak) tweak(o);
        Client client(test_model(), train, clients[i].second, o);
        reports[i] = client.run();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  *result = server.run();
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < clients.size(); ++i) EXPECT_EQ(errors[i], "") << clients[i].first;
  return reports;
}

}  // namespace

// Three client processes' worth of clients (threads) over gRPC: every round selects all three,
// and after 3 rounds the global model is exactly (float64, 1e-12) what FedAvg computed in one
// process gives: the protocol moves the model and the updates without changing a bit.
TEST(FederatedServer, ClientsOverGrpcTrainTheModelFedAvgComputesInProcess) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 21);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  Server server(initial, server_options(3, 3));
  ServerResult result;
  const auto reports = run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 3);
  // The reference: the example-weighted mean of each client's full-batch step, three times.
  at::Tensor global = initial.clone();
  Model model = model64(0);
  LocalTraining plan = server_options(3, 3).local;
  for (int round = 0; round < 3; ++round) {
    WeightedMean mean;
    for (const auto& [id, indices] : clients) {
      const ClientUpdate u = train_locally(model, global, train, indices, plan, 0);
      mean.add(u.delta, static_cast<double>(u.examples));
    }
    global += mean.mean(at::kDouble);
  }
  EXPECT_LE((result.global - global).abs().max().item<double>(), kTightBound);
  EXPECT_GT((result.global - initial).abs().max().item<double>(), 1e-3);
  for (const auto& r : result.rounds) {
    EXPECT_EQ(r.outcome.selected, 3);
    EXPECT_EQ(r.outcome.finished, 3);
    // Measured: each client's float64 update (and each download) plus message headers.
    EXPECT_GE(r.uplink_bytes, 3 * 8 * initial.numel());
    EXPECT_LE(r.uplink_bytes, 3 * 8 * initial.numel() + 3 * 100);
    EXPECT_GE(r.downlink_bytes, 3 * 8 * initial.numel());
  }
  for (const auto& report : reports) {
    EXPECT_EQ(report.rounds_trained, 3);
    EXPECT_EQ(report.done_reason, "the last round is over");
  }
}

// A straggler past the round's deadline is dropped and the round closes with those that
// finished (>= --min-clients); a client whose availability ends mid-round leaves it.
TEST(FederatedServer, StragglersAreDroppedAndTheRoundClosesWithTheRest) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 22);
  ServerOptions options = server_options(2, 3);
  options.min_clients = 2;
  options.round_timeout_s = 2;
  Server server(flatten_parameters(model64(0)), options);
  std::atomic<int> asked{0};
  ServerResult result;
  const auto reports = run_clients(
      server, train, {{"a", range(0, 30)}, {"b", range(30, 60)}, {"slow", range(60, 90)}}, &result,
      [&](ClientOptions& o) {
        if (o.client_id != "slow") return;
        // Available for its check-ins, gone as soon as it starts training.
        o.available = [&] { return ++asked % 2 == 1; };
      });
  ASSERT_EQ(result.rounds_done, 2);
  for (const auto& r : result.rounds) {
    EXPECT_TRUE(r.outcome.applied);
    EXPECT_EQ(r.outcome.finished, 2);
    EXPECT_EQ(r.outcome.dropped, 1);
  }
  EXPECT_EQ(reports[2].rounds_trained, 0);
  EXPECT_GE(reports[2].rounds_abandoned, 2);
}

// A client still training when the round's deadline passes does not send its update into a
// closed round: its upload's call ends at the deadline the check-in named, it counts the round
// as missed and says so, and the server never sees a late upload. The other client's lines
// trace its round (selected, update sent, told it is over).
TEST(FederatedServer, AClientPastTheRoundsDeadlineLeavesWithoutUploading) {
  at::set_num_threads(1);
  const auto train = synthetic64(60, 24);
  ServerOptions options = server_options(1, 2);
  options.min_clients = 1;
  options.round_timeout_s = 1.5;
  Server server(flatten_parameters(model64(0)), options);
  std::mutex mutex;
  std::map<std::string, std::vector<std::string>> lines;
  ServerResult result;
  const auto reports = run_clients(
      server, train, {{"a", range(0, 30)}, {"late", range(30, 60)}}, &result,
      [&](ClientOptions& o) {
        const std::string id = o.client_id;
        o.log = [&, id](const std::string& line) {
          std::lock_guard<std::mutex> lock(mutex);
          lines[id].push_back(line);
        };
        if (id != "late") return;
        // Available; the first check during local training takes 2.5 s (past the deadline).
        o.available = [calls = std::make_shared<int>(0)] {
          if (++*calls == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return true;
        };
      });
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.rounds[0].outcome.finished, 1);
  EXPECT_EQ(result.rounds[0].outcome.dropped, 1);
  EXPECT_EQ(result.late, 0);
  EXPECT_EQ(reports[1].rounds_trained, 0);
  EXPECT_EQ(reports[1].rounds_missed, 1);
  EXPECT_EQ(reports[1].uploads_refused, 0);
  auto has = [&](const std::string& id, const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    return std::any_of(lines[id].begin(), lines[id].end(),
                       [&](const std::string& l) { return l.find(text) != std::string::npos; });
  };
  EXPECT_TRUE(has("late", "round 1: left before its update was sent: Upload: the round's deadline passed"));
  EXPECT_TRUE(has("a", "round 1: selected (1 epochs, batch 0, 30 examples; deadline in"));
  EXPECT_TRUE(has("a", "round 1: update sent ("));
  EXPECT_TRUE(has("a", "the server says the last round is over"));
}

// Per-client tokens: a client without its token is refused by name; an update from a client
// that was not selected and one holding NaN are refused and logged, and the round goes on with
// the selected client's real update.
TEST(FederatedServer, BadClientsAndBadUpdatesAreRefusedWithoutAffectingTheRound) {
  at::set_num_threads(1);
  const auto train = synthetic64(40, 23);
  ServerOptions options = server_options(1, 1);
  options.client_tokens = {{"a", "token-a"}, {"b", "token-b"}};
  const at::Tensor initial = flatten_parameters(model64(0));
  Server server(initial, options);
  // A wrong token: refused at check-in, an InputError naming the reason.
  {
    ClientOptions o = client_options(server, "b");
    o.token = "token-a";
    Client intruder(test_model(), train, range(0, 10), o);
    try {
      intruder.run();
      ADD_FAILURE() << "a client with another's token took part";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("token is wrong"), std::string::npos) << e.what();
    }
  }
  // Client a trains; its first local step waits until the bad uploads were made.
  std::atomic<bool> bad_done{false};
  ServerResult result;
  std::thread bad([&] {
    auto stub = dtrain::fl::Federated::NewStub(
        grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    auto upload = [&](const std::string& id, const std::string& token, const at::Tensor& delta) {
      grpc::ClientContext context;
      context.AddMetadata("authorization", "Bearer " + token);
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      for (const auto& m : wire::update_messages(encode_update(delta, {}, nullptr, 0), id, 1, 10,
                                                 0.0, 1 << 20)) {
        writer->Write(m);
      }
      writer->WritesDone();
      return writer->Finish();
    };
    const at::Tensor zeros = at::zeros_like(initial);
    // Until round 1 is open (bounded).
    grpc::Status status;
    for (int i = 0; i < 200; ++i) {
      status = upload("b", "token-b", zeros);
      if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_NE(status.error_message().find("'b' was not selected"), std::string::npos)
        << status.error_message();
    status = upload("a", "token-a", at::full_like(initial, NAN));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("NaN or Inf"), std::string::npos) << status.error_message();
    EXPECT_EQ(upload("a", "token-b", zeros).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    bad_done = true;
  });
  const auto reports = run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
    o.token = "token-a";
    // The first call is before its check-in; the later ones are its local steps.
    o.available = [&, calls = std::make_shared<int>(0)] {
      for (int i = 0; ++*calls > 1 && i < 400 && !bad_done; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      return true;
    };
  });
  bad.join();
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.refused, 2);
  EXPECT_EQ(reports[0].rounds_trained, 1);
  // The round's model is a's update alone.
  Model model = model64(0);
  const ClientUpdate u = train_locally(model, initial, train, range(0, 40), options.local, 0);
  EXPECT_LE((result.global - (initial + u.delta)).abs().max().item<double>(), kTightBound);
}

TEST(FederatedServer, AvailabilityWindowsCrossMidnight) {
  EXPECT_TRUE(available_at("22:00-06:00", 23 * 60));
  EXPECT_TRUE(available_at("22:00-06:00", 5 * 60 + 59));
  EXPECT_FALSE(available_at("22:00-06:00", 6 * 60));
  EXPECT_FALSE(available_at("22:00-06:00", 12 * 60));
  EXPECT_TRUE(available_at("09:00-10:00,13:00-14:30", 14 * 60 + 29));
  EXPECT_FALSE(available_at("09:00-10:00,13:00-14:30", 11 * 60));
  EXPECT_TRUE(available_at("always", 0));
  EXPECT_THROW(available_at("25:00-06:00", 0), InputError);
  EXPECT_THROW(available_at("22:00", 0), InputError);
  EXPECT_THROW(available_at("08:00-08:00", 0), InputError);
}

// ---- Secure aggregation ----

namespace {

struct SecAggRound {
  at::Tensor sum;                 // the server's result
  at::Tensor plain;               // the survivors' inputs summed in the clear (mod 2^32)
  std::vector<at::Tensor> masked;  // what the server saw from each survivor
};

// n clients with random int32 inputs; `drop_before_masking` of them share keys and then leave,
// `drop_before_reveal` send masked inputs and leave before revealing.
SecAggRound secure_round(int n, int threshold, int64_t elements, int drop_before_masking,
                         int drop_before_reveal, uint64_t seed = 1) {
  using namespace secagg;
  std::vector<std::unique_ptr<ClientSession>> clients;
  ServerSession server(elements, threshold);
  for (int i = 0; i < n; ++i) {
    clients.push_back(std::make_unique<ClientSession>(static_cast<uint32_t>(100 + 7 * i), elements,
                                                      threshold));
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
    const at::Tensor x = at::randint(-(int64_t{1} << 31), int64_t{1} << 31, {elements}, gen, at::kLong)
                             .to(at::kInt);
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
  for (uint32_t id = 1; id <= 3; ++id) clients.push_back(std::make_unique<secagg::ClientSession>(id, 6, 2));
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
  EXPECT_EQ(reply.keys(2).s_public(), std::string(reinterpret_cast<const char*>(keys[2].s_public.data()), 32));
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
  for (const auto& pick : std::vector<std::vector<int>>{{0, 1, 2}, {4, 2, 0}, {1, 3, 4}, {0, 1, 2, 3, 4}}) {
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

TEST(SecureAggregation, BelowTheThresholdTheRoundAbortsSayingHowManyWereLeft) {
  try {
    secure_round(10, 6, 100, 5, 0);  // 5 masked inputs < 6
    ADD_FAILURE() << "a round below the threshold was aggregated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("5 clients sent masked inputs, fewer than the threshold 6"),
              std::string::npos) << e.what();
  }
  try {
    secure_round(10, 6, 100, 2, 3);  // 8 masked, 5 reveal
    ADD_FAILURE() << "masks were removed with too few reveals";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("5 clients revealed their shares, fewer than the threshold 6"),
              std::string::npos) << e.what();
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
  const at::Tensor ramp_bytes = at::from_blob(ramp.data_ptr(), {elements * 4}, at::kByte).to(at::kLong);
  const at::Tensor ramp_counts = at::bincount(ramp_bytes, {}, 256).to(at::kDouble);
  EXPECT_GT(((ramp_counts - expected).pow(2) / expected).sum().item<double>(), 1e4);
  // Correlation of the masked words (as unsigned) with the input: |r| < 4 / sqrt(n).
  const at::Tensor u = (y.to(at::kLong) & int64_t{0xffffffff}).to(at::kDouble);
  const at::Tensor x = ramp.to(at::kDouble);
  const double r = (((u - u.mean()) * (x - x.mean())).mean() / (u.std(false) * x.std(false))).item<double>();
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
    EXPECT_NE(std::string(e.what()).find("from client 2 do not open"), std::string::npos) << e.what();
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
  options.local.epochs = 2;
  options.local.batch = 10;
  options.dropout = 0.3;
  options.threads = 2;
  options.progress = false;
  const auto plain = simulate(mlp_spec(), train, test, options);
  options.secure_aggregation = true;
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
  options.compression = parse_compression("q8");
  EXPECT_THROW(simulate(mlp_spec(), train, test, options), InputError);
}

// ---- Differential privacy ----

// The sampled Gaussian's RDP from the binomial expansion equals a direct numerical integration
// of E_{N(0, z^2)}[((1 - q) + q exp((2x - 1) / (2 z^2)))^alpha]; at q = 1 it is the Gaussian's
// alpha / (2 z^2).
TEST(Privacy, SampledGaussianRdpMatchesItsIntegralAndTheGaussianAtFullSampling) {
  for (const double q : {0.01, 0.1, 0.5}) {
    for (const double z : {0.8, 1.5, 4.0}) {
      for (int alpha = 2; alpha <= 8; ++alpha) {
        // Trapezoid over +-40 z with 400k steps: far below the checked 1e-9 relative error.
        const int64_t steps = 400000;
        const double lo = -40 * z, hi = 40 * z, h = (hi - lo) / steps;
        const at::Tensor x = at::linspace(lo, hi, steps + 1, at::kDouble);
        const at::Tensor density = at::exp(-x.pow(2) / (2 * z * z)) / (z * std::sqrt(2 * M_PI));
        const at::Tensor ratio = (1 - q) + q * at::exp((2 * x - 1) / (2 * z * z));
        const at::Tensor f = density * ratio.pow(alpha);
        const double integral = (f.sum().item<double>() - 0.5 * (f[0].item<double>() + f[-1].item<double>())) * h;
        const double expected = std::log(integral) / (alpha - 1);
        EXPECT_NEAR(sampled_gaussian_rdp(q, z, alpha), expected, 1e-9 * std::max(1.0, expected))
            << "q " << q << " z " << z << " alpha " << alpha;
      }
    }
  }
  EXPECT_NEAR(sampled_gaussian_rdp(1.0, 2.0, 7), 7 / (2 * 4.0), 1e-12);
  EXPECT_EQ(sampled_gaussian_rdp(0.0, 2.0, 7), 0.0);
  // Epsilon grows with rounds and shrinks with noise; no noise is no privacy.
  const double base = dp_epsilon(0.01, 1.1, 1000, 1e-5).first;
  EXPECT_GT(dp_epsilon(0.01, 1.1, 4000, 1e-5).first, base);
  EXPECT_LT(dp_epsilon(0.01, 2.0, 1000, 1e-5).first, base);
  EXPECT_TRUE(std::isinf(dp_epsilon(0.01, 0.0, 10, 1e-5).first));
}

// The server refuses updates above the clip, weighs clients equally, and adds noise of
// standard deviation z S to the sum before dividing by the selected clients.
TEST(Privacy, TheServerChecksTheClipAndAddsNoiseOfTheRightSize) {
  const int64_t n = 20000;
  RoundServerOptions options;
  options.clients_per_round = 5;
  options.dp.clip = 2.0;
  options.dp.noise_multiplier = 1.5;
  RoundServer server(at::zeros({n}, at::kDouble), options);
  const auto chosen = server.select({"a", "b", "c", "d", "e"});
  ASSERT_EQ(chosen.size(), 5u);
  const std::string refused = server.submit("a", at::full({n}, 1.0, at::kDouble), 10);
  EXPECT_NE(refused.find("exceeds the clip 2"), std::string::npos) << refused;
  for (const auto& id : chosen) EXPECT_EQ(server.submit(id, at::zeros({n}, at::kDouble), 10), "");
  server.close();
  // All updates were zero: what moved is the noise / 5, standard deviation 1.5 x 2 / 5 = 0.6.
  const double sd = server.global().std().item<double>();
  EXPECT_NEAR(sd, 0.6, 0.6 * 0.03);
  // Without noise, equal weights whatever the example counts: mean = (u1 + u2) / selected.
  RoundServerOptions plain = options;
  plain.clients_per_round = 2;
  plain.dp.noise_multiplier = 0;
  RoundServer exact(at::zeros({4}, at::kDouble), plain);
  exact.select({"a", "b"});
  EXPECT_EQ(exact.submit("a", at::full({4}, 0.5, at::kDouble), 1), "");
  EXPECT_EQ(exact.submit("b", at::full({4}, -0.25, at::kDouble), 1000), "");
  exact.close();
  EXPECT_TRUE(at::allclose(exact.global(), at::full({4}, 0.125, at::kDouble), 0, 1e-15));
  // And clip_update scales down only what is above the norm.
  const at::Tensor big = at::full({4}, 3.0, at::kDouble);  // norm 6
  EXPECT_NEAR(clip_update(big, 2.0).norm().item<double>(), 2.0, 1e-12);
  EXPECT_TRUE(at::equal(clip_update(big, 10.0), big));
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
             global.narrow(0, frozen, global.numel() - frozen)).abs().max().item<double>(), 1e-3);
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
  options.local.epochs = 1;
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
TEST(FederatedServer, SecureAggregationOverGrpcSumsTheUpdatesAndSurvivesADropout) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 61);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}, {"d", range(90, 120)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(2, 4);
  options.secure_aggregation = true;
  Server server(initial, options);
  ServerResult result;
  run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 2);
  at::Tensor global = initial.clone();
  Model model = model64(0);
  for (int round = 0; round < 2; ++round) {
    WeightedMean mean;
    for (const auto& [id, indices] : clients) {
      const ClientUpdate u = train_locally(model, global, train, indices, options.local, 0);
      mean.add(u.delta, static_cast<double>(u.examples));
    }
    global += mean.mean(at::kDouble);
  }
  const double difference = (result.global - global).abs().max().item<double>();
  EXPECT_LT(difference, 1e-4);
  EXPECT_GT(difference, 0.0);  // fixed point: not the plaintext computation
  for (const auto& r : result.rounds) {
    EXPECT_EQ(r.outcome.finished, 4);
    EXPECT_GT(r.server_aggregation_s, 0.0);
  }

  // One client leaves after its keys and shares, each round: t = 3 of 4 survive it.
  ServerOptions dropping = options;
  dropping.round_timeout_s = 2.5;
  dropping.secagg_step_timeout_s = 5;
  dropping.secagg_threshold = 0.75;
  Server second(initial, dropping);
  std::atomic<int> asked{0};
  ServerResult with_dropout;
  const auto reports = run_clients(second, train, clients, &with_dropout, [&](ClientOptions& o) {
    if (o.client_id != "d") return;
    o.available = [&] { return ++asked % 2 == 1; };  // check-ins yes, training no
  });
  ASSERT_EQ(with_dropout.rounds_done, 2);
  for (const auto& r : with_dropout.rounds) {
    EXPECT_TRUE(r.outcome.applied);
    EXPECT_EQ(r.outcome.finished, 3);
    EXPECT_EQ(r.outcome.dropped, 1);
  }
  EXPECT_EQ(reports[3].rounds_trained, 0);
}

// A masked upload whose stream began while its client was selected but ends after the secure
// round was retried without it (the first attempt aborted: nobody sent keys) is refused by
// name, and the retried round sums its own clients' inputs only.
TEST(FederatedServer, AMaskedUploadFromBeforeARetryIsRefusedAndTheRetrySumsItsOwnClients) {
  at::set_num_threads(1);
  const auto train = synthetic64(60, 62);
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(1, 2);
  options.secure_aggregation = true;
  options.secagg_step_timeout_s = 1;
  options.round_timeout_s = 3;  // also the linger for x and y, who never hear the run is over
  Server server(initial, options);
  ServerResult result;
  std::thread serving([&] { result = server.run(); });
  auto stub = dtrain::fl::Federated::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  auto within = [](int seconds) {
    return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
  };
  // x and y check in together: the first attempt at round 1 selects them.
  std::vector<dtrain::fl::CheckInReply> replies(2);
  std::vector<std::thread> checkins;
  for (int i = 0; i < 2; ++i) {
    checkins.emplace_back([&, i] {
      dtrain::fl::CheckInRequest request;
      request.set_client_id(i == 0 ? "x" : "y");
      request.set_examples(10);
      request.set_wait_ms(10000);
      grpc::ClientContext context;
      context.set_deadline(within(20));
      EXPECT_TRUE(stub->CheckIn(&context, request, &replies[i]).ok());
    });
  }
  for (auto& t : checkins) t.join();
  ASSERT_EQ(replies[0].action(), dtrain::fl::CheckInReply::TRAIN);
  ASSERT_EQ(replies[1].action(), dtrain::fl::CheckInReply::TRAIN);
  // x opens a masked upload while selected (its first message is taken)...
  EncodedUpdate masked;
  masked.encoding = "secagg";
  masked.parts.emplace_back("masked", at::zeros({initial.numel() + 2}, at::kInt));
  const auto messages = wire::update_messages(masked, "x", 1, 10, 0.0, 256);
  ASSERT_GT(messages.size(), 1u);
  grpc::ClientContext upload_context;
  upload_context.set_deadline(within(30));
  dtrain::fl::UploadReply uploaded;
  auto writer = stub->Upload(&upload_context, &uploaded);
  ASSERT_TRUE(writer->Write(messages[0]));
  // ...neither sends keys, so the attempt aborts after the step timeout and the round is
  // retried with a and b, who check in only now; a holds its local training until x's
  // upload is over, so the retried round is open when it ends.
  std::atomic<bool> x_done{false};
  std::atomic<bool> a_selected{false};
  std::vector<std::thread> clients;
  std::vector<std::string> errors(2);
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] {
      try {
        at::set_num_threads(1);
        ClientOptions o = client_options(server, i == 0 ? "a" : "b");
        if (i == 0) {
          o.log = [&](const std::string& line) {
            if (line.find("round 1: selected") != std::string::npos) a_selected = true;
          };
          o.available = [&] {  // once selected (training), held until x's upload is over
            for (int k = 0; a_selected && k < 400 && !x_done; ++k) {
              std::this_thread::sleep_for(std::chrono::milliseconds(25));
            }
            return true;
          };
        }
        Client client(test_model(), train, i == 0 ? range(0, 20) : range(20, 60), o);
        client.run();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (int k = 0; k < 400 && !a_selected; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  EXPECT_TRUE(a_selected);
  for (size_t i = 1; i < messages.size(); ++i) writer->Write(messages[i]);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  x_done = true;
  for (auto& t : clients) t.join();
  serving.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("client 'x' is not in this secure round"), std::string::npos)
      << status.error_message();
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.rounds.back().outcome.finished, 2);
  EXPECT_EQ(result.refused, 1);
  // The round's model: a's and b's updates, example-weighted (fixed point: within 1e-4).
  Model model = model64(0);
  WeightedMean mean;
  for (const auto& indices : {range(0, 20), range(20, 60)}) {
    const ClientUpdate u = train_locally(model, initial, train, indices, options.local, 0);
    mean.add(u.delta, static_cast<double>(u.examples));
  }
  EXPECT_LT((result.global - (initial + mean.mean(at::kDouble))).abs().max().item<double>(), 1e-4);
}

// TLS: a client trusting the server's certificate trains a round; one speaking plaintext to it
// gets nowhere and says which server it could not reach.
TEST(FederatedServer, TlsClientsTrainAndPlaintextOnesAreTurnedAway) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed: this test needs it to make a throwaway "
                    "certificate (scripts/setup installs it)";
  }
  test::TempDir dir;
  const std::string make_cert =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " + (dir / "key.pem") + " -out " +
      (dir / "cert.pem") + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(make_cert.c_str()), 0) << make_cert;
  at::set_num_threads(1);
  const auto train = synthetic64(40, 71);
  ServerOptions options = server_options(1, 1);
  options.tls_cert = dir / "cert.pem";
  options.tls_key = dir / "key.pem";
  Server server(flatten_parameters(model64(0)), options);
  {
    ClientOptions plain = client_options(server, "p");
    plain.retry_window = std::chrono::milliseconds(1500);
    plain.rpc_timeout = std::chrono::milliseconds(1000);
    Client client(test_model(), train, range(0, 10), plain);
    try {
      client.run();
      ADD_FAILURE() << "a plaintext client reached a TLS server";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(server.address()), std::string::npos) << e.what();
    }
  }
  ServerResult result;
  const auto reports = run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
    o.tls = true;
    o.tls_ca = dir / "cert.pem";
  });
  EXPECT_EQ(result.rounds_done, 1);
  EXPECT_EQ(reports[0].rounds_trained, 1);
}

// A deployed client personalizes once training is over: it downloads the final model (the
// server waits for that before stopping), fine-tunes it on its own examples, tests both on its
// held-out examples and saves the result.
TEST(FederatedServer, ClientsPersonalizeTheFinalModelAndSaveIt) {
  at::set_num_threads(1);
  const auto train = synthetic64(400, 81);
  // Two clients of one class each: the global model is poor on each, fine-tuning fixes that.
  const auto parts = partition(train.targets(), 10, parse_partition("shards:1"), 5, 0.25);
  ASSERT_EQ(classes_among(train.targets(), parts[0].train), 1);
  test::TempDir dir;
  // One full-batch step of training: the global model is still poor at each client's class.
  ServerOptions options = server_options(1, 2);
  Server server(flatten_parameters(model64(0)), options);
  ServerResult result;
  const auto reports = run_clients(server, train, {{"a", parts[0].train}, {"b", parts[1].train}},
                                   &result, [&](ClientOptions& o) {
    const size_t c = o.client_id == "a" ? 0 : 1;
    o.personalize_epochs = 20;  // full-batch steps, the plan's batch
    o.test_indices = parts[c].test;
    o.save_model = dir / (o.client_id + ".pt");
  });
  ASSERT_EQ(result.rounds_done, 1);
  double global = 0, personalized = 0;
  for (const auto& report : reports) {
    ASSERT_GE(report.global_accuracy, 0.0);
    EXPECT_GE(report.personalized_accuracy, report.global_accuracy);
    EXPECT_GE(report.personalized_accuracy, 0.85);
    global += report.global_accuracy / 2;
    personalized += report.personalized_accuracy / 2;
  }
  // The global model leans to one client's class; each personalized model knows its own.
  EXPECT_GT(personalized, global + 0.3);
  EXPECT_TRUE(std::filesystem::exists(dir / "a.pt"));
  EXPECT_TRUE(std::filesystem::exists(dir / "b.pt"));
}

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
TEST(FederatedServer, ClientTokenFilesAreCheckedLineByLine) {
  test::TempDir dir;
  auto write = [&](const std::string& text) {
    std::ofstream(dir / "tokens") << text;
    return dir / "tokens";
  };
  EXPECT_EQ(read_client_tokens(write("# phones\na t1\n\nb t2\n")),
            (std::map<std::string, std::string>{{"a", "t1"}, {"b", "t2"}}));
  auto message = [&](const std::string& text) {
    try {
      read_client_tokens(write(text));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("a t1\nb\n").find("tokens:2: expected 'CLIENT_ID TOKEN'"), std::string::npos);
  EXPECT_NE(message("a t1 extra\n").find("tokens:1"), std::string::npos);
  EXPECT_NE(message("a t1\na t2\n").find("tokens:2: client 'a' is listed twice"), std::string::npos);
  EXPECT_NE(message("a/b t1\n").find("is not a client id"), std::string::npos);
  EXPECT_NE(message("# nobody\n").find("lists no clients"), std::string::npos);
  EXPECT_NE(message("").find("lists no clients"), std::string::npos);
}

// Random and mutated upload streams from the selected client: each is refused (or, being
// late or malformed, ignored), the server does not fall over, and the client's real update is
// then taken as if nothing had happened.
TEST(FederatedServer, FuzzedUploadsAreRefusedAndChangeNothing) {
  at::set_num_threads(1);
  const auto train = synthetic64(40, 91);
  const at::Tensor initial = flatten_parameters(model64(0));
  const int64_t n = initial.numel();
  Server server(initial, server_options(1, 1));
  std::atomic<bool> fuzzed{false};
  int refused = 0, accepted = 0;
  std::thread fuzzer([&] {
    auto stub = dtrain::fl::Federated::NewStub(
        grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    std::mt19937 random(17);
    auto pick = [&](std::initializer_list<std::string> values) {
      return *(values.begin() + random() % values.size());
    };
    // Until round 1 is open (bounded): an empty-stream probe.
    for (int i = 0; i < 200; ++i) {
      grpc::ClientContext context;
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      dtrain::fl::UpdateChunk probe;
      probe.set_client_id("a");
      probe.set_round(1);
      probe.set_encoding("zip");
      writer->Write(probe);
      writer->WritesDone();
      if (writer->Finish().error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    for (int i = 0; i < 150; ++i) {
      grpc::ClientContext context;
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      const int messages = 1 + static_cast<int>(random() % 3);
      for (int m = 0; m < messages; ++m) {
        dtrain::fl::UpdateChunk chunk;
        chunk.set_client_id(random() % 8 == 0 ? "zz" : "a");
        chunk.set_round(random() % 8 == 0 ? 2 : 1);
        chunk.set_examples(static_cast<int64_t>(random() % 3) - 1);
        chunk.set_encoding(pick({"none", "q8", "topk", "secagg", "zip", ""}));
        auto* t = chunk.mutable_chunk();
        t->set_name(pick({"delta", "q", "lo", "step", "indices", "values", "masked", "x"}));
        t->set_dtype(static_cast<dtrain::rpc::DType>(random() % 10));
        if (random() % 4 != 0) t->add_shape(random() % 2 == 0 ? n : static_cast<int64_t>(random() % (2 * n)));
        t->set_offset(random() % 4 == 0 ? static_cast<int64_t>(random() % n) : 0);
        std::string data(random() % 4096, '\0');
        for (auto& b : data) b = static_cast<char>(random());
        t->set_data(data);
        writer->Write(chunk);
      }
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      if (status.ok()) {
        ++accepted;
      } else {
        ++refused;
      }
    }
    fuzzed = true;
  });
  ServerResult result;
  const auto reports = run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
    // Its first local step waits until the fuzzing is over.
    o.available = [&, calls = std::make_shared<int>(0)] {
      for (int i = 0; ++*calls > 1 && i < 800 && !fuzzed; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      return true;
    };
  });
  fuzzer.join();
  EXPECT_EQ(accepted, 0);
  EXPECT_EQ(refused, 150);
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(reports[0].rounds_trained, 1);
  Model model = model64(0);
  const ClientUpdate u = train_locally(model, initial, train, range(0, 40), server_options(1, 1).local, 0);
  EXPECT_LE((result.global - (initial + u.delta)).abs().max().item<double>(), kTightBound);
}

// Clients whose local training diverges leave the round (nothing non-finite reaches the
// server); a run where all of them do stops after 10 tries of a round, saying so.
TEST(Simulation, DivergedClientsLeaveTheRoundAndADivergedRunStops) {
  at::set_num_threads(1);
  const auto train = synthetic64(200, 95);
  const auto test = synthetic64(50, 96);
  SimulationOptions options;
  options.clients = 4;
  options.fraction = 1.0;
  options.rounds = 3;
  options.local.lr = 1e300;  // the first step overflows
  options.threads = 1;
  options.progress = false;
  try {
    simulate(mlp_spec(), train, test, options);
    ADD_FAILURE() << "a diverged run went on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("round 1: only 0 of 4 clients finished, 10 times in a row"),
              std::string::npos) << e.what();
  }
}
