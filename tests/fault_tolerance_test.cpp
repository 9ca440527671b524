// --fault-tolerance replicas: replicas that outlive each other. Without a failure the training
// is plain DDP's, exactly; when a replica dies before a step, the survivors regroup, commit that
// step without it and go on, their weights those of one process trained on the global batch of
// the replicas present (all three, then the two), in float64; a replacement that joins takes a
// member's state and from then on the step is the three's again; through the launcher, a replica
// killed mid-run leaves the others to finish the job, and a replacement started by the launcher
// joins them.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "CliRuns.h"
#include "FaultToleranceRuns.h"
#include "RankThreads.h"
#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaManager.h"

using namespace dtrain;

namespace {

constexpr int64_t kBatch = 4;
constexpr int kSteps = 6;

// Replica r's batch at step t: its own rows of one synthetic float64 data set.
test::RankRows rows() { return test::RankRows(kSteps, 3, kBatch, 17); }

optim::OptimizerSpec adam() {
  optim::OptimizerSpec spec;
  spec.name = "adam";
  spec.lr = 0.01;
  return spec;
}

at::Tensor cross_entropy(const at::Tensor& output, const at::Tensor& targets) {
  return at::cross_entropy_loss(output, targets);
}

// Three replicas (rank threads) train kSteps steps; `dies_before` >= 0: replica 2 fails before
// that step: it dies (its launcher's report written where the launcher writes it) or, with
// `stalls`, hangs (its heartbeat stops, its connections stay open) until the others are done.
// Rank 0's weights.
// `replaced`: a replacement for replica 2 (another initial model) joins: it announces itself
// once the others committed step dies_before without it, and they wait for it before step
// dies_before + 1, so it is admitted at that step's end.
// `replacement_weights`: its weights at the end.
std::vector<at::Tensor> train_replicas(const std::string& fault_tolerance, int dies_before,
                                       std::vector<double>* replicas_seen = nullptr,
                                       bool stalls = false, bool replaced = false,
                                       std::vector<at::Tensor>* replacement_weights = nullptr,
                                       int victim = 2, std::vector<int>* leaders = nullptr) {
  const int watcher = victim == 0 ? 1 : 0;  // the rank whose weights and records are returned
  const test::RankRows data = rows();
  std::vector<Model> models;
  for (int r = 0; r < 3; ++r) models.push_back(test::double_mlp());
  std::vector<at::Tensor> weights;
  std::atomic<bool> finished{false};
  test::run_ranks(
      3,
      [&](const comm::CommunicatorPtr& world) {
        parallel::StrategyOptions options;
        options.of<parallel::ft::FaultToleranceOptions>().mode = fault_tolerance;
        auto strategy = parallel::make_strategy("ddp", options);
        strategy->setup(models[world->rank()], optim::optimizer_factory(adam()),
                        std::make_shared<comm::ProcessGrid>(world));
        for (int step = 0; step < kSteps; ++step) {
          if (world->rank() == victim && step == dies_before && stalls) {
            strategy.reset();  // its heartbeat stops; its world's connections stay open
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
            while (!finished && std::chrono::steady_clock::now() < deadline) {
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            }
            return;
          }
          if (world->rank() == victim && step == dies_before) {
            auto store = world->key_value();
            test::report_death(*store, victim);
            if (!replaced) return;  // its communicator goes with it
            // (Its replacement announces itself once the others committed this step without it.)
            test::wait_for_key(*store, "test/left");
            // Its replacement (this thread's world stays, unused: a replacement meets the others
            // in the group that admits it): another model, which the admission overwrites.
            strategy.reset();
            torch::manual_seed(99);
            Model fresh = models::make_model(test::small_mlp(16, 32, 4));
            fresh.module->to(at::kDouble);
            options.of<parallel::ft::FaultToleranceOptions>().replacement = true;
            strategy = parallel::make_strategy("ddp", options);
            strategy->setup(fresh, optim::optimizer_factory(adam()),
                            std::make_shared<comm::ProcessGrid>(world));
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, dies_before + 2);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && world->rank() != victim && step == dies_before + 1) {
            test::wait_for_joins(*world->key_value(), 1);
          }
          const auto result =
              strategy->train_step({data.batch(step, world->rank())}, cross_entropy);
          if (auto* replicas = parallel::ft::replaceable(*strategy)) {
            replicas->admit_waiting(step + 1);
          }
          if (replaced && world->rank() == watcher && step == dies_before) {
            world->key_value()->set("test/left", "1");
          }
          if (world->rank() == watcher && replicas_seen != nullptr) {
            replicas_seen->push_back(result.metrics.count("replicas")
                                         ? result.metrics.at("replicas")
                                         : static_cast<double>(world->size()));
          }
        }
        if (auto* replicas = parallel::ft::replaceable(*strategy); replicas && leaders) {
          if (replicas->leads()) {
            static std::mutex mutex;
            std::lock_guard<std::mutex> lock(mutex);
            leaders->push_back(world->rank());
          }
        }
        if (world->rank() == victim && replacement_weights != nullptr) {
          for (const auto& p : strategy->model().module->parameters()) {
            replacement_weights->push_back(p.detach().clone());
          }
        }
        if (world->rank() == watcher) {
          for (const auto& p : strategy->model().module->parameters()) {
            weights.push_back(p.detach().clone());
          }
          finished = true;
          if (fault_tolerance == "replicas" && dies_before < 0) {
            // A decided step's keys go once the next one is decided: the store stays small.
            auto store = world->key_value();
            EXPECT_FALSE(store->read("ft/g0/t0/decision").has_value());
            EXPECT_FALSE(store->read(concat("ft/g0/t", kSteps - 2, "/summed")).has_value());
            EXPECT_EQ(store->read(concat("ft/g0/t", kSteps - 1, "/decision")).value_or(""),
                      "commit");
          }
        }
      },
      std::chrono::seconds(20));
  return weights;
}

