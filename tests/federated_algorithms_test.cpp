// Federated algorithms beyond the mean: the robust aggregators (median, trimmed mean, Krum,
// multi-Krum, clipped mean) against hand-computed values and against FedAvg where they must
// equal it, and the faulty clients of the simulation that measure them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "FederatedTesting.h"
#include "TempDir.h"
#include "TrainerRuns.h"
#include "dtrain/common/Error.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Aggregator.h"
#include "dtrain/services/federated/aggregation/Robust.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "dtrain/train/Checkpoint.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

namespace {

const std::vector<std::string> kRobust = {"median", "trimmed-mean", "krum", "multi-krum",
                                          "clipped-mean"};

// One round of `algorithm` from zeros over `updates` (weights = examples); the new global.
at::Tensor one_round(const std::string& algorithm, const std::vector<at::Tensor>& updates,
                     const std::vector<int64_t>& examples, RobustSpec robust = {}) {
  RoundServerOptions options;
  options.aggregator.algorithm = algorithm;
  options.aggregator.robust = robust;
  options.clients_per_round = static_cast<int64_t>(updates.size());
  RoundServer server(at::zeros_like(updates[0]), options);
  std::vector<std::string> ids;
  for (size_t i = 0; i < updates.size(); ++i) ids.push_back("c" + std::to_string(i));
  EXPECT_EQ(server.select(ids).size(), updates.size());
  for (size_t i = 0; i < updates.size(); ++i) {
    EXPECT_EQ(server.submit(ids[i], updates[i], examples[i]), "");
  }
  EXPECT_TRUE(server.close().applied);
  return server.global();
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

}  // namespace

TEST(Robust, EveryDefenceReturnsTheUpdateWhenAllClientsSendTheSameOne) {
  const at::Tensor same = at::randn({50}, at::kDouble);
  for (const auto& name : kRobust) {
    const at::Tensor global =
        one_round(name, std::vector<at::Tensor>(7, same), {3, 1, 4, 1, 5, 9, 2});
    EXPECT_LE(max_diff(global, same), 1e-14) << name;
  }
  // Multi-Krum assuming no fault keeps every update: FedAvg's example-weighted mean exactly.
  std::vector<at::Tensor> different;
  for (int i = 0; i < 5; ++i) different.push_back(at::randn({50}, at::kDouble));
  const std::vector<int64_t> examples{10, 20, 5, 40, 25};
  RobustSpec none;
  none.assumed_faulty = 0;
  EXPECT_LE(max_diff(one_round("multi-krum", different, examples, none),
                     one_round("fedavg", different, examples)),
            kTightBound);
}

TEST(Robust, StatisticsMatchTheirDefinitionsAndIgnoreAnOutlier) {
  auto v = [](std::vector<double> x) { return at::tensor(x, at::kDouble); };
  const std::vector<at::Tensor> four{v({1, 8}), v({2, 6}), v({4, 7}), v({1000, -1000})};
  // An even count: the mean of the two middle values.
  EXPECT_TRUE(coordinate_median(four).equal(v({3, 6.5})));
  // Cutting 1 of 4 from each end leaves the two middle values.
  EXPECT_TRUE(trimmed_mean(four, 0.25).equal(v({3, 6.5})));
  EXPECT_TRUE(trimmed_mean(four, 0.0).equal(v({1007.0 / 4, -979.0 / 4})));
  // Krum with f = 0 scores each by its n - f - 2 = 2 nearest neighbours: (1,8) 5 + 10,
  // (2,6) 5 + 5, (4,7) 5 + 10, the outlier far more.
  const auto order = krum_select(four, 0, 4);
  EXPECT_EQ(order.front(), 1u);
  EXPECT_EQ(order.back(), 3u);
  // Clipped to norm 5: (3,4) stays, (30,40) becomes (3,4); weights 1 and 3.
  EXPECT_TRUE(clipped_mean({v({3, 4}), v({30, 40})}, {1, 3}, 5.0).allclose(v({3, 4})));
  // Clipped to the median norm (of 5, 10, 50: 10): (6,8) stays, (30,40) -> (6,8), (3,4) stays.
  EXPECT_TRUE(
      clipped_mean({v({3, 4}), v({6, 8}), v({30, 40})}, {1, 1, 1}, 0.0).allclose(v({5, 20.0 / 3})));
  // Through the server: every defence keeps the outlier of five from moving the model far,
  // the mean does not (the clipped mean lets it move the model by at most the median norm / 5).
  std::vector<at::Tensor> five{v({1, 1}), v({1.1, 0.9}), v({0.9, 1.1}), v({1, 1.05}),
                               v({-500, 500})};
  const std::vector<int64_t> examples(5, 10);
  EXPECT_GT(max_diff(one_round("fedavg", five, examples), v({1, 1})), 50);
  for (const auto& name : kRobust) {
    EXPECT_LT(max_diff(one_round(name, five, examples), v({1, 1})), 0.5) << name;
  }
}

TEST(Robust, BadSpecsAndSecureSumsAreRefusedByName) {
  for (const char* bad : {"0.2", "0.2:flip", "1.5:sign-flip", "x:scaled", "0.1:scaled:-2",
                          "0.1:label-flip:3", "0.1:gaussian:1:2"}) {
    try {
      parse_byzantine(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("--byzantine '") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(to_string(parse_byzantine("0.2:scaled")), "0.2:scaled:10");
  EXPECT_EQ(to_string(parse_byzantine("0.1:label-flip")), "0.1:label-flip");
  EXPECT_FALSE(parse_byzantine("none").enabled());
  for (const auto& name : kRobust) {
    RoundServerOptions options;
    options.aggregator.algorithm = name;
    options.secure_aggregation = true;
    EXPECT_THROW(RoundServer(at::zeros({4}, at::kDouble), options), InputError) << name;
  }
  RoundServerOptions options;
  options.aggregator.algorithm = "trimmed-mean";
  options.aggregator.robust.assumed_faulty = 0.5;
  try {
    RoundServer(at::zeros({4}, at::kDouble), options);
    ADD_FAILURE() << "--assumed-faulty 0.5 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--assumed-faulty"), std::string::npos) << e.what();
  }
  // The faulty clients are a fixed share drawn from the seed.
  ByzantineSpec spec = parse_byzantine("0.2:sign-flip");
  const auto faulty = faulty_clients(spec, 50, 3);
  EXPECT_EQ(std::count(faulty.begin(), faulty.end(), true), 10);
  EXPECT_EQ(faulty, faulty_clients(spec, 50, 3));
  EXPECT_NE(faulty, faulty_clients(spec, 50, 4));
}

TEST(Robust, AScaledAttackRuinsFedAvgAndTheMedianWithstandsIt) {
  at::set_num_threads(1);
  // One teacher labels both splits (a synthetic set's seed draws its teacher).
  const auto all = synthetic64(900, 11);
  const data::TensorDataset train(all.raw_inputs().narrow(0, 0, 600),
                                  all.targets().narrow(0, 0, 600));
  const data::TensorDataset test(all.raw_inputs().narrow(0, 600, 300),
                                 all.targets().narrow(0, 600, 300));
  SimulationOptions options;
  options.clients = 10;
  options.fraction = 1.0;
  options.rounds = 8;
  options.round.local.epochs = 5;
  options.round.local.batch = 10;
  options.round.local.lr = 0.2;
  options.threads = 1;
  options.progress = false;
  options.local_test_fraction = 0.0;
  auto accuracy = [&](const std::string& algorithm, const std::string& attack) {
    SimulationOptions o = options;
    o.round.aggregator.algorithm = algorithm;
    o.byzantine = parse_byzantine(attack);
    const auto result = simulate(mlp_spec(), train, test, o);
    if (o.byzantine.enabled()) {
      for (const auto& r : result.rounds) EXPECT_EQ(r.faulty, 2);  // everyone is selected
    }
    return result.rounds.back().test_accuracy;
  };
  const double clean = accuracy("fedavg", "none");
  EXPECT_GT(clean, 0.6);
  // Two of ten clients send -20x their update: the mean follows them.
  const double attacked = accuracy("fedavg", "0.2:sign-flip:20");
  EXPECT_LT(attacked, clean - 0.2);
  // Krum keeps one client's update a round (a tenth of the data): it learns slower.
  for (const std::string name : {"median", "trimmed-mean", "krum", "multi-krum", "clipped-mean"}) {
    const double defended = accuracy(name, "0.2:sign-flip:20");
    EXPECT_GT(defended, clean - (name == "krum" ? 0.15 : 0.05)) << name;
    std::printf("clean %.3f, fedavg attacked %.3f, %s attacked %.3f\n", clean, attacked,
                name.c_str(), defended);
  }
  // Label flippers' updates are honest-looking; the attack runs end to end.
  EXPECT_GT(accuracy("median", "0.2:label-flip"), 0.25);
}

// ---- Drift correction: SCAFFOLD and FedDyn -----------------------------------------------

namespace {

// A linear classifier (softmax regression): a convex problem.
models::ModelSpec linear_spec() {
  models::ModelSpec spec = mlp_spec();
  spec.hidden = {};
  return spec;
}

}  // namespace

TEST(Drift, ScaffoldWithOneClientIsFedAvg) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 31);
  const auto test = synthetic64(40, 31);
  SimulationOptions o = one_thread_run("fedavg");
  o.clients = 1;
  o.rounds = 4;
  o.round.local.epochs = 2;
  o.round.local.batch = 10;
  o.round.local.lr = 0.1;
  const at::Tensor fedavg = simulate(mlp_spec(), train, test, o).global;
  for (int option : {1, 2}) {
    o.round.aggregator.algorithm = "scaffold";
    o.round.aggregator.scaffold_option = option;
    const auto scaffold = simulate(mlp_spec(), train, test, o);
    EXPECT_LE(max_diff(scaffold.global, fedavg), kTightBound) << "option " << option;
  }
  // ... and with two clients it is not (the check can fail).
  o.clients = 2;
  const at::Tensor two = simulate(mlp_spec(), train, test, o).global;
  o.round.aggregator.algorithm = "fedavg";
  EXPECT_GT(max_diff(two, simulate(mlp_spec(), train, test, o).global), 1e-6);
}

