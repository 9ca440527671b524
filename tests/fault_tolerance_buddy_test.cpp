// --strategy zero1 --fault-tolerance replicas --shard-across-replicas: four replicas of one rank
// shard Adam's state over all four, each shard also kept by the next replica (its buddy), in
// float64. Without a failure the training is one process's on the global batch and each rank
// holds half the state; when replica 2 fails, its buddy (replica 3) gives its shard out and the
// others go on (one process on the rows of the replicas present); a replacement takes its shard
// from its buddy and its copy from replica 1, and ends with exactly replica 0's weights; two
// neighbours failing lose a shard and the job stops naming it. The replica group's gather after
// a committed sum regroups when a member dies in it. Through the launcher: a replica killed,
// replaced, and the checkpoint (one file per shard) resumes plain ZeRO-1.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <vector>

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

constexpr int kReplicas = 4;
constexpr int64_t kBatch = 4;
constexpr int kSteps = 6;

test::RankRows rows() { return test::RankRows(kSteps, kReplicas, kBatch, 31); }

struct Outcome {
  std::vector<std::vector<at::Tensor>> weights =
      std::vector<std::vector<at::Tensor>>(kReplicas);
  std::vector<double> replicas_seen;  // replica 0's
  std::vector<double> losses;         // replica 0's
  std::vector<int64_t> optimizer_bytes = std::vector<int64_t>(kReplicas);
};

// Each replica in `dying` fails before the step given with it; `replaced`: a replacement of
// replica 2 (another initial model) announces itself once the others committed its failed step,
// and is admitted at the end of the next.
Outcome train_replicas(const std::vector<std::pair<int, int>>& dying, bool replaced = false,
                       bool shard_across = true, double clip = 0.0) {
  const test::RankRows data = rows();
  Outcome out;
  test::run_ranks(
      kReplicas,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world);
        parallel::StrategyOptions options;
        auto& ft = options.of<parallel::ft::FaultToleranceOptions>();
        ft.mode = "replicas";
        ft.shard_across_replicas = shard_across;
        options.max_grad_norm = clip;
        auto strategy = parallel::make_strategy("zero1", options);
        strategy->setup(test::double_mlp(), optim::optimizer_factory(test::adam()), grid);
        const int me = world->rank();
        auto store = world->key_value();
        int dies_before = -1;
        for (const auto& [replica, step] : dying) {
          if (replica == me) dies_before = step;
        }
        for (int step = 0; step < kSteps; ++step) {
          if (step == dies_before) {
            test::report_death(*store, me);  // as its launcher would
            if (!replaced) return;
            test::wait_for_key(*store, "test/left");
            strategy.reset();
            ft.replacement = true;
            strategy = parallel::make_strategy("zero1", options);
            strategy->setup(test::double_mlp(99), optim::optimizer_factory(test::adam()), grid);
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, dies_before + 2);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && me != 2 && step == dying.front().second + 1) {
            test::wait_for_joins(*store, 1);
          }
          const auto result = strategy->train_step({data.batch(step, me)}, parallel::cross_entropy);
          parallel::ft::replaceable(*strategy)->admit_waiting(step + 1);
          if (replaced && me == 0 && step == dying.front().second) store->set("test/left", "1");
          if (me == 0) {
            out.replicas_seen.push_back(result.metrics.at("replicas"));
            out.losses.push_back(result.loss);
          }
        }
        out.weights[me] = test::values_of(*strategy);
        out.optimizer_bytes[me] = strategy->memory_report().optimizer_bytes;
      },
      std::chrono::seconds(60));
  return out;
}

// One process on the rows of the replicas present at each step (replica 2's rows left out from
// step `dies_before` until step `joins`).
std::vector<at::Tensor> train_one_process(int dies_before, int joins = kSteps,
                                          std::vector<double>* losses = nullptr) {
  return test::one_process_on_present_rows(
      rows(), kSteps, test::adam(),
      [&](int step, int rank) {
        return rank != 2 || dies_before < 0 || step < dies_before || step >= joins;
      },
      losses);
}

}  // namespace

// Without a failure: one process on the global batch, the loss each step reports the global
// batch's; each rank keeps Adam's state for two of the four shards (half of what a replica of
// the same job without --shard-across-replicas keeps).
TEST(FaultToleranceBuddy, WithoutAFailureShardsAcrossReplicasTrainAsOneProcess) {
  at::set_num_threads(1);
  std::vector<double> losses;
  const auto expected = train_one_process(-1, kSteps, &losses);
  const Outcome out = train_replicas({});
  EXPECT_LT(test::worst_of(out.weights, expected, {0, 1, 2, 3}), 1e-12);
  ASSERT_EQ(out.losses.size(), losses.size());
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(out.losses[i], losses[i], 1e-12);
  const Outcome whole = train_replicas({}, false, /*shard_across=*/false);
  for (int r = 0; r < kReplicas; ++r) {
    EXPECT_GT(out.optimizer_bytes[r], 0);
    EXPECT_LE(out.optimizer_bytes[r], whole.optimizer_bytes[r] * 0.55) << "replica " << r;
    EXPECT_GE(out.optimizer_bytes[r], whole.optimizer_bytes[r] * 0.45) << "replica " << r;
  }
}