// One process on the global batch of the replicas present at each step: replica `victim`'s
// rows are left out from step `dies_before` until step `joins` (its replacement's first).
std::vector<at::Tensor> train_one_process(int dies_before, int joins = kSteps, int victim = 2) {
  return test::one_process_on_present_rows(rows(), kSteps, adam(), [&](int step, int rank) {
    return rank != victim || dies_before < 0 || step < dies_before || step >= joins;
  });
}

}  // namespace

TEST(FaultTolerance, WithoutAFailureReplicasTrainAsDdp) {
  at::set_num_threads(1);
  const auto plain = train_replicas("none", -1);
  const auto tolerant = train_replicas("replicas", -1);
  EXPECT_LT(test::max_difference(plain, tolerant), 1e-12);
  EXPECT_LT(test::max_difference(tolerant, train_one_process(-1)), 1e-12);
}

TEST(FaultTolerance, SurvivorsCommitTheStepWithoutTheDeadAndGoOn) {
  at::set_num_threads(1);
  std::vector<double> replicas;
  const auto survivors = train_replicas("replicas", 3, &replicas);
  EXPECT_EQ(replicas, (std::vector<double>{3, 3, 3, 2, 2, 2}));
  EXPECT_LT(test::max_difference(survivors, train_one_process(3)), 1e-12);
  // The oracle tells the two apart: the dead replica's data counted at step 4 is another run.
  EXPECT_GT(test::max_difference(survivors, train_one_process(4)), 1e-6);
}

