// --pipeline-parallel 2 --fault-tolerance replicas: three replicas, each a two-stage pipeline
// (1F1B, two micro-batches, a float64 MLP, SGD with momentum) on two consecutive world ranks.
// Without a failure the training is the plain pipeline's (Megatron's rank order) and one
// process's on every replica's rows; when replica 2 (both its stages) fails before a step, the
// other two commit it without it and go on, every stage's weights those of one process on the
// rows of the replicas present; a replacement pipeline (two new ranks) joins with the state of
// replica 0 at each stage and ends with exactly its weights. Through the launcher: one stage's
// rank killed ends its replica's other stage too, the other replica goes on (evaluating and
// checkpointing alone), both ranks are started again and join it, and the checkpoint resumes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "FaultToleranceRuns.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#ifdef DTRAIN_CLI_PATH
#include "CliRuns.h"
#include "TempDir.h"
#endif

using namespace dtrain;

namespace {

constexpr int kReplicas = 3;
constexpr int kStages = 2;
constexpr int kSteps = 6;
constexpr int64_t kMicro = 2;  // rows per micro-batch; two micro-batches per replica and step

// Replica r's rows at step t.
test::RankRows rows() { return test::RankRows(kSteps, kReplicas, 2 * kMicro, 41); }

// The schedule each replica's pipeline runs, and the model's hidden layers (stages - 1).
struct Schedule {
  std::string name = "1f1b";
  int virtual_stages = 1;
  int hidden_layers = 1;
};

Model model_for(const Schedule& schedule, int seed = 5) {
  return test::double_mlp(seed, schedule.hidden_layers);
}

parallel::StrategyOptions pipeline_options(const std::string& fault_tolerance,
                                           const Schedule& schedule = {}) {
  parallel::StrategyOptions options;
  auto& p = options.of<parallel::pipeline::PipelineOptions>();
  p.schedule = schedule.name;
  p.virtual_stages = schedule.virtual_stages;
  p.data_parallel = "ddp";
  options.of<parallel::ft::FaultToleranceOptions>().mode = fault_tolerance;
  return options;
}

std::vector<data::Batch> micro_batches(const data::Batch& rows) {
  return {{rows.inputs.narrow(0, 0, kMicro), rows.targets.narrow(0, 0, kMicro)},
          {rows.inputs.narrow(0, kMicro, kMicro), rows.targets.narrow(0, kMicro, kMicro)}};
}

struct Outcome {
  std::vector<std::vector<at::Tensor>> weights =
      std::vector<std::vector<at::Tensor>>(kReplicas * kStages);  // per world rank, whole model
  std::vector<double> replicas_seen;                              // world rank 0's
  std::vector<double> losses;                                     // world rank 0's
};

// Replica 2 (world ranks 4, 5 under --fault-tolerance replicas) fails before step `dies_before`
// (-1: never); `replaced`: a replacement pipeline (another initial model) announces itself once
// the others committed that step without it, and is admitted at the end of the next.
Outcome train_replicas(const std::string& fault_tolerance, int dies_before, bool replaced = false,
                       const Schedule& schedule = {}) {
  const test::RankRows data = rows();
  Outcome out;
  const auto order =
      fault_tolerance == "replicas" ? comm::GridOrder::kTpPpDp : comm::GridOrder::kTpDpPp;
  test::run_ranks(
      kReplicas * kStages,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, 1, kStages, order);
        const int replica = grid->coordinates().dp;
        parallel::StrategyOptions options = pipeline_options(fault_tolerance, schedule);
        auto strategy = parallel::make_strategy("pipeline", options);
        strategy->setup(model_for(schedule), optim::optimizer_factory(test::momentum_sgd()), grid);
        auto store = world->key_value();
        for (int step = 0; step < kSteps; ++step) {
          if (replica == 2 && step == dies_before) {
            test::report_death(*store, world->rank());  // as its launcher would
            if (!replaced) return;
            test::wait_for_key(*store, "test/left");
            strategy.reset();
            options.of<parallel::ft::FaultToleranceOptions>().replacement = true;
            strategy = parallel::make_strategy("pipeline", options);
            strategy->setup(model_for(schedule, 99), optim::optimizer_factory(test::momentum_sgd()),
                            grid);
            const int64_t joined = parallel::ft::replaceable(*strategy)->joined_at_step();
            EXPECT_EQ(joined, dies_before + 2);
            step = static_cast<int>(joined);
            if (step >= kSteps) break;
          }
          if (replaced && replica != 2 && step == dies_before + 1) {
            // Both of the replacement's ranks announce themselves before this step commits.
            test::wait_for_joins(*store, kStages);
          }
          const auto result = strategy->train_step(micro_batches(data.batch(step, replica)),
                                                   parallel::cross_entropy);
          if (auto* replicas = parallel::ft::replaceable(*strategy)) {
            replicas->admit_waiting(step + 1);
          }
          if (replaced && world->rank() == 0 && step == dies_before) store->set("test/left", "1");
          if (world->rank() == 0) {
            out.replicas_seen.push_back(result.metrics.count("replicas")
                                            ? result.metrics.at("replicas")
                                            : static_cast<double>(kReplicas));
            out.losses.push_back(result.loss);
          }
        }
        out.weights[world->rank()] = test::values_of(*strategy);
      },
      std::chrono::seconds(60));
  return out;
}

