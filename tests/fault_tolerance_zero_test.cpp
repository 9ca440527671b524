// --fault-tolerance replicas with zero1/zero2 and --replica-shards 2 (hybrid sharding): three
// replicas of two ranks, each pair sharding Adam's state (zero2: and the gradients) between
// them, in float64. Without a failure the training is one process's on the global batch; when
// replica 2 (both ranks) fails before a step, the other two commit it without it and go on
// (one process on the rows of the ranks present); a replacement replica's two ranks each take
// the parameters and the shard's Adam state from replica 0's rank at their position, and end
// with exactly its weights. Through the launcher: one rank of a replica killed takes its
// replica out, both are started again and join, the leading replica's checkpoint resumes plain
// ZeRO.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "FaultToleranceRuns.h"
#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaManager.h"
#ifdef DTRAIN_CLI_PATH
#include "CliRuns.h"
#include "TempDir.h"
#endif

using namespace dtrain;

namespace {

constexpr int kRanks = 6;  // 3 replicas x 2 shards
constexpr int kShards = 2;
constexpr int64_t kBatch = 4;
constexpr int kSteps = 6;

// World rank r's batch at step t: its own rows of one synthetic float64 data set.
test::RankRows rows() { return test::RankRows(kSteps, kRanks, kBatch, 23); }

struct Outcome {
  std::vector<std::vector<at::Tensor>> weights = std::vector<std::vector<at::Tensor>>(kRanks);
  std::vector<double> replicas_seen;  // world rank 0's
  std::vector<double> losses;         // world rank 0's
};

// Replica 2 (world ranks 4, 5) fails before step `dies_before` (-1: never); `replaced`: a
// replacement replica (another initial model) announces itself once the others committed that
// step without it, and is admitted at the end of the next.
Outcome train_replicas(const std::string& strategy_name, const std::string& fault_tolerance,
                       int dies_before, bool replaced = false) {
  const test::RankRows data = rows();
  Outcome out;
  test::run_ranks(
      kRanks,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world);
        parallel::StrategyOptions options;
        auto& ft = options.of<parallel::ft::FaultToleranceOptions>();
        ft.mode = fault_tolerance;
        if (ft.replicas()) ft.replica_shards = kShards;
        auto strategy = parallel::make_strategy(strategy_name, options);
        strategy->setup(test::double_mlp(), optim::optimizer_factory(test::adam()), grid);
        const int replica = world->rank() / kShards;
        auto store = world->key_value();
        for (int step = 0; step < kSteps; ++step) {
          if (replica == 2 && step == dies_before) {
            test::report_death(*store, world->rank());  // as its launcher would
            if (!replaced) return;
            test::wait_for_key(*store, "test/left");
            strategy.reset();
            ft.replacement = true;
            strategy = parallel::make_strategy(strategy_name, options);
            strategy->setup(test::double_mlp(99), optim::optimizer_factory(test::adam()), grid);
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, dies_before + 2);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && replica != 2 && step == dies_before + 1) {
            test::wait_for_joins(*store, kShards);
          }
          const auto result =
              strategy->train_step({data.batch(step, world->rank())}, parallel::cross_entropy);
          if (auto* replicas = parallel::ft::replaceable(*strategy)) {
            replicas->admit_waiting(step + 1);
          }
          if (replaced && world->rank() == 0 && step == dies_before) store->set("test/left", "1");
          if (world->rank() == 0) {
            out.replicas_seen.push_back(result.metrics.count("replicas")
                                            ? result.metrics.at("replicas")
                                            : static_cast<double>(kRanks / kShards));
            out.losses.push_back(result.loss);
          }
        }
        out.weights[world->rank()] = test::values_of(*strategy);
      },
      std::chrono::seconds(60));
  return out;
}

// One process on the rows of the ranks present at each step (replica 2's, world ranks 4 and 5,
// left out from step `dies_before` until step `joins`); its loss at each step in `losses`.
std::vector<at::Tensor> train_one_process(int dies_before, int joins = kSteps,
                                          std::vector<double>* losses = nullptr) {
  return test::one_process_on_present_rows(
      rows(), kSteps, test::adam(),
      [&](int step, int rank) {
        return rank < kRanks - kShards || dies_before < 0 || step < dies_before || step >= joins;
      },
      losses);
}

}  // namespace