// Live recovery: replica 2 dies before step 3 (index 2); its replacement, started with another
// model, announces itself; the step that commits next admits it, a member sends it the weights
// and Adam's state, and from the step after it the three train together again: the weights are
// one process's on the global batch without replica 2's rows at the two steps it missed, and
// the replacement ends with exactly the members' weights.
TEST(FaultTolerance, AReplacementJoinsWithAMembersStateAndTheThreeTrainOn) {
  at::set_num_threads(1);
  std::vector<double> replicas;
  std::vector<at::Tensor> replacement;
  const auto members = train_replicas("replicas", 2, &replicas, false, true, &replacement);
  EXPECT_EQ(replicas, (std::vector<double>{3, 3, 2, 2, 3, 3}));
  EXPECT_LT(test::max_difference(members, train_one_process(2, 4)), 1e-12);
  EXPECT_EQ(test::max_difference(members, replacement), 0.0);
  // The oracle tells the cases apart: without the replacement, or with it a step earlier.
  EXPECT_GT(test::max_difference(members, train_one_process(2)), 1e-6);
  EXPECT_GT(test::max_difference(members, train_one_process(2, 3)), 1e-6);
}

// Rank 0 fails too without stopping the job: the next replica present leads (evaluates,
// checkpoints, writes the outputs, sends the state) and rank 0's replacement joins as any
// replica; the weights are one process's without replica 0's rows at the steps it missed.
TEST(FaultTolerance, Rank0FailsAndItsReplacementJoinsWhileReplica1Leads) {
  at::set_num_threads(1);
  std::vector<double> replicas;
  std::vector<at::Tensor> replacement;
  std::vector<int> leaders;
  const auto members =
      train_replicas("replicas", 2, &replicas, false, true, &replacement, /*victim=*/0, &leaders);
  EXPECT_EQ(replicas, (std::vector<double>{3, 3, 2, 2, 3, 3}));
  EXPECT_LT(test::max_difference(members, train_one_process(2, 4, 0)), 1e-12);
  EXPECT_GT(test::max_difference(members, train_one_process(2, 4, 2)), 1e-6);
  EXPECT_EQ(test::max_difference(members, replacement), 0.0);
  EXPECT_EQ(leaders, (std::vector<int>{1}));
}

// A replica that hangs (no death to report) is counted as dead once its heartbeat has been
// silent for 2 s: the others commit the step without it, with the same weights as if it had died.
TEST(FaultTolerance, ASilentReplicaIsCountedAsDeadAndTheOthersGoOn) {
  at::set_num_threads(1);
  std::vector<double> replicas;
  const auto started = std::chrono::steady_clock::now();
  const auto survivors = train_replicas("replicas", 3, &replicas, /*stalls=*/true);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_EQ(replicas, (std::vector<double>{3, 3, 3, 2, 2, 2}));
  EXPECT_LT(test::max_difference(survivors, train_one_process(3)), 1e-12);
  EXPECT_GT(seconds, 2.0);  // the heartbeat timeout
  EXPECT_LT(seconds, 10.0);
}

#ifdef DTRAIN_CLI_PATH
namespace {

// Rank 0's step records: three replicas up to step `failed`, two after, `steps` in all.
void expect_two_replicas_after(const std::string& metrics, int64_t failed, int64_t steps) {
  const auto [changes, last] = test::replica_changes(metrics);
  EXPECT_EQ(changes, (std::vector<std::pair<int64_t, double>>{{1, 3.0}, {failed + 1, 2.0}}));
  EXPECT_EQ(last, steps);
}

}  // namespace

// Through the launcher: rank 2 of 3 kills itself (SIGKILL) at step 12; the others finish all 30
// steps at once, without a restart, and rank 0's metrics show two replicas from step 13 on.
TEST(FaultTolerance, AKilledReplicaLeavesTheOthersToFinishTheJob) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_FAILURE=2:12 " + test::cli::kDtrain +
      " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 30 "
      "--log-every 1 --no-progress --fault-tolerance replicas --max-replacements 0 --metrics " +
      metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(test::cli::has(out, "rank 2 kills itself at step 12")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "the other ranks go on")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2 left at step 13")) << out.text;
  expect_two_replicas_after(metrics, 12, 30);
}