// With clipping (the norm of the whole mean gradient: the sum is then an allreduce, not the
// reduce-scatter and the shard sent to the buddy): the same training as replicas that each keep
// the whole state (without --shard-across-replicas), with and without a failure.
TEST(FaultToleranceBuddy, ClippingTrainsAsReplicasKeepingTheWholeState) {
  at::set_num_threads(1);
  for (const int dies_before : {-1, 3}) {
    std::vector<std::pair<int, int>> dying;
    if (dies_before >= 0) dying.push_back({2, dies_before});
    const Outcome out = train_replicas(dying, false, true, /*clip=*/0.05);
    const Outcome whole = train_replicas(dying, false, false, /*clip=*/0.05);
    EXPECT_LT(test::worst_of(out.weights, whole.weights[0], {0, 1, 3}), 1e-12) << dies_before;
    // (The clipping bites: without it the weights differ.)
    EXPECT_GT(test::worst_of(out.weights, train_replicas(dying).weights[0], {0}), 1e-6);
  }
}

// Replica 2 fails before step 4 (index 3): its buddy, replica 3, gives its shard out and the
// three go on, as one process without replica 2's rows from that step.
TEST(FaultToleranceBuddy, TheBuddyTakesOverAFailedReplicasShard) {
  at::set_num_threads(1);
  const Outcome out = train_replicas({{2, 3}});
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{4, 4, 4, 3, 3, 3}));
  EXPECT_LT(test::worst_of(out.weights, train_one_process(3), {0, 1, 3}), 1e-12);
  EXPECT_GT(test::worst_of(out.weights, train_one_process(4), {0}), 1e-6);
}

// A replacement of replica 2 joins: the weights from replica 0, its own shard's Adam state from
// its buddy (replica 3) and the copy it keeps from replica 1; the four train on together and it
// ends with replica 0's weights exactly (a fresh Adam state would not: shown by training one
// process that restarts the moments).
TEST(FaultToleranceBuddy, AReplacementTakesItsShardFromItsBuddyAndTheFourTrainOn) {
  at::set_num_threads(1);
  const Outcome out = train_replicas({{2, 2}}, /*replaced=*/true);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{4, 4, 3, 3, 4, 4}));
  EXPECT_LT(test::worst_of(out.weights, train_one_process(2, 4), {0, 1, 2, 3}), 1e-12);
  EXPECT_EQ(test::max_difference(out.weights[2], out.weights[0]), 0.0);
  EXPECT_GT(test::worst_of(out.weights, train_one_process(2), {0}), 1e-6);
}

// Replicas 1 and 2 (neighbours) fail before a replacement joins: shard 1 was held by both, so
// the others stop with an error naming it instead of training on without its state.
TEST(FaultToleranceBuddy, TwoNeighboursFailingLoseAShardAndTheJobStops) {
  at::set_num_threads(1);
  try {
    train_replicas({{1, 2}, {2, 3}});
    FAIL() << "the survivors trained on without shard 1";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("replica 1 and its buddy, replica 2, both failed"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("shard 1 of the optimizer state is lost"),
              std::string::npos)
        << e.what();
  }
}

// The group's collective after a committed sum (the parameters' gather): a member that dies
// after the sum and never reaches the gather is left out, and the others gather again without
// it, each reading the members anew.
TEST(FaultToleranceBuddy, AGatherAfterTheSumRegroupsWhenAMemberDiesInIt) {
  std::vector<std::vector<int>> members_seen(3);
  std::vector<std::vector<double>> gathered(3);
  test::run_ranks(
      3,
      [&](const comm::CommunicatorPtr& world) {
        const int me = world->rank();
        parallel::ft::ReplicaManager manager(world);
        at::Tensor flat = at::ones({4}, at::kDouble);
        EXPECT_EQ(manager.allreduce(flat), 3);
        if (me == 1) {
          test::report_death(*world->key_value(), 1);
          return;
        }
        at::Tensor output;
        const int present = manager.collective([&]() -> std::vector<comm::WorkPtr> {
          const auto& group = manager.group();
          at::Tensor input = at::full({1}, 10.0 * (me + 1), at::kDouble);
          output = at::empty({group->size()}, at::kDouble);
          return {group->allgather(output, input)};
        });
        EXPECT_EQ(present, 2);
        members_seen[me] = manager.members();
        for (int64_t i = 0; i < output.numel(); ++i) {
          gathered[me].push_back(output[i].item<double>());
        }
      },
      std::chrono::seconds(30));
  for (const int r : {0, 2}) {
    EXPECT_EQ(members_seen[r], (std::vector<int>{0, 2})) << r;
    EXPECT_EQ(gathered[r], (std::vector<double>{10.0, 30.0})) << r;
  }
}

