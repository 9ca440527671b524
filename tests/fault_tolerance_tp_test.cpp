// --fault-tolerance replicas whose replicas are tensor-parallel groups: three replicas of two
// ranks (a tiny GPT with sequence parallelism, float64). Without a failure the training is
// plain ddp x TP's; when replica 2 (both its ranks) fails before a step, the other two commit
// it without it and go on, each rank's blocks those of one process trained on the rows of the
// replicas present; a replacement replica (two new ranks) joins with the state of replica 0 at
// each position and ends with exactly its blocks. Through the launcher: one rank of a replica
// killed (or stopped) ends its replica's other rank too, the others finish (rank 0's replica
// checkpointing alone), and the launcher's replacements (both ranks) join them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "FaultToleranceRuns.h"
#include "Oracle.h"
#include "TensorParallelRuns.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaManager.h"
#ifdef DTRAIN_CLI_PATH
#include "CliRuns.h"
#include "TempDir.h"
#endif

using namespace dtrain;

namespace {

constexpr int kReplicas = 3;
constexpr int kTp = 2;
constexpr int kSteps = 6;
constexpr int64_t kLocal = 2;  // rows per replica and step

struct Rows {
  test::GptData d = test::gpt_data(kSteps);
  std::vector<std::vector<int64_t>> order;  // each replica's
  Rows() {
    for (int r = 0; r < kReplicas; ++r) {
      order.push_back(
          data::DistributedSampler(d.dataset.size(), kReplicas, r, {true, 5, true}).indices());
    }
  }
  data::Batch batch(int step, int replica) const {
    const auto& o = order[replica];
    return d.dataset.get(
        std::vector<int64_t>(o.begin() + step * kLocal, o.begin() + (step + 1) * kLocal));
  }
};

models::GptConfig config() {
  auto c = test::tiny_gpt();
  c.sequence_parallel = true;
  return c;
}

struct Outcome {
  std::vector<test::Named> values = std::vector<test::Named>(kReplicas * kTp);  // per world rank
  std::vector<test::tp::ParameterSplits> splits =
      std::vector<test::tp::ParameterSplits>(kReplicas * kTp);
  std::vector<double> replicas_seen;  // world rank 0's
};

// Replica 2 (world ranks 4, 5) fails before step `dies_before` (-1: never); `replaced`: a
// replacement replica (another initial model, on the same two ranks' tensor-parallel group)
// announces itself once the others committed that step without it, and is admitted at the end
// of the next.
Outcome train_replicas(const std::string& fault_tolerance, int dies_before, bool replaced = false) {
  const Rows rows;
  Outcome out;
  test::run_ranks(
      kReplicas * kTp,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, kTp);
        const int replica = grid->coordinates().dp;
        parallel::StrategyOptions options;
        options.of<parallel::ft::FaultToleranceOptions>().mode = fault_tolerance;
        Model model = test::build_gpt(config(), grid->tp());
        const parallel::LossFn loss =
            model.loss ? parallel::LossFn(model.loss) : parallel::LossFn(parallel::cross_entropy);
        auto strategy = parallel::make_strategy("ddp", options);
        strategy->setup(model, optim::optimizer_factory(test::momentum_sgd()), grid);
        auto store = world->key_value();
        for (int step = 0; step < kSteps; ++step) {
          if (replica == 2 && step == dies_before) {
            test::report_death(*store, world->rank());  // as its launcher would
            if (!replaced) return;
            test::wait_for_key(*store, "test/left");
            strategy.reset();
            Model fresh;
            {
              static std::mutex mutex;
              std::lock_guard<std::mutex> lock(mutex);
              torch::manual_seed(99);
              fresh = models::make_gpt(config(), grid->tp());
              fresh.module->to(at::kDouble);
            }
            options.of<parallel::ft::FaultToleranceOptions>().replacement = true;
            strategy = parallel::make_strategy("ddp", options);
            strategy->setup(fresh, optim::optimizer_factory(test::momentum_sgd()), grid);
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, dies_before + 2);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && replica != 2 && step == dies_before + 1) {
            // Both of the replacement's ranks announce themselves before this step commits.
            test::wait_for_joins(*store, kTp);
          }
          const auto result = strategy->train_step({rows.batch(step, replica)}, loss);
          if (auto* replicas = parallel::ft::replaceable(*strategy)) {
            replicas->admit_waiting(step + 1);
          }
          if (replaced && world->rank() == 0 && step == dies_before) store->set("test/left", "1");
          if (world->rank() == 0) {
            out.replicas_seen.push_back(result.metrics.count("replicas")
                                            ? result.metrics.at("replicas")
                                            : static_cast<double>(kReplicas));
          }
        }
        out.values[world->rank()] = test::named_values(strategy->model());
        out.splits[world->rank()] = test::tp::parameter_splits(*strategy->model().module);
      },
      std::chrono::seconds(60));
  return out;
}

// One process on the rows of the replicas present at each step: replica 2's are left out from
// step `dies_before` until step `joins`.
test::Named train_one_process(int dies_before, int joins = kSteps) {
  const Rows rows;
  Model model = test::build_gpt(config(), nullptr);
  auto optimizer = optim::make_optimizer(model.module->parameters(), test::momentum_sgd());
  for (int step = 0; step < kSteps; ++step) {
    const int present = dies_before >= 0 && step >= dies_before && step < joins ? 2 : 3;
    std::vector<at::Tensor> inputs, targets;
    for (int r = 0; r < present; ++r) {
      inputs.push_back(rows.batch(step, r).inputs);
      targets.push_back(rows.batch(step, r).targets);
    }
    optimizer->zero_grad();
    parallel::cross_entropy(model(at::cat(inputs)), at::cat(targets)).backward();
    optimizer->step();
  }
  return test::named_values(model);
}