// A replica that stops (SIGSTOP: a machine that hangs) is counted as dead by the others once its
// heartbeat is silent, and its launcher kills it (it must not come back into a group that went
// on): the job finishes with the other two.
TEST(FaultTolerance, AStoppedReplicaIsFencedAndTheOthersFinish) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_FAILURE=2:12:stop " + test::cli::kDtrain +
      " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 30 "
      "--log-every 1 --no-progress --fault-tolerance replicas --max-replacements 0 --metrics " +
      metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(test::cli::has(out, "rank 2 stops itself at step 12")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "world rank 2's heartbeat has been silent for 2000 ms"))
      << out.text;
  EXPECT_TRUE(test::cli::has(out, "was counted as dead by the other replicas")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2 left at step 13")) << out.text;
  expect_two_replicas_after(metrics, 12, 30);
}
// A replica that hangs after the last step (stopped once its step committed) is noticed by no
// collective of the others, which end: its launcher kills it once training has ended and its
// heartbeat stays silent, and the job's result stands. The leading replica hanging there ends
// the job with an error instead (its evaluation and summary are missing). Either way the job
// ends, instead of waiting for the stopped process forever.
TEST(FaultTolerance, AReplicaThatHangsAfterTheLastStepIsEnded) {
  for (const int hangs : {2, 0}) {
    test::TempDir dir;
    const std::string metrics = dir / "metrics.jsonl";
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_FAILURE=" + std::to_string(hangs) + ":20:stop " + test::cli::kDtrain +
        " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 20 "
        "--log-every 1 --no-progress --fault-tolerance replicas --replica-heartbeat-timeout 0.4 "
        "--metrics " +
        metrics);
    const std::string rank = "rank " + std::to_string(hangs);
    EXPECT_TRUE(test::cli::has(out, rank + " stops itself at step 20")) << out.text;
    EXPECT_TRUE(test::cli::has(out, rank + " (pid ")) << out.text;
    EXPECT_TRUE(test::cli::has(out, "still runs after training ended, its heartbeat silent for"))
        << out.text;
    EXPECT_LT(out.seconds, 30) << out.text;
    if (hangs == 2) {
      ASSERT_EQ(out.code, 0) << out.text;
      EXPECT_TRUE(test::cli::has(out, "the job's result stands")) << out.text;
      EXPECT_TRUE(test::cli::has(out, "[rank 0] trained 20 steps")) << out.text;
      EXPECT_FALSE(test::cli::has(out, "started rank 2 again")) << out.text;
    } else {
      EXPECT_NE(out.code, 0) << out.text;
      EXPECT_TRUE(test::cli::has(out, "hung after training ended, before its replica ended the "
                                      "job (its final evaluation, checkpoint and summary)"))
          << out.text;
      EXPECT_FALSE(test::cli::has(out, "trained 20 steps")) << out.text;
    }
  }
}

// The leading replica stopped after the last step, 20 times over, its output to a pipe as ctest
// has it: the job ends every time. Whether the launcher notices must not depend on timing: the
// other replicas used to finish, now and then, before the launcher's twice-a-second look had
// read their heartbeat timeout, and then it never learned that training had ended and waited
// for the stopped leader forever (issue 77; 1 run in 3 on a fresh machine; here, the 5th of 20
// runs hung before the fix). Each run is ended after 60 s, so a hang fails the test instead of
// timing it out.
//
// Disabled for now: a second, rarer hang remains (run 5 of 20 hung once in a full suite run
// beside the other tests, after the fix; 0 of 30 runs alone): until it is found this test would
// make CI flaky. Run it with --gtest_also_run_disabled_tests (issue 77).
TEST(FaultTolerance, AStoppedLeaderEndsTheJobEveryTime) {
  for (int run = 0; run < 20; ++run) {
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_FAILURE=0:20:stop timeout -k 5 60 " + test::cli::kDtrain +
        " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 20 "
        "--log-every 1 --no-progress --fault-tolerance replicas --replica-heartbeat-timeout 0.4");
    ASSERT_LT(out.seconds, 55) << "run " << run << " hung:\n" << out.text;
    ASSERT_NE(out.code, 0) << "run " << run << ":\n" << out.text;
    ASSERT_TRUE(test::cli::has(out, "rank 0 (pid ")) << "run " << run << ":\n" << out.text;
    ASSERT_TRUE(test::cli::has(out, "hung after training ended, before its replica ended the job"))
        << "run " << run << ":\n"
        << out.text;
  }
}