// Two clients holding different classes, a convex objective, full participation and many local
// steps: FedAvg settles away from the optimum of the union (client drift); SCAFFOLD and FedDyn
// reach it.
TEST(Drift, ScaffoldAndFedDynConvergeWhereFedAvgDrifts) {
  at::set_num_threads(1);
  const auto train = synthetic64(200, 33);
  const auto test = synthetic64(40, 33);
  LocalTraining plan;
  plan.epochs = 10;
  plan.batch = 0;  // full batch: deterministic gradient descent on each client
  plan.lr = 0.5;
  plan.weight_decay = 0.01;  // strongly convex: one optimum
  // The optimum: gradient descent on the union, run to convergence.
  torch::manual_seed(0);
  Model model = models::make_model(linear_spec());
  model.module->to(at::kDouble);
  const at::Tensor start = flatten_parameters(model);
  LocalTraining central = plan;
  central.epochs = 6000;
  const at::Tensor optimum =
      start + train_locally(model, start, train, range(0, 200), central, 0).delta;
  auto distance = [&](const std::string& algorithm) {
    SimulationOptions o = one_thread_run(algorithm);
    o.clients = 2;
    o.rounds = 400;
    o.partition = parse_partition("shards:2");
    o.round.local = plan;
    o.round.aggregator.feddyn_alpha = 0.1;
    const at::Tensor global = simulate(linear_spec(), train, test, o).global;
    const double d = (global - optimum).norm().item<double>();
    std::printf("%s: distance to the optimum %.3g\n", algorithm.c_str(), d);
    return d;
  };
  const double fedavg = distance("fedavg");
  EXPECT_GT(fedavg, 1e-2);
  EXPECT_LT(distance("scaffold"), 1e-6);
  EXPECT_LT(distance("feddyn"), 1e-6);
}

