// --strategy diloco --fault-tolerance replicas: three islands of two ranks (inner ddp, zero2 or
// zero3, Adam), an outer Nesterov step every H = 2 inner steps, in float64, against DiLoCo written
// out in one process (each island one model on its two ranks' rows). Without a failure it is
// plain DiLoCo; when island 2 (both ranks) fails in an outer round, that round's outer gradient
// is the mean over islands 0 and 1 (island 2's inner steps of the round are lost with it) and so
// on; a replacement island is admitted at the end of an outer step with island 0's parameters,
// inner and outer optimizer state and step counters, and the three train on. Through the
// launcher: a rank of an island killed takes its island out, both ranks are started again and
// join at an outer step, and the leading island's checkpoint resumes plain DiLoCo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "FaultToleranceRuns.h"
#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/diloco/DilocoOptions.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ft/Replicas.h"
#ifdef DTRAIN_CLI_PATH
#include "CliRuns.h"
#include "TempDir.h"
#endif

using namespace dtrain;

namespace {

constexpr int kRanks = 6;  // 3 islands x 2 ranks
constexpr int kIslandSize = 2;
constexpr int kIslands = kRanks / kIslandSize;
constexpr int64_t kBatch = 4;
constexpr int kSteps = 8;
constexpr int kOuterSteps = 2;  // H
constexpr double kOuterLr = 0.7, kOuterMomentum = 0.9;

// World rank r's batch at step t: its own rows of one synthetic float64 data set.
test::RankRows rows() { return test::RankRows(kSteps, kRanks, kBatch, 29); }

parallel::StrategyOptions diloco_options(const std::string& inner,
                                         const std::string& fault_tolerance) {
  parallel::StrategyOptions options;
  auto& d = options.of<parallel::diloco::DilocoOptions>();
  d.inner_strategy = inner;
  d.island_size = kIslandSize;
  d.outer_steps = kOuterSteps;
  d.outer_optimizer = "nesterov";
  d.outer_lr = kOuterLr;
  d.outer_momentum = kOuterMomentum;
  options.of<parallel::ft::FaultToleranceOptions>().mode = fault_tolerance;
  return options;
}

struct Outcome {
  std::vector<std::vector<at::Tensor>> weights = std::vector<std::vector<at::Tensor>>(kRanks);
  std::vector<double> replicas_seen;  // world rank 0's, each step
};

// Island 2 (world ranks 4, 5) fails before step `dies_before` (-1: never); `replaced`: a
// replacement island (another initial model) announces itself once the others made the outer
// step after the failure without it, and is admitted at the end of the next outer step.
Outcome train_islands(const std::string& inner, const std::string& fault_tolerance, int dies_before,
                      bool replaced = false) {
  const test::RankRows data = rows();
  Outcome out;
  // The first outer step without island 2, and the step after which it may join.
  const int left = dies_before < 0 ? -1 : (dies_before / kOuterSteps + 1) * kOuterSteps - 1;
  test::run_ranks(
      kRanks,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world);
        auto options = diloco_options(inner, fault_tolerance);
        auto strategy = parallel::make_strategy("diloco", options);
        strategy->setup(test::double_mlp(), optim::optimizer_factory(test::adam()), grid);
        const int island = world->rank() / kIslandSize;
        auto store = world->key_value();
        for (int step = 0; step < kSteps; ++step) {
          if (island == 2 && step == dies_before) {
            test::report_death(*store, world->rank());  // as its launcher would
            if (!replaced) return;
            test::wait_for_key(*store, "test/left");
            strategy.reset();
            options.of<parallel::ft::FaultToleranceOptions>().replacement = true;
            strategy = parallel::make_strategy("diloco", options);
            strategy->setup(test::double_mlp(99), optim::optimizer_factory(test::adam()), grid);
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, left + 1 + kOuterSteps);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && island != 2 && step == left + 1) {
            test::wait_for_joins(*store, kIslandSize);
          }
          auto result =
              strategy->train_step({data.batch(step, world->rank())}, parallel::cross_entropy);
          if (step + 1 == kSteps) strategy->finish_training(result);
          if (auto* replicas = parallel::ft::replaceable(*strategy)) {
            replicas->admit_waiting(step + 1);
          }
          if (replaced && world->rank() == 0 && step == left) store->set("test/left", "1");
          if (world->rank() == 0) {
            out.replicas_seen.push_back(result.metrics.count("replicas")
                                            ? result.metrics.at("replicas")
                                            : static_cast<double>(kIslands));
          }
        }
        out.weights[world->rank()] = test::values_of(*strategy);
      },
      std::chrono::seconds(60));
  return out;
}