// A rank stopped halfway through a request to the rendezvous store (the first byte of one sent,
// as a machine frozen while its heartbeat thread talks to the store) blocks c10d 1.13's store
// server, which reads each request to its end, and with it the launcher and every rank: the
// second, rarer hang of issue 77. The launcher's watchdog kills the stopped rank once its loop
// stalls: the leader stopped after the last step ends the job as a hung leader does (exit 1,
// named) or, when the others were still waiting on the store, as a failed replica (the next
// leads to the end); a replica stopped mid-run is replaced and the job finishes (exit 0).
// Without the watchdog both runs hang until `timeout` ends them.
TEST(FaultTolerance, ARankStoppedHalfwayThroughAStoreRequestIsEnded) {
  const std::string job =
      " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --log-every 1 "
      "--no-progress --fault-tolerance replicas --replica-heartbeat-timeout 0.4";
  auto out = test::cli::run("DTRAIN_SIMULATE_FAILURE=0:20:stop-in-store timeout -k 5 60 " +
                            test::cli::kDtrain + job + " --max-steps 20");
  ASSERT_LT(out.seconds, 55) << "hung:\n" << out.text;
  // LibTorch 2.x's store server (libuv) reads requests without blocking: there the rank is
  // ended by its silent heartbeat instead, without the watchdog.
  if (TORCH_VERSION_MAJOR < 2) {
    EXPECT_TRUE(test::cli::has(out, "is stopped while the launcher has waited")) << out.text;
  }
  // Either the other replicas had finished (training ended) when the leader was ended: the job
  // fails naming the leader that hung before ending it; or they were still waiting on the store
  // (their last requests blocked too): the leader is a replica that failed, the next one leads
  // and ends the job.
  const bool hung_at_end =
      test::cli::has(out, "hung after training ended, before its replica ended the job");
  if (hung_at_end) {
    EXPECT_NE(out.code, 0) << out.text;
  } else {
    EXPECT_EQ(out.code, 0) << out.text;
    EXPECT_TRUE(test::cli::has(out, "[rank 1] trained 20 steps") ||
                test::cli::has(out, "[rank 2] trained 20 steps"))
        << out.text;
  }
  out = test::cli::run(
      "DTRAIN_SIMULATE_SLOW_STEP_MS=20 DTRAIN_SIMULATE_FAILURE=2:5:stop-in-store "
      "timeout -k 5 90 " +
      test::cli::kDtrain + job + " --max-steps 60");
  ASSERT_LT(out.seconds, 85) << "hung:\n" << out.text;
  EXPECT_EQ(out.code, 0) << out.text;
  if (TORCH_VERSION_MAJOR < 2) {
    EXPECT_TRUE(test::cli::has(out, "is stopped while the launcher has waited")) << out.text;
  }
  EXPECT_TRUE(test::cli::has(out, "started rank 2 again")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "[rank 0] trained 60 steps")) << out.text;
}