TEST(Drift, CombinationsThatWouldLeakOrConflictAreRefused) {
  auto refused = [](RoundServerOptions options, const std::string& text) {
    try {
      RoundServer server(at::zeros({4}, at::kDouble), options);
      ADD_FAILURE() << options.aggregator.algorithm << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  RoundServerOptions scaffold;
  scaffold.aggregator.algorithm = "scaffold";
  scaffold.secure_aggregation = true;
  refused(scaffold, "--algorithm scaffold sums the clients' control-variate changes in the clear");
  scaffold.secure_aggregation = false;
  scaffold.dp.clip = 1.0;
  refused(scaffold, "differential privacy");
  scaffold.dp.clip = 0;
  scaffold.aggregator.scaffold_option = 3;
  refused(scaffold, "--scaffold-option must be 1 or 2");
  RoundServerOptions feddyn;
  feddyn.aggregator.algorithm = "feddyn";
  feddyn.aggregator.feddyn_alpha = 0;
  refused(feddyn, "--feddyn-alpha must be > 0");
  feddyn.aggregator.feddyn_alpha = 0.1;
  feddyn.local.prox_mu = 0.1;
  refused(feddyn, "leave out --prox-mu");
  // A SCAFFOLD update without its control change is refused; nothing changes.
  scaffold.aggregator.scaffold_option = 2;
  scaffold.clients_per_round = 1;
  RoundServer server(at::zeros({4}, at::kDouble), scaffold);
  server.select({"a"});
  EXPECT_NE(server.submit("a", at::ones({4}, at::kDouble), 10).find("control-variate change"),
            std::string::npos);
  EXPECT_EQ(server.submit("a", at::ones({4}, at::kDouble), 10, 0.0, at::ones({4}, at::kDouble)),
            "");
  EXPECT_TRUE(server.close().applied);
  EXPECT_TRUE(server.client_control().equal(at::ones({4}, at::kDouble)));  // N = 1
}

// ---- Population scale: clients made when selected ----------------------------------------

TEST(Population, ALazilyMadeClientIsTheEagerOneAndTrainsBitIdentically) {
  at::set_num_threads(1);
  const auto train = synthetic64(600, 41);
  for (const std::string rule : {"iid", "shards:2", "dirichlet:0.3"}) {
    // 1,000 clients of 50 examples cannot be dealt from 600: each draws its own.
    const ClientPopulation population(train.targets(), 1000, parse_partition(rule), 5, 0.2, 50);
    ASSERT_TRUE(population.sampled());
    // Eagerly, in order, as a simulation holding every client would ...
    std::vector<ClientIndices> eager;
    for (int64_t c = 0; c < population.size(); ++c) eager.push_back(population.client(c));
    // ... and lazily, one client late and out of order, from another population object.
    const ClientPopulation again(train.targets(), 1000, parse_partition(rule), 5, 0.2, 50);
    for (const int64_t c : {999, 3, 500}) {
      const ClientIndices lazy = again.client(c);
      EXPECT_EQ(lazy.train, eager[static_cast<size_t>(c)].train) << rule;
      EXPECT_EQ(lazy.test, eager[static_cast<size_t>(c)].test) << rule;
      EXPECT_EQ(lazy.train.size() + lazy.test.size(), 50u);
      EXPECT_EQ(lazy.test.size(), 10u);
      std::set<int64_t> distinct(lazy.train.begin(), lazy.train.end());
      distinct.insert(lazy.test.begin(), lazy.test.end());
      EXPECT_EQ(distinct.size(), 50u);
      if (rule == "shards:2") {
        std::vector<int64_t> all = lazy.train;
        all.insert(all.end(), lazy.test.begin(), lazy.test.end());
        EXPECT_LE(classes_among(train.targets(), all), 2);
      }
      // Training it gives the same bits.
      Model a = model64(0), b = model64(0);
      const at::Tensor start = flatten_parameters(a);
      LocalTraining plan;
      plan.epochs = 2;
      const auto u = train_locally(a, start, train, eager[static_cast<size_t>(c)].train, plan, 9);
      const auto v = train_locally(b, start, train, lazy.train, plan, 9);
      EXPECT_TRUE(u.delta.equal(v.delta)) << rule;
    }
    EXPECT_NE(again.client(1).train, again.client(2).train);
  }
  // A set that can give everyone 50 examples is dealt, as partition() deals it.
  const ClientPopulation dealt(train.targets(), 10, parse_partition("shards:2"), 5, 0.2, 50);
  EXPECT_FALSE(dealt.sampled());
  EXPECT_EQ(dealt.client(4).train,
            partition(train.targets(), 10, parse_partition("shards:2"), 5, 0.2)[4].train);
}

TEST(Population, SelectionDrawsAmongTheAvailableWithoutListingThem) {
  RoundServerOptions options;
  options.clients_per_round = 100;
  RoundServer server(at::zeros({4}, at::kDouble), options);
  int64_t available = 0;
  // A million clients, every third available.
  const auto chosen = server.select_from(
      1000000, [](int64_t c) { return c % 3 == 0; }, &available);
  EXPECT_EQ(available, 333334);
  ASSERT_EQ(chosen.size(), 100u);
  std::set<std::string> distinct(chosen.begin(), chosen.end());
  EXPECT_EQ(distinct.size(), 100u);
  for (const auto& id : chosen) {
    EXPECT_EQ(std::stoll(id) % 3, 0);
    EXPECT_TRUE(server.selected(id));
  }
  // Fewer available than K: all of them; the same round and attempt select the same.
  RoundServer small(at::zeros({4}, at::kDouble), options);
  EXPECT_EQ(small.select_from(1000, [](int64_t c) { return c < 30; }).size(), 30u);
  RoundServer same(at::zeros({4}, at::kDouble), options);
  EXPECT_EQ(same.select_from(1000000, [](int64_t c) { return c % 3 == 0; }), chosen);
}

TEST(Population, AHundredThousandClientSimulationRunsAsTyped) {
  at::set_num_threads(1);
  const auto all = synthetic64(2000, 43);
  SimulationOptions o = one_thread_run("fedavg");
  o.clients = 100000;
  o.fraction = 0.0002;  // 20 a round
  o.rounds = 2;
  o.round.local.epochs = 1;
  o.partition = parse_partition("shards:2");
  o.local_test_fraction = 0.2;
  const auto result = simulate(mlp_spec(), all, all, o);
  ASSERT_EQ(result.rounds.size(), 2u);
  EXPECT_EQ(result.rounds[0].outcome.finished, 20);
  EXPECT_EQ(result.rounds[0].outcome.examples, 20 * 40);  // 50 each, 10 held out
  EXPECT_EQ(result.rounds[0].available, 100000);
}

// ---- Adaptive clipping for differential privacy ------------------------------------------

TEST(AdaptiveClipping, TheClipFollowsTheTargetQuantileOfTheUpdateNorms) {
  RoundServerOptions options;
  options.clients_per_round = 10;
  options.dp.clip = 100.0;  // far above every norm
  options.dp.target_quantile = 0.5;
  options.dp.clip_lr = 0.2;
  RoundServer server(at::zeros({3}, at::kDouble), options);
  std::vector<std::string> ids;
  for (int i = 0; i < 10; ++i) ids.push_back("c" + std::to_string(i));
  double clip = server.dp_clip();
  for (int round = 0; round < 80; ++round) {
    EXPECT_EQ(server.select(ids).size(), 10u);
    clip = server.dp_clip();
    for (int i = 0; i < 10; ++i) {
      // Client i's update has norm i + 1.
      const at::Tensor delta = at::tensor({static_cast<double>(i + 1), 0.0, 0.0}, at::kDouble);
      const int within = (i + 1) <= clip ? 1 : 0;
      ASSERT_EQ(server.submit(ids[i], clip_update(delta, clip), 1, 0.0, {}, within), "");
    }
    const RoundOutcome outcome = server.close();
    EXPECT_EQ(outcome.dp_clip, clip);
  }
  // Without noise it settles where half the norms are within: between the 5th and 6th.
  EXPECT_GT(server.dp_clip(), 5.0);
  EXPECT_LT(server.dp_clip(), 6.0);
  // An update without its bit is refused.
  server.select(ids);
  EXPECT_NE(server.submit(ids[0], at::zeros({3}, at::kDouble), 1).find("within the clip"),
            std::string::npos);
}

TEST(AdaptiveClipping, TheCountTakesItsShareOfTheNoiseAndBadCombinationsAreRefused) {
  // (z^-2 - (2 sigma_b)^-2)^-1/2: z = 1, sigma_b = 5 -> 1 / sqrt(0.99).
  EXPECT_NEAR(update_noise_multiplier(1.0, 5.0), 1.0 / std::sqrt(0.99), 1e-15);
  EXPECT_EQ(update_noise_multiplier(0.0, 0.5), 0.0);
  EXPECT_THROW(update_noise_multiplier(1.0, 0.5), InputError);  // z >= 2 sigma_b
  RoundServerOptions options;
  options.clients_per_round = 10;  // sigma_b = 10 / 20
  options.dp.clip = 1.0;
  options.dp.noise_multiplier = 1.0;
  options.dp.target_quantile = 0.5;
  try {
    RoundServer server(at::zeros({3}, at::kDouble), options);
    ADD_FAILURE() << "z = 2 sigma_b accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("raise --dp-count-noise above 0.5"), std::string::npos)
        << e.what();
  }
  options.dp.count_noise = 2.0;
  options.secure_aggregation = true;
  EXPECT_THROW(RoundServer(at::zeros({3}, at::kDouble), options), InputError);
  options.dp.target_quantile = 1.5;
  options.secure_aggregation = false;
  EXPECT_THROW(RoundServer(at::zeros({3}, at::kDouble), options), InputError);

  // A simulation: the clip moves every round and the accountant's epsilon is that of z.
  at::set_num_threads(1);
  const auto train = synthetic64(400, 45);
  SimulationOptions o = one_thread_run("fedavg");
  o.clients = 20;
  o.fraction = 0.5;
  o.rounds = 4;
  o.round.local.epochs = 1;
  o.round.dp.clip = 10.0;
  o.round.dp.noise_multiplier = 0.5;
  o.round.dp.count_noise = 2.0;
  o.round.dp.target_quantile = 0.5;
  const auto result = simulate(mlp_spec(), train, train, o);
  ASSERT_EQ(result.rounds.size(), 4u);
  for (size_t r = 1; r < 4; ++r) {
    // (The count's noise is drawn from the system's randomness: the clip moves, by how much
    // varies.)
    EXPECT_NE(result.rounds[r].outcome.dp_clip, result.rounds[r - 1].outcome.dp_clip);
    EXPECT_DOUBLE_EQ(result.rounds[r].dp_epsilon,
                     dp_epsilon(0.5, 0.5, static_cast<int64_t>(r) + 1, o.round.dp.delta).first);
  }
}

// ---- One model across paradigms ----------------------------------------------------------
// DDP on two ranks writes a checkpoint; federated learning starts from it (the global model is
// exactly DDP's final weights); its final model, saved as a consolidated file, starts ZeRO-3 on
// two ranks, which then equals single-process training from the same file (the oracle), and
// differs from ZeRO-3 without it.
TEST(OneModel, DdpThenFederatedThenZero3) {
  const models::ModelSpec spec = test::small_mlp(16, 8, 4);
  test::TempDir dir;
  train::TrainerOptions o;
  o.strategy = "ddp";
  o.batch_size = 8;
  o.epochs = 1;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.1;
  o.progress = false;
  o.seed = 3;
  o.checkpoint_dir = dir.path() + "/ddp";
  const auto ddp = test::run_training(2, o, 7, spec);
  std::vector<at::Tensor> flat;
  for (const auto& w : ddp.weights) flat.push_back(w.reshape({-1}));
  const at::Tensor ddp_final = at::cat(flat);

  // Federated learning from the checkpoint (its root: the newest checkpoint in it).
  torch::manual_seed(99);
  Model start = models::make_model(spec);
  start.module->to(at::kDouble);
  train::load_model_from(*start.module, o.checkpoint_dir);
  EXPECT_TRUE(flatten_parameters(start).equal(ddp_final));
  at::set_num_threads(1);
  const auto synthetic = data::make_synthetic(160, {16}, 4, 2);
  const data::TensorDataset data(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  SimulationOptions s = one_thread_run("fedavg");
  s.clients = 4;
  s.rounds = 2;
  s.round.local.epochs = 1;
  s.initial = flatten_parameters(start);
  const auto federated = simulate(spec, data, data, s);
  EXPECT_GT(max_diff(federated.global, ddp_final), 1e-4);  // it trained on

  // ZeRO-3 from the federated model's file.
  Model final_model = models::make_model(spec);
  final_model.module->to(at::kDouble);
  load_flat_parameters(final_model, federated.global);
  const std::string file = dir.path() + "/federated.pt";
  train::save_consolidated(*final_model.module, file);
  train::TrainerOptions z = o;
  z.checkpoint_dir = "";
  z.init_from = file;
  z.strategy = "zero3";
  const auto zero3 = test::run_training(2, z, 11, spec);
  train::TrainerOptions single = z;
  single.strategy = "ddp";
  single.batch_size = 16;
  const auto reference = test::run_training(1, single, 13, spec);
  ASSERT_EQ(zero3.weights.size(), reference.weights.size());
  for (size_t i = 0; i < zero3.weights.size(); ++i) {
    EXPECT_LE(max_diff(zero3.weights[i], reference.weights[i]), 1e-12) << i;
  }
  z.init_from = "";
  const auto fresh = test::run_training(2, z, 11, spec);
  EXPECT_GT(max_diff(fresh.weights[0], zero3.weights[0]), 1e-3);
  // A file of another model is refused by name.
  train::TrainerOptions wrong = z;
  wrong.init_from = file;
  try {
    test::run_training(1, wrong, 1, test::small_mlp(16, 9, 4));
    ADD_FAILURE() << "a file of another model was loaded";
  } catch (const std::exception& e) {  // (the rank threads rethrow it as runtime_error)
    EXPECT_NE(std::string(e.what()).find("federated.pt: layers.0.weight is [8, 16], the model's "
                                         "is [9, 16]"),
              std::string::npos)
        << e.what();
  }
}