// DiLoCo in one process: each island a model and an Adam of its own on its two ranks' rows; every
// H steps the outer gradient (outer - island) averaged over the islands present, an outer
// Nesterov step, every island present from the outer parameters. Island 2 is absent from step
// `dies_before` until step `joins`, where it takes island 0's parameters and Adam state.
std::vector<at::Tensor> train_one_process(int dies_before, int joins = kSteps) {
  const test::RankRows data = rows();
  std::vector<Model> islands;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> inner;
  for (int i = 0; i < kIslands; ++i) {
    islands.push_back(test::double_mlp());
    inner.push_back(optim::make_optimizer(islands.back().module->parameters(), test::adam()));
  }
  std::vector<at::Tensor> outer;
  for (const auto& p : islands[0].module->parameters()) outer.push_back(p.detach().clone());
  torch::optim::SGD outer_optimizer(
      outer, torch::optim::SGDOptions(kOuterLr).momentum(kOuterMomentum).nesterov(true));
  auto present = [&](int island, int step) {
    return island != 2 || dies_before < 0 || step < dies_before || step >= joins;
  };
  torch::NoGradGuard no_grad_outside;
  for (int step = 0; step < kSteps; ++step) {
    if (step == joins) {  // island 2 comes back with island 0's state
      const auto from = islands[0].module->parameters(), to = islands[2].module->parameters();
      for (size_t k = 0; k < from.size(); ++k) {
        to[k].copy_(from[k]);
        optim::set_param_state(*inner[2], to[k], optim::get_param_state(*inner[0], from[k]));
      }
    }
    for (int i = 0; i < kIslands; ++i) {
      if (!present(i, step)) continue;
      at::Tensor x = at::cat({data.batch(step, 2 * i).inputs, data.batch(step, 2 * i + 1).inputs});
      at::Tensor y =
          at::cat({data.batch(step, 2 * i).targets, data.batch(step, 2 * i + 1).targets});
      inner[i]->zero_grad();
      {
        at::AutoGradMode grad(true);
        at::cross_entropy_loss(islands[i](x), y).backward();
      }
      inner[i]->step();
    }
    if ((step + 1) % kOuterSteps != 0) continue;
    // Present through the whole round: an island that failed in it takes its change with it.
    std::vector<int> counted;
    for (int i = 0; i < kIslands; ++i) {
      if (present(i, step) && present(i, step + 1 - kOuterSteps)) counted.push_back(i);
    }
    for (size_t k = 0; k < outer.size(); ++k) {
      at::Tensor sum = at::zeros_like(outer[k]);
      for (const int i : counted) sum += outer[k] - islands[i].module->parameters()[k];
      outer[k].mutable_grad() = sum / static_cast<double>(counted.size());
    }
    outer_optimizer.step();
    for (const int i : counted) {
      const auto params = islands[i].module->parameters();
      for (size_t k = 0; k < outer.size(); ++k) params[k].copy_(outer[k]);
    }
  }
  return outer;
}

}  // namespace

// Without a failure: DiLoCo written out in one process, and plain DiLoCo, for inner ddp and zero2.
TEST(FaultToleranceDiloco, WithoutAFailureItIsDiloco) {
  at::set_num_threads(1);
  const auto expected = train_one_process(-1);
  for (const std::string inner : {"ddp", "zero2"}) {
    const Outcome out = train_islands(inner, "replicas", -1);
    EXPECT_LT(test::worst_of(out.weights, expected, {0, 1, 2, 3, 4, 5}), 1e-12) << inner;
    EXPECT_EQ(out.replicas_seen, std::vector<double>(kSteps, 3.0)) << inner;
    EXPECT_LT(test::worst_of(train_islands(inner, "none", -1).weights, expected, {0, 3, 5}), 1e-12)
        << inner;
  }
}