// Rank 0 killed at step 12 through the launcher: rank 1's replica leads from step 13 on (it
// appends to the metrics file, evaluates, checkpoints and prints the summary), rank 0's
// replacement joins as any replica, and the checkpoint it wrote (with rank 1's random state)
// resumes a run of three plain ranks.
TEST(FaultTolerance, Rank0KilledTheNextReplicaLeadsAndTheJobFinishes) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const std::string flags =
      " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --log-every 1 "
      "--no-progress --eval-every 30 --checkpoint-every 20 --checkpoint-dir " +
      (dir / "ckpt");
  const auto out = test::cli::run(
      "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=0:12 " + test::cli::kDtrain + flags +
      " --max-steps 60 --fault-tolerance replicas --metrics " + metrics);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(test::cli::has(out, "rank 0 kills itself at step 12")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "started rank 0 again (replacement 1")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 0 left at step 13")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 0 joined after step")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "from world rank 1 in")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "[rank 1] trained 60 steps")) << out.text;
  EXPECT_FALSE(test::cli::has(out, "[rank 0] trained")) << out.text;
  // One record per step, in order, by rank 0 and then rank 1; evaluations at 30 and 60.
  std::ifstream in(metrics);
  std::string line;
  std::vector<int64_t> steps, evals;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.at("event") == "step") steps.push_back(record.at("step").get<int64_t>());
    if (record.at("event") == "eval") evals.push_back(record.at("step").get<int64_t>());
  }
  std::vector<int64_t> expected(60);
  for (int64_t i = 0; i < 60; ++i) expected[i] = i + 1;
  EXPECT_EQ(steps, expected);
  EXPECT_EQ(evals, (std::vector<int64_t>{30, 60}));
  const auto verified = test::cli::run(test::cli::kDtrain + " ckpt verify " + (dir / "ckpt"));
  EXPECT_EQ(verified.code, 0) << verified.text;
  EXPECT_TRUE(test::cli::has(verified, "ok       " + (dir / "ckpt/step-00000060")))
      << verified.text;
  const auto resumed = test::cli::run(test::cli::kDtrain + flags + " --max-steps 62");
  ASSERT_EQ(resumed.code, 0) << resumed.text;
  EXPECT_TRUE(test::cli::has(resumed, "resumed from step 60")) << resumed.text;
}

// Live recovery through the launcher: rank 2 is killed at step 12 (then, stopped, at step 12 of
// another run: counted as dead after --replica-heartbeat-timeout 0.4 s and fenced first); its
// launcher starts it again, the replacement joins the others at a step's end and the job ends with
// three replicas; nothing restarts.
TEST(FaultTolerance, TheLauncherReplacesAFailedReplicaAndItJoinsTheOthers) {
  for (const std::string failure : {"2:12", "2:12:stop"}) {
    test::TempDir dir;
    const std::string metrics = dir / "metrics.jsonl";
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=" + failure + " " +
        test::cli::kDtrain +
        " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 100 "
        "--log-every 1 --no-progress --fault-tolerance replicas --replica-heartbeat-timeout 0.4 "
        "--metrics " +
        metrics);
    ASSERT_EQ(out.code, 0) << out.text;
    if (failure == "2:12:stop") {
      EXPECT_TRUE(test::cli::has(out, "world rank 2's heartbeat has been silent for 400 ms"))
          << out.text;
    }
    EXPECT_TRUE(test::cli::has(out, "started rank 2 again (replacement 1 of at most 10"))
        << out.text;
    EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2 left at step 13")) << out.text;
    EXPECT_TRUE(test::cli::has(out, "replica group: world rank(s) 2 joined after step"))
        << out.text;
    EXPECT_TRUE(test::cli::has(out, "from world rank 0 in")) << out.text;
    EXPECT_FALSE(test::cli::has(out, "restart")) << out.text;
    // Three replicas up to step 12, two for a while, three again to the end.
    test::expect_one_replica_out_and_back(metrics, 100, 3.0, 12, out.text);
  }
}