// One process on the rows of the replicas present at each step: replica 2's are left out from
// step `dies_before` until step `joins`.
struct Serial {
  std::vector<at::Tensor> weights;
  std::vector<double> losses;
};

Serial train_one_process(int dies_before, int joins = kSteps, const Schedule& schedule = {}) {
  const test::RankRows data = rows();
  Model model = model_for(schedule);
  auto optimizer = optim::make_optimizer(model.module->parameters(), test::momentum_sgd());
  Serial out;
  for (int step = 0; step < kSteps; ++step) {
    const int present = dies_before >= 0 && step >= dies_before && step < joins ? 2 : 3;
    std::vector<at::Tensor> inputs, targets;
    for (int r = 0; r < present; ++r) {
      inputs.push_back(data.batch(step, r).inputs);
      targets.push_back(data.batch(step, r).targets);
    }
    optimizer->zero_grad();
    at::Tensor loss = parallel::cross_entropy(model(at::cat(inputs)), at::cat(targets));
    loss.backward();
    optimizer->step();
    out.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model.module->parameters()) out.weights.push_back(p.detach().clone());
  return out;
}

double worst_loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst;
}

}  // namespace

TEST(FaultTolerancePipeline, WithoutAFailureReplicasTrainAsThePlainPipeline) {
  at::set_num_threads(1);
  const Outcome plain = train_replicas("none", -1);
  const Outcome tolerant = train_replicas("replicas", -1);
  const Serial serial = train_one_process(-1);
  EXPECT_EQ(tolerant.replicas_seen, std::vector<double>(kSteps, 3.0));
  for (int r = 0; r < kReplicas * kStages; ++r) {
    EXPECT_LT(test::max_difference(plain.weights[r], tolerant.weights[r]), 1e-12) << "rank " << r;
  }
  EXPECT_LT(test::worst_of(tolerant.weights, serial.weights, {0, 1, 2, 3, 4, 5}), 1e-10);
  EXPECT_LT(worst_loss_diff(tolerant.losses, serial.losses), 1e-12);
}

// Replica 2's two stages fail before step 4 (index 3): the other replicas' four ranks commit it
// without them and go on; every stage's weights are one process's on the two replicas' rows
// from then on, and the loss reported is the mean over them.
TEST(FaultTolerancePipeline, TheOtherReplicasCommitTheStepWithoutAFailedPipeline) {
  at::set_num_threads(1);
  const Outcome out = train_replicas("replicas", 3);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2}));
  const Serial serial = train_one_process(3);
  EXPECT_LT(test::worst_of(out.weights, serial.weights, {0, 1, 2, 3}), 1e-10);
  EXPECT_LT(worst_loss_diff(out.losses, serial.losses), 1e-12);
  // The oracle tells the cases apart: replica 2's rows counted one step longer.
  EXPECT_GT(test::worst_of(out.weights, train_one_process(4).weights, {0, 1, 2, 3}), 1e-6);
}

// Every flushed schedule: GPipe, interleaved 1F1B (2 chunks per rank, 4 model stages) and zero
// bubble H1 (backward split into input and weight gradients, the weight gradients into .grad at
// W): replica 2 failing before step 4, the others' weights are one process's on their rows.
TEST(FaultTolerancePipeline, EveryFlushedScheduleCommitsWithoutAFailedPipeline) {
  at::set_num_threads(1);
  for (const Schedule& schedule :
       {Schedule{"gpipe", 1, 1}, Schedule{"interleaved", 2, 3}, Schedule{"zb-h1", 1, 1}}) {
    const Outcome out = train_replicas("replicas", 3, false, schedule);
    EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 3, 2, 2, 2})) << schedule.name;
    EXPECT_LT(
        test::worst_of(out.weights, train_one_process(3, kSteps, schedule).weights, {0, 1, 2, 3}),
        1e-10)
        << schedule.name;
  }
}

// A replacement pipeline (both stages) joins: each of its ranks takes the state of replica 0's
// rank at its stage; from the step after its admission the three train together again.
TEST(FaultTolerancePipeline, AReplacementPipelineTakesEachStagesStateAndTheThreeTrainOn) {
  at::set_num_threads(1);
  const Outcome out = train_replicas("replicas", 2, /*replaced=*/true);
  EXPECT_EQ(out.replicas_seen, (std::vector<double>{3, 3, 2, 2, 3, 3}));
  const Serial serial = train_one_process(2, 4);
  EXPECT_LT(test::worst_of(out.weights, serial.weights, {0, 1, 2, 3, 4, 5}), 1e-10);
  EXPECT_EQ(test::max_difference(out.weights[4], out.weights[0]), 0.0);
  EXPECT_EQ(test::max_difference(out.weights[5], out.weights[1]), 0.0);
  EXPECT_GT(test::worst_of(out.weights, train_one_process(2).weights, {0, 1}), 1e-6);
}