// Island 2's two ranks fail before step 3 (index 2): the outer step at the end of that round
// is the mean over islands 0 and 1, and so are the next ones.
TEST(FaultToleranceDiloco, TheOtherIslandsMakeTheOuterStepWithoutAFailedIsland) {
  at::set_num_threads(1);
  const Outcome out = train_islands("ddp", "replicas", 2);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2, 2, 2}));
  EXPECT_LT(test::worst_of(out.weights, train_one_process(2), {0, 1, 2, 3}), 1e-12);
  // (Island 2's change of the round counted would be another run.)
  EXPECT_GT(test::worst_of(out.weights, train_one_process(4), {0}), 1e-6);
}

// A replacement island joins at the end of the outer step after the one that left it out: each
// of its ranks takes island 0's parameters, inner and outer optimizer state (zero3: its shards)
// and step counters; it ends with island 0's weights exactly.
TEST(FaultToleranceDiloco, AReplacementIslandTakesTheStateAndTheThreeTrainOn) {
  at::set_num_threads(1);
  for (const std::string inner : {"ddp", "zero3"}) {
    const Outcome out = train_islands(inner, "replicas", 2, /*replaced=*/true);
    EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2, 2, 3})) << inner;
    EXPECT_LT(test::worst_of(out.weights, train_one_process(2, 6), {0, 1, 2, 3, 4, 5}), 1e-12)
        << inner;
    EXPECT_EQ(test::max_difference(out.weights[4], out.weights[0]), 0.0) << inner;
    EXPECT_EQ(test::max_difference(out.weights[5], out.weights[1]), 0.0) << inner;
    EXPECT_GT(test::worst_of(out.weights, train_one_process(2), {0}), 1e-6) << inner;
  }
}

#ifdef DTRAIN_CLI_PATH
// Through the launcher, 2 islands of 2 ranks with an outer step every 4 steps: rank 3 is killed
// at step 10, its launcher ends rank 2 (its island) too, island 0 goes on alone, both are
// started again and join at an outer step; the job ends with two islands, and the leading
// island's checkpoint resumes plain DiLoCo.
TEST(FaultToleranceDiloco, TheLauncherReplacesAnIsland) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const std::string job =
      " train --model mlp --hidden 32 --threads 1 --batch-size 16 --log-every 1 --no-progress "
      "--strategy diloco --island-size 2 --outer-steps 4 --checkpoint-dir " +
      (dir / "ckpt");
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=3:10 " + test::cli::kDtrain + job +
      " --nproc 4 --max-steps 150 --checkpoint-every 50 --fault-tolerance replicas --metrics " +
      metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(test::cli::has(out, "ending rank 2 (pid")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2,3 left at outer step 3"))
      << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2,3 joined after step"))
      << out.text;
  EXPECT_TRUE(test::cli::has(out, "from world rank 0 in")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "from world rank 1 in")) << out.text;
  const auto [changes, last] = test::replica_changes(metrics);
  EXPECT_EQ(last, 150);
  ASSERT_EQ(changes.size(), 3u) << out.text;
  EXPECT_EQ(changes[1], (std::pair<int64_t, double>{12, 1.0}));  // the outer step after the kill
  EXPECT_EQ(changes[2].second, 2.0);
  EXPECT_EQ(changes[2].first % 4, 0);  // joined at an outer step, counted at the next
  const auto resumed = test::cli::run(test::cli::kDtrain + job + " --nproc 4 --max-steps 154");
  ASSERT_EQ(resumed.code, 0) << resumed.text;
  EXPECT_TRUE(test::cli::has(resumed, "resumed from step 150")) << resumed.text;
}

// What diloco's fault tolerance refuses.
TEST(FaultToleranceDiloco, BadLayoutsAreRefused) {
  const std::string base = test::cli::kDtrain +
                           " train --model mlp --max-steps 1 --strategy diloco --nproc 4 "
                           "--fault-tolerance replicas ";
  auto out = test::cli::run(base);
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "give --island-size")) << out.text;
  out = test::cli::run(base + "--island-size 2 --streaming-fragments 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out,
                             "--streaming-fragments, --overlap-steps and --outer-compression "
                             "are not built with it yet"))
      << out.text;
  out = test::cli::run(base + "--island-size 2 --replica-shards 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "not diloco")) << out.text;
}
#endif