// Every replica failing at once (both ranks killed at step 12): no member is left to admit
// the replacements or send them a state, so their launcher fails the attempt at once instead of
// leaving them to wait for the job's timeout; with --max-restarts every rank restarts from the
// newest checkpoint (step 10), without it the job fails naming why.
TEST(FaultTolerance, EveryReplicaFailingAtOnceRestartsFromTheCheckpoint) {
  for (const bool restarts : {true, false}) {
    test::TempDir dir;
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_SLOW_STEP_MS=20 DTRAIN_SIMULATE_FAILURE='*:12:1' " + test::cli::kDtrain +
        " train --model mlp --hidden 32 --nproc 2 --threads 1 --batch-size 16 --max-steps 30 "
        "--log-every 1 --no-progress --fault-tolerance replicas --checkpoint-every 10 "
        "--checkpoint-dir " +
        (dir / "ckpt") + (restarts ? " --max-restarts 1" : ""));
    EXPECT_TRUE(test::cli::has(out, "rank 0 kills itself at step 12")) << out.text;
    EXPECT_TRUE(test::cli::has(out, "rank 1 kills itself at step 12")) << out.text;
    EXPECT_TRUE(test::cli::has(out,
                               "every replica failed (world ranks 0,1): none is left to send "
                               "the replacements its state"))
        << out.text;
    EXPECT_LT(out.seconds, 60) << out.text;  // not the job's timeout
    if (restarts) {
      EXPECT_EQ(out.code, 0) << out.text;
      EXPECT_TRUE(
          test::cli::has(out, "restart 1 (failure): stopped at step 12, resumed from step 10"))
          << out.text;
      EXPECT_TRUE(test::cli::has(out, "trained 20 steps (steps 11-30 of 30")) << out.text;
    } else {
      EXPECT_NE(out.code, 0) << out.text;
    }
  }
}
#endif

// --fault-tolerance replicas and a stop on request: a replica told by itself (SIGTERM to its
// rank, as a Kubernetes eviction of its pod) saves nothing of its own, leaves, and the others
// go on to the end (exit 0); the leading replica told leaves after saving, and the next one
// leads; the whole job told (SIGINT to the launcher) stops with a checkpoint, exit 130.
TEST(FaultTolerance, AStopOnRequestEndsOnlyTheReplicaThatWasTold) {
  test::TempDir dir;
  auto job = [&](const std::string& name) {
    return "DTRAIN_SIMULATE_SLOW_STEP_MS=30 " + test::cli::kDtrain +
           " train --model mlp --hidden 32 --nproc 3 --threads 1 --batch-size 16 --max-steps 60 "
           "--log-every 1 --no-progress --fault-tolerance replicas --replica-heartbeat-timeout 2 "
           "--checkpoint-dir " +
           (dir / name) + " --metrics " + (dir / name) + ".jsonl";
  };
  const auto one = test::cli::run_and_signal(job("one"), dir / "one.jsonl", "TERM", false, 2);
  ASSERT_EQ(one.code, 0) << one.text;
  EXPECT_TRUE(test::cli::has(one, "rank 2 (pid "));
  EXPECT_TRUE(test::cli::has(one,
                             "stopped on request (SIGTERM); it is not started again, the "
                             "other ranks go on"))
      << one.text;
  EXPECT_TRUE(test::cli::has(one, "[rank 0] trained 60 steps")) << one.text;

  const auto leader =
      test::cli::run_and_signal(job("leader"), dir / "leader.jsonl", "TERM", false, 0);
  ASSERT_EQ(leader.code, 0) << leader.text;
  EXPECT_TRUE(test::cli::has(leader, "[rank 0] stopped on request (SIGTERM) after step"))
      << leader.text;
  EXPECT_TRUE(test::cli::has(leader, "[rank 1] trained 60 steps")) << leader.text;

  const auto all = test::cli::run_and_signal(job("all"), dir / "all.jsonl", "INT");
  ASSERT_EQ(all.code, 130) << all.text;
  EXPECT_TRUE(test::cli::has(all, "stopped on request (SIGINT): the ranks finished their step"))
      << all.text;
  EXPECT_TRUE(test::cli::has(all, "resume with:")) << all.text;
  const auto saved = train::latest_checkpoint(dir / "all");
  ASSERT_TRUE(saved.has_value()) << all.text;
  EXPECT_LT(train::read_meta(*saved).step, 60) << all.text;
}
