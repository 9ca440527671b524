// Elastic jobs as a user runs them (real launchers and ranks): a job of --nnodes MIN:MAX that
// loses a node restarts on the others from its newest checkpoint, and one a node joins restarts
// at the new size; DiLoCo's islands leave and rejoin that way.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/common/Net.h"

using dtrain::test::TempDir;
using namespace dtrain::test::cli;

// --nnodes MIN:MAX. The job keeps its global batch (--global-batch) at any size, so a run that
// changes size ends with the weights of a run that did not, up to float32 rounding (the sum
// over two ranks and the sum over two micro-batches round differently; a lost or repeated
// step, or a wrong data order, moves them by orders of magnitude more).
// A node lost mid-run (its launcher SIGKILLed) costs a restart; the job goes on with one node
// from the newest checkpoint. A node arriving while the job runs on one node makes it restart
// on two (not counted against --max-restarts).
TEST(Launcher, ElasticJobsRestartAtTheNewSizeAndReshard) {
  TempDir dir;
  const int port = dtrain::free_port();
  const std::string job =
      " train --threads 1 --dataset synthetic --model mlp --hidden 32 "
      "--synthetic-examples 512 --batch-size 32 --global-batch 64 "
      "--epochs 3 --no-progress --checkpoint-every 4 --checkpoint-dir ";
  const auto straight = run(kDtrain + job + (dir / "straight") + " --nproc 2");
  ASSERT_EQ(straight.code, 0) << straight.text;
  const auto expected = final_parameters(dir / "straight");
  ASSERT_FALSE(expected.empty());
  auto elastic = [&](const std::string& env, const std::string& flags, const std::string& out) {
    return env + kDtrain + " launch --nnodes 1:2 --nproc-per-node 1 --grace 1 " +
           "--rdzv-timeout 60 --heartbeat-timeout 3 --master-port " + std::to_string(port) + flags +
           " -- " + kDtrain + job + (dir / out);
  };

  // A node leaves: rank 1 kills its launcher (and so itself) at step 6.
  Output host, joiner;
  std::thread second(
      [&] { joiner = run(elastic("DTRAIN_SIMULATE_FAILURE=1:6:node ", "", "leave")); });
  host = run(elastic("", " --node-rank 0 --rdzv-last-call 5 --max-restarts 1", "leave"));
  second.join();
  EXPECT_EQ(host.code, 0) << host.text;
  EXPECT_EQ(joiner.code, 128 + 9) << joiner.text;
  EXPECT_TRUE(has(host, "node 1's launcher stopped responding")) << host.text;  // the cause
  EXPECT_TRUE(has(host, "restarting the job (restart 1 of 1)")) << host.text;
  EXPECT_TRUE(has(host, "resumed from step 4 on 1 node")) << host.text;
  double difference = max_difference(final_parameters(dir / "leave"), expected);
  EXPECT_LT(difference, 1e-6) << host.text;
  std::printf("node left: max |w - w_straight| = %.3g\n", difference);

  // A node joins: the host runs alone until its step-8 checkpoint, then the second node comes.
  std::thread first([&] {
    host = run(
        elastic("DTRAIN_SIMULATE_SLOW_STEP_MS=150 ", " --node-rank 0 --rdzv-last-call 0", "join"));
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(dir / "join/step-00000008") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  joiner = run(elastic("DTRAIN_SIMULATE_SLOW_STEP_MS=150 ", "", "join"));
  first.join();
  EXPECT_EQ(host.code, 0) << host.text;
  EXPECT_EQ(joiner.code, 0) << joiner.text;
  EXPECT_TRUE(has(joiner, "waits to join it at its next restart")) << joiner.text;
  EXPECT_TRUE(has(host,
                  "a node is waiting to join (the job runs on 1 of at most 2 nodes); "
                  "restarting the job at the new size"))
      << host.text;
  EXPECT_TRUE(has(host, "restart 1 (resize)")) << host.text;
  EXPECT_TRUE(has(host, "on 2 nodes")) << host.text;
  difference = max_difference(final_parameters(dir / "join"), expected);
  EXPECT_LT(difference, 1e-6) << host.text;
  std::printf("node joined: max |w - w_straight| = %.3g\n", difference);
}

// DiLoCo with an island per node: node 1 is killed at step 6, between the outer steps of 4 and
// 8; the other island goes on alone from the step-4 checkpoint (the outer average is over the
// islands present), and the killed node, started again, rejoins at the host's next check: the
// job restarts on 2 nodes and the new island starts from the outer parameters. --global-batch
// keeps the data order at either size.
TEST(Diloco, AKilledIslandLeavesTheOthersTrainingAndRejoins) {
  TempDir dir;
  const int port = dtrain::free_port();
  const std::string root = dir / "islands";
  const std::string job =
      " train --threads 1 --dataset synthetic --model mlp --hidden 32 "
      "--synthetic-examples 512 --batch-size 32 --global-batch 64 --epochs 4 --no-progress "
      "--strategy diloco --outer-steps 4 --checkpoint-every 4 --log-every 1 --metrics " +
      (dir / "metrics.jsonl") + " --checkpoint-dir " + root;
  auto launcher = [&](const std::string& env, const std::string& flags) {
    return env + "DTRAIN_SIMULATE_SLOW_STEP_MS=150 " + kDtrain +
           " launch --nnodes 1:2 --nproc-per-node 1 --grace 1 --rdzv-timeout 60 "
           "--heartbeat-timeout 3 --master-port " +
           std::to_string(port) + flags + " -- " + kDtrain + job;
  };
  Output host, killed, rejoined;
  std::thread first([&] { killed = run(launcher("DTRAIN_SIMULATE_FAILURE=1:6:node ", "")); });
  std::thread main_node(
      [&] { host = run(launcher("", " --node-rank 0 --rdzv-last-call 5 --max-restarts 1")); });
  first.join();
  // The host trains alone past its step-8 checkpoint (only the one-island run writes it), then
  // the killed node comes back.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (!std::filesystem::exists(root + "/step-00000008") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(std::filesystem::exists(root + "/step-00000008/island-1"))
      << "step 8 was written by 2 islands";
  rejoined = run(launcher("", ""));
  main_node.join();
  EXPECT_EQ(killed.code, 128 + 9) << killed.text;
  EXPECT_EQ(host.code, 0) << host.text;
  EXPECT_EQ(rejoined.code, 0) << rejoined.text;
  EXPECT_TRUE(has(host, "restarting the job (restart 1 of 1)")) << host.text;
  EXPECT_TRUE(has(host, "resumed from step 4 on 1 node")) << host.text;
  EXPECT_TRUE(has(host, "restart 2 (resize)")) << host.text;
  EXPECT_TRUE(has(host, "on 2 nodes")) << host.text;
  // Two islands at the end, and a model that learned.
  EXPECT_TRUE(std::filesystem::exists(root + "/step-00000032/island-1")) << host.text;
  const auto parameters = final_parameters(root);
  ASSERT_FALSE(parameters.empty());
  for (const auto& [name, value] : parameters) {
    EXPECT_TRUE(value.isfinite().all().item<bool>()) << name;
  }
  // The step records of the three runs, in order: the loss fell.
  std::ifstream metrics(dir / "metrics.jsonl");
  const std::regex loss("\"event\":\"step\".*\"loss\":([-0-9.e+]+)");
  std::vector<double> losses;
  for (std::string line; std::getline(metrics, line);) {
    std::smatch m;
    if (std::regex_search(line, m, loss)) losses.push_back(std::stod(m[1]));
  }
  ASSERT_GE(losses.size(), 32u);
  EXPECT_LT(losses.back(), 0.8 * losses.front());
}