// A pipeline inside replicas commits whole steps over fixed stages: what it does not take is
// named before any rank starts.
TEST(FaultTolerancePipeline, WhatItDoesNotTakeIsNamed) {
  auto refused =
      [](const std::function<void(parallel::StrategyOptions&, parallel::Layout&)>& change) {
        parallel::StrategyOptions options = pipeline_options("replicas");
        parallel::Layout layout;
        layout.strategy = "ddp";
        layout.ranks = 4;
        layout.pipeline_parallel = 2;
        layout.micro_batches = 2;
        change(options, layout);
        try {
          parallel::resolve_strategy(layout, options);
        } catch (const InputError& e) {
          return std::string(e.what());
        }
        return std::string("accepted");
      };
  using O = parallel::StrategyOptions;
  using L = parallel::Layout;
  EXPECT_EQ(refused([](O&, L&) {}), "accepted");
  EXPECT_NE(refused([](O& o, L&) {
              o.of<parallel::pipeline::PipelineOptions>().sync = "2bw";
            }).find("--pipeline-sync flush, not 2bw"),
            std::string::npos);
  EXPECT_NE(refused([](O& o, L&) {
              o.of<parallel::pipeline::PipelineOptions>().balance = "time";
            }).find("--pipeline-balance time measures on each replica"),
            std::string::npos);
  EXPECT_NE(refused([](O&, L& l) { l.strategy = "zero1"; }).find("the replicas are ddp's"),
            std::string::npos);
  EXPECT_NE(refused([](O&, L& l) {
              l.ranks = 6, l.pipeline_parallel = 4;
            }).find("6 ranks do not divide into replicas of --pipeline-parallel 4"),
            std::string::npos);
  const std::string stage_replicas = refused([](O&, L& l) {
    l.stage_replicas = {1, 2};
    l.ranks = 3;
  });
  EXPECT_NE(stage_replicas.find("--stage-replicas replicates stages inside one"), std::string::npos)
      << stage_replicas;
}

#ifdef DTRAIN_CLI_PATH
// Through the launcher, 2 replicas of a 2-stage pipeline: rank 3 (replica 1's last stage) is
// killed at step 12; its launcher ends rank 2 too, replica 0 goes on alone (evaluating over its
// two stages and checkpointing), both ranks are started again and join at a step's end, the job
// ends with two replicas (150 steps: time for the replacements to start on a loaded machine),
// nothing restarts, and the checkpoint resumes.
TEST(FaultTolerancePipeline, TheLauncherReplacesAPipelinesRanksTogether) {
  test::TempDir dir;
  const std::string metrics = dir / "metrics.jsonl";
  const std::string flags =
      " train --model mlp --hidden 32 --pipeline-parallel 2 --micro-batches 2 --nproc 4 "
      "--threads 1 --batch-size 8 --log-every 1 --no-progress --fault-tolerance replicas "
      "--replica-heartbeat-timeout 0.4 --eval-every 50 --checkpoint-dir " +
      (dir / "ckpt") + " --checkpoint-every 50 --metrics " + metrics;
  const auto out = test::cli::run("DTRAIN_SIMULATE_SLOW_STEP_MS=40 DTRAIN_SIMULATE_FAILURE=3:12 " +
                                  test::cli::kDtrain + flags + " --max-steps 150");
  ASSERT_EQ(out.code, 0) << out.text;
  test::expect_second_replica_replaced(out.text, metrics, 150);
  EXPECT_TRUE(test::cli::has(out, "started rank 3 again (replacement 1 of at most 10")) << out.text;
  EXPECT_TRUE(test::cli::has(out, "started rank 2 again (replacement 1 of at most 10")) << out.text;
  EXPECT_FALSE(test::cli::has(out, "restart")) << out.text;
  // The leading replica evaluated over its two stages (the last stage counts the examples).
  std::ifstream in(metrics);
  std::string line;
  int evaluations = 0;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.at("event") != "eval") continue;
    ++evaluations;
    EXPECT_GT(record.at("val_loss").get<double>(), 0.0) << line;
    EXPECT_GT(record.at("val_accuracy").get<double>(), 0.2) << line;  // chance: 0.1
  }
  EXPECT_GE(evaluations, 2) << out.text;
  // The leading replica's stages wrote their files; the checkpoint verifies and resumes.
  const auto verified = test::cli::run(test::cli::kDtrain + " ckpt verify " + (dir / "ckpt"));
  EXPECT_EQ(verified.code, 0) << verified.text;
  EXPECT_TRUE(test::cli::has(verified, "ok       " + (dir / "ckpt/step-00000150")))
      << verified.text;
  const auto resumed = test::cli::run(test::cli::kDtrain + flags + " --max-steps 152");
  ASSERT_EQ(resumed.code, 0) << resumed.text;
  EXPECT_TRUE(test::cli::has(resumed, "resumed from step 150")) << resumed.text;
}
#endif