// Without a failure: one process on the global batch (zero1 and zero2), and the loss each step
// reports is the global batch's.
TEST(FaultToleranceZero, WithoutAFailureHybridShardsTrainAsOneProcess) {
  at::set_num_threads(1);
  std::vector<double> losses;
  const auto expected = train_one_process(-1, kSteps, &losses);
  for (const std::string strategy : {"zero1", "zero2"}) {
    const Outcome out = train_replicas(strategy, "replicas", -1);
    EXPECT_LT(test::worst_of(out.weights, expected, {0, 1, 2, 3, 4, 5}), 1e-12) << strategy;
    ASSERT_EQ(out.losses.size(), losses.size());
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(out.losses[i], losses[i], 1e-12);
    // The same run without fault tolerance (ZeRO over all six ranks) agrees.
    EXPECT_LT(test::worst_of(train_replicas(strategy, "none", -1).weights, expected, {0, 3, 5}),
              1e-12);
  }
}

// Replica 2's two ranks fail before step 4 (index 3): the other two replicas' four ranks commit
// it without them and go on.
TEST(FaultToleranceZero, TheOtherReplicasCommitTheStepWithoutAFailedReplica) {
  at::set_num_threads(1);
  for (const std::string strategy : {"zero1", "zero2"}) {
    const Outcome out = train_replicas(strategy, "replicas", 3);
    EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2})) << strategy;
    EXPECT_LT(test::worst_of(out.weights, train_one_process(3), {0, 1, 2, 3}), 1e-12) << strategy;
    EXPECT_GT(test::worst_of(out.weights, train_one_process(4), {0, 1, 2, 3}), 1e-6) << strategy;
  }
}

// A replacement replica (both ranks) joins: each takes the parameters and its shard's Adam
// state from replica 0's rank at its position; from the step after its admission the three
// train together again, and it ends with replica 0's weights exactly.
TEST(FaultToleranceZero, AReplacementReplicaTakesEachShardsStateAndTheThreeTrainOn) {
  at::set_num_threads(1);
  const Outcome out = train_replicas("zero2", "replicas", 2, /*replaced=*/true);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 2, 2, 3, 3}));
  EXPECT_LT(test::worst_of(out.weights, train_one_process(2, 4), {0, 1, 2, 3, 4, 5}), 1e-12);
  EXPECT_EQ(test::max_difference(out.weights[4], out.weights[0]), 0.0);
  EXPECT_EQ(test::max_difference(out.weights[5], out.weights[1]), 0.0);
  EXPECT_GT(test::worst_of(out.weights, train_one_process(2), {0}), 1e-6);
}

#ifdef DTRAIN_CLI_PATH
// Through the launcher, zero2 with 2 replicas of 2 shards: rank 3 is killed at step 12, its
// launcher ends rank 2 (its replica) too, replica 0 goes on alone, both are started again and
// join; the job ends with two replicas, and the leading replica's checkpoint (its two shards'
// files) resumes plain zero2 on two ranks.
TEST(FaultToleranceZero, TheLauncherReplacesAHybridShardedReplica) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const std::string job =
      " train --model mlp --hidden 32 --threads 1 --batch-size 16 "
      "--log-every 1 --no-progress --strategy zero2 --checkpoint-dir " +
      (dir / "ckpt");
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=3:12 " + test::cli::kDtrain + job +
      " --nproc 4 --max-steps 150 --checkpoint-every 50 --fault-tolerance replicas "
      "--replica-shards 2 --metrics " +
      metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  test::expect_second_replica_replaced(out.text, metrics, 150);
  const auto resumed = test::cli::run(test::cli::kDtrain + job +
                                      " --nproc 2 --batch-size 32 "
                                      "--max-steps 152");
  ASSERT_EQ(resumed.code, 0) << resumed.text;
  EXPECT_TRUE(test::cli::has(resumed, "resumed from step 150")) << resumed.text;
}

// What --replica-shards refuses, and bad input is not replaced.
TEST(FaultToleranceZero, BadLayoutsAreRefused) {
  const std::string base = test::cli::kDtrain + " train --model mlp --max-steps 1 ";
  auto out = test::cli::run(base + "--nproc 2 --fault-tolerance replicas --replica-shards 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out,
                             "shard the optimizer state with --strategy zero1 or zero2, "
                             "not ddp"))
      << out.text;
  out = test::cli::run(base +
                       "--strategy zero2 --nproc 3 --fault-tolerance replicas --replica-shards 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "3 ranks do not divide into replicas of --replica-shards 2"))
      << out.text;
  out = test::cli::run(base + "--strategy zero2 --nproc 2 --replica-shards 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "apply with --fault-tolerance replicas")) << out.text;
  // A rank that exits with code 2 (bad input) is not started again: a replacement would fail
  // the same way; the job stops.
  out = test::cli::run(test::cli::kDtrain +
                       " launch --nproc-per-node 2 --tolerate-failures --max-replacements 5 "
                       "--replace-first-replica -- sh -c 'sleep 0.2; exit 2'");
  EXPECT_NE(out.code, 0) << out.text;
  EXPECT_FALSE(test::cli::has(out, "started rank")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "exited with code 2; stopping the other ranks")) << out.text;
}
#endif