#ifdef DTRAIN_CLI_PATH
// Through the launcher, three replicas: rank 1 is killed at step 12, its buddy (rank 2) gives its
// shard out, the replacement joins with its shard and copy; the job ends with three replicas,
// and the checkpoint (a file per shard, written by the replicas present) resumes plain ZeRO-1 on
// two ranks.
TEST(FaultToleranceBuddy, TheLauncherReplacesAReplicaThatShardsTheState) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const std::string job =
      " train --model mlp --hidden 32 --threads 1 --batch-size 16 --optimizer adam --lr 0.001 "
      "--log-every 1 --no-progress --strategy zero1 --checkpoint-dir " +
      (dir / "ckpt");
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=1:12 " + test::cli::kDtrain + job +
      " --nproc 3 --max-steps 120 --checkpoint-every 40 --fault-tolerance replicas "
      "--shard-across-replicas --metrics " +
      metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  for (const char* line : {"replica group: world rank(s) 1 left at step 13",
                           "replica group: world rank(s) 1 joined after step",
                           "world rank 1 took shard 1's optimizer state from world rank 2",
                           "world rank 1 took shard 0's optimizer state from world rank 0"}) {
    EXPECT_TRUE(test::cli::has(out, line)) << "no '" << line << "' in:\n" << out.text;
  }
  EXPECT_FALSE(test::cli::has(out, "restart")) << out.text;
  test::expect_one_replica_out_and_back(metrics, 120, 3.0, 12, out.text);
  const auto resumed =
      test::cli::run(test::cli::kDtrain + job + " --nproc 2 --batch-size 24 --max-steps 122");
  ASSERT_EQ(resumed.code, 0) << resumed.text;
  EXPECT_TRUE(test::cli::has(resumed, "resumed from step 120")) << resumed.text;
}

// A replica killed while step 20's checkpoint is written (its files written, or staged when
// asynchronous, before the others hear of them): the others regroup without it and leave that
// checkpoint unpublished (it may lack the failed replica's shards), the replacement joins and
// the next checkpoint is complete; nothing restarts, and the checkpoints published resume.
// Steps of 100 ms leave the replacement 4 s to join (its start takes 1-2 s on a busy machine).
TEST(FaultToleranceBuddy, AReplicaFailingWhileACheckpointIsWrittenLeavesItUnpublished) {
  for (const bool async : {false, true}) {
    test::TempDir dir;
    const std::string job =
        " train --model mlp --hidden 32 --threads 1 --batch-size 16 --optimizer adam --lr 0.001 "
        "--log-every 1 --no-progress --strategy zero1 --keep-checkpoints 10 --checkpoint-dir " +
        (dir / "ckpt");
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_SLOW_STEP_MS=100 DTRAIN_SIMULATE_FAILURE=1:20:checkpoint " +
        test::cli::kDtrain + job +
        " --nproc 3 --max-steps 60 --checkpoint-every 10 --fault-tolerance replicas "
        "--shard-across-replicas" +
        (async ? " --async-checkpoint" : ""));
    ASSERT_EQ(out.code, 0) << out.text;
    for (const char* line : {"rank 1 kills itself in step 20's checkpoint",
                             "checkpoint step-00000020 is not published: a replica failed while "
                             "it was written",
                             "replica group: world rank(s) 1 left at",
                             "replica group: world rank(s) 1 joined after step"}) {
      EXPECT_TRUE(test::cli::has(out, line)) << "no '" << line << "' in:\n" << out.text;
    }
    EXPECT_FALSE(test::cli::has(out, "restart")) << out.text;
    const auto verified = test::cli::run(test::cli::kDtrain + " ckpt verify " + (dir / "ckpt"));
    EXPECT_EQ(verified.code, 0) << verified.text;
    for (const int step : {10, 30, 40, 50, 60}) {
      EXPECT_TRUE(test::cli::has(verified, "ok       " + (dir / "ckpt/step-000000") +
                                               std::to_string(step)))
          << step << ": " << verified.text;
    }
    EXPECT_FALSE(test::cli::has(verified, "step-00000020")) << verified.text;
    const auto resumed =
        test::cli::run(test::cli::kDtrain + job + " --nproc 2 --batch-size 24 --max-steps 62");
    ASSERT_EQ(resumed.code, 0) << resumed.text;
    EXPECT_TRUE(test::cli::has(resumed, "resumed from step 60")) << resumed.text;
  }
}

// What --shard-across-replicas refuses.
TEST(FaultToleranceBuddy, BadLayoutsAreRefused) {
  const std::string base = test::cli::kDtrain + " train --model mlp --max-steps 1 --nproc 2 ";
  auto out = test::cli::run(base + "--fault-tolerance replicas --shard-across-replicas");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "built for --strategy zero1, not ddp")) << out.text;
  out = test::cli::run(base + "--strategy zero1 --shard-across-replicas");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "apply with --fault-tolerance replicas")) << out.text;
  out = test::cli::run(base +
                       "--strategy zero1 --fault-tolerance replicas --shard-across-replicas "
                       "--replica-shards 2");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "choose one")) << out.text;
  out = test::cli::run(base +
                       "--strategy zero1 --fault-tolerance replicas --shard-across-replicas "
                       "--overlap-param-gather");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(test::cli::has(out, "leave out --overlap-param-gather")) << out.text;
}
#endif