// The worst difference of the given world ranks' blocks from the serial values.
double worst_block_diff(const Outcome& out, const test::Named& serial,
                        const std::vector<int>& ranks) {
  double worst = 0;
  for (const int r : ranks) {
    EXPECT_FALSE(out.values[r].empty()) << "world rank " << r;
    worst = std::max(worst, test::max_block_diff(out.values[r], serial, out.splits[r]));
  }
  return worst;
}

double worst_rank_diff(const test::Named& a, const test::Named& b) {
  double worst = 0;
  for (const auto& [name, value] : a) {
    worst = std::max(worst, (value - b.at(name)).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

TEST(FaultToleranceTensorParallel, WithoutAFailureReplicasTrainAsDdp) {
  at::set_num_threads(1);
  const Outcome plain = train_replicas("none", -1);
  const Outcome tolerant = train_replicas("replicas", -1);
  for (int r = 0; r < kReplicas * kTp; ++r) {
    EXPECT_LT(worst_rank_diff(plain.values[r], tolerant.values[r]), 1e-12) << "world rank " << r;
  }
  EXPECT_LT(worst_block_diff(tolerant, train_one_process(-1), {0, 1, 2, 3, 4, 5}), 1e-10);
}

// Replica 2's two ranks fail before step 4 (index 3): the other replicas' four ranks commit it
// without them and go on; their blocks are one process's on the two replicas' rows from then on.
TEST(FaultToleranceTensorParallel, TheOtherReplicasCommitTheStepWithoutAFailedGroup) {
  at::set_num_threads(1);
  const Outcome out = train_replicas("replicas", 3);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2}));
  EXPECT_LT(worst_block_diff(out, train_one_process(3), {0, 1, 2, 3}), 1e-10);
  // The oracle tells the cases apart: replica 2's rows counted one step longer.
  EXPECT_GT(worst_block_diff(out, train_one_process(4), {0, 1, 2, 3}), 1e-6);
}

// A replacement replica (both ranks) joins: each of its ranks takes the state of replica 0's
// rank at its position; from the step after its admission the three train together again.
TEST(FaultToleranceTensorParallel, AReplacementGroupTakesEachPositionsStateAndTheThreeTrainOn) {
  at::set_num_threads(1);
  const Outcome out = train_replicas("replicas", 2, /*replaced=*/true);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 2, 2, 3, 3}));
  EXPECT_LT(worst_block_diff(out, train_one_process(2, 4), {0, 1, 2, 3, 4, 5}), 1e-10);
  EXPECT_EQ(worst_rank_diff(out.values[4], out.values[0]), 0.0);
  EXPECT_EQ(worst_rank_diff(out.values[5], out.values[1]), 0.0);
  EXPECT_GT(worst_block_diff(out, train_one_process(2), {0, 1}), 1e-6);
}

#ifdef DTRAIN_CLI_PATH
// Through the launcher, 2 replicas of 2 tensor-parallel ranks: rank 3 is killed at step 12
// (then, in another run, stopped: counted as dead after 0.4 s and fenced); its launcher ends
// rank 2 too (its replica), rank 0's replica goes on alone, both ranks are started again and
// join at a step's end, and the job ends with two replicas; nothing restarts.
TEST(FaultToleranceTensorParallel, TheLauncherReplacesAReplicasRanksTogether) {
  for (const std::string failure : {"3:12", "3:12:stop"}) {
    test::TempDir dir;
    const std::string metrics = dir / "metrics.jsonl";
    const auto out = test::cli::run(
        "DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=" + failure + " " +
        test::cli::kDtrain +
        " train --model gpt --dataset text --layers 1 --width 32 --heads 2 --context 16 "
        "--tensor-parallel 2 --sequence-parallel --nproc 4 --threads 1 --batch-size 4 "
        "--max-steps 60 --log-every 1 --no-progress --fault-tolerance replicas "
        "--replica-heartbeat-timeout 0.4 --checkpoint-dir " +
        (dir / "ckpt") + " --checkpoint-every 20 --async-checkpoint --metrics " + metrics);
    ASSERT_EQ(out.code, 0) << out.text;
    // Rank 0's replica checkpoints alone: both its tensor-parallel ranks' files, verified.
    const auto verified = test::cli::run(test::cli::kDtrain + " ckpt verify " + (dir / "ckpt"));
    EXPECT_EQ(verified.code, 0) << verified.text;
    EXPECT_TRUE(test::cli::has(verified, "ok       " + (dir / "ckpt/step-00000060")))
        << verified.text;
    EXPECT_TRUE(std::filesystem::exists(dir / "ckpt/step-00000060/state-1-of-2.pt"));
    test::expect_second_replica_replaced(out.text, metrics, 60);
    EXPECT_TRUE(test::cli::has(out, "started rank 3 again (replacement 1 of at most 10"))
        << out.text;
    EXPECT_TRUE(test::cli::has(out, "started rank 2 again (replacement 1 of at most 10"))
        << out.text;
    EXPECT_FALSE(test::cli::has(out, "restart")) << out.text;
  }
}
#endif
