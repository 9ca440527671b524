// The launcher as a user runs it: real processes, exit codes, messages (the CLI's own tests:
// cli_test.cpp; elastic jobs: elastic_test.cpp).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/train/Checkpoint.h"

using dtrain::test::TempDir;
using namespace dtrain::test::cli;

TEST(Environment, AllocatorTuningYieldsToTheUsersChoice) {
  for (const char* name :
       {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "DTRAIN_NO_MALLOC_TUNING"}) {
    ::unsetenv(name);
  }
  EXPECT_TRUE(dtrain::launch::tune_allocator());  // glibc: applied
  for (const char* name :
       {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "DTRAIN_NO_MALLOC_TUNING"}) {
    ::setenv(name, "131072", 1);
    EXPECT_FALSE(dtrain::launch::tune_allocator()) << name;
    ::unsetenv(name);
  }
}

TEST(Launcher, SetsTorchrunEnvironmentAndPrefixesOutput) {
  const auto out = run(kDtrain +
                       " launch --nproc-per-node 3 --threads 1 -- sh -c "
                       "'echo id=$RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/"
                       "$DTRAIN_THREADS/$MASTER_ADDR'");
  EXPECT_EQ(out.code, 0) << out.text;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(has(out, "[rank " + std::to_string(r) + "] id=" + std::to_string(r) + "/3/" +
                             std::to_string(r) + "/3/1/127.0.0.1"))
        << out.text;
  }
}

// A torch.distributed program runs under dtrain launch as under torchrun: its env://
// rendezvous joins the launcher's store as a client (TORCHELASTIC_USE_AGENT_STORE) instead of
// trying to host one on MASTER_PORT ("Address already in use"), and its ranks all-reduce.
// The program's PyTorch is the one of dtrain's LibTorch version (1.13 in the Debian build, 2.x
// in the pip build: CI runs both).
TEST(Launcher, RunsAPyTorchDistributedProgramAsTorchrunWould) {
  const std::string python = DTRAIN_PYTHON;
  if (!std::filesystem::exists(python) ||
      run(python + " -c 'import torch.distributed'").code != 0) {
    GTEST_SKIP() << "no PyTorch in " << python;
  }
  TempDir dir;
  const std::string program = dir.path() + "/allreduce.py";
  std::ofstream(program) << "import os, torch, torch.distributed as dist\n"
                            "dist.init_process_group('gloo')\n"
                            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
                            "dist.all_reduce(t)\n"
                            "print('sum', int(t.item()), 'of', dist.get_world_size(), "
                            "'restart', os.environ['TORCHELASTIC_RESTART_COUNT'], "
                            "'torch', '.'.join(torch.__version__.split('.')[:2]))\n"
                            "dist.destroy_process_group()\n";
  const auto out =
      run(kDtrain + " launch --nproc-per-node 3 --threads 1 -- " + python + " " + program);
  EXPECT_EQ(out.code, 0) << out.text;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(has(out, "[rank " + std::to_string(r) + "] sum 6 of 3 restart 0 torch " +
                             std::to_string(TORCH_VERSION_MAJOR) + "." +
                             std::to_string(TORCH_VERSION_MINOR)))
        << out.text;
  }
}

TEST(Launcher, AFailingRankStopsTheOthersAndIsNamed) {
  const auto out = run(kDtrain +
                       " launch --nproc-per-node 3 --grace 1 -- sh -c "
                       "'if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; sleep 60'");
  EXPECT_EQ(out.code, 3) << out.text;
  EXPECT_TRUE(has(out, "rank 1")) << out.text;
  EXPECT_TRUE(has(out, "exited with code 3")) << out.text;
  EXPECT_LT(out.seconds, 15) << "the other ranks were not stopped";
}

TEST(Launcher, AKilledRankIsReportedWithItsSignal) {
  const auto out = run(kDtrain +
                       " launch --nproc-per-node 2 --grace 1 -- sh -c "
                       "'if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 60'");
  EXPECT_EQ(out.code, 128 + 9) << out.text;
  EXPECT_TRUE(has(out, "rank 0")) << out.text;
  EXPECT_TRUE(has(out, "signal 9")) << out.text;
  EXPECT_LT(out.seconds, 15);
}

TEST(Launcher, BadOptionsAreOneLineErrors) {
  auto out = run(kDtrain + " launch --nproc-per-node 0 -- true");
  EXPECT_EQ(out.code, 2);
  EXPECT_TRUE(
      has(out, "--nproc-per-node: expects a number of ranks >= 1, auto, cpu or gpu; got '0'"))
      << out.text;
  out = run(kDtrain + " launch --standalone --nnodes 2 --node-rank 0 -- true");
  EXPECT_EQ(out.code, 2);
  EXPECT_TRUE(has(out, "--standalone is one node; it cannot be given with --nnodes 2")) << out.text;
  // A program that cannot run is one error before any rank starts, not one per rank.
  out = run(kDtrain + " launch --nproc-per-node 3 -- /nonexistent/program");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "program '/nonexistent/program' does not exist")) << out.text;
  EXPECT_FALSE(has(out, "[rank")) << out.text;
  out = run(kDtrain + " launch --nproc-per-node 2 -- no-such-program-dtrain");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "is not found in PATH")) << out.text;
  for (const std::string grace : {"-1", "nan", "1e999"}) {
    out = run(kDtrain + " launch --grace " + grace + " -- true");
    EXPECT_EQ(out.code, 2) << grace << "\n" << out.text;
    EXPECT_TRUE(has(out, "--grace")) << out.text;
  }
}

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
}  // namespace

// --max-restarts: a rank SIGKILLed mid-run (after the step-4 checkpoint, at step 6) restarts the
// job, which resumes from step 4 and ends with the same weights and optimizer state as a run
// that never failed. A failure in every attempt exhausts the restarts with the usual message.
TEST(Launcher, RestartsAfterAKilledRankAndEndsWithTheSameWeights) {
  TempDir dir;
  const std::string job =
      " train --nproc 2 --threads 1 --dataset synthetic --model mlp "
      "--hidden 32 --synthetic-examples 512 --batch-size 32 --epochs 2 "
      "--no-progress --checkpoint-every 4 --checkpoint-dir ";
  const auto straight = run(kDtrain + job + (dir / "straight"));
  ASSERT_EQ(straight.code, 0) << straight.text;
  const auto restarted = run("DTRAIN_SIMULATE_FAILURE=1:6:1 " + kDtrain + job +
                             (dir / "restarted") + " --max-restarts 1");
  EXPECT_EQ(restarted.code, 0) << restarted.text;
  EXPECT_TRUE(has(restarted, "rank 1 (pid")) << restarted.text;
  EXPECT_TRUE(has(restarted, "killed by signal 9")) << restarted.text;
  EXPECT_TRUE(has(restarted, "restarting the job (restart 1 of 1)")) << restarted.text;
  EXPECT_TRUE(has(restarted, "resumed from step 4")) << restarted.text;
  EXPECT_TRUE(has(restarted, "succeeded after 1 restart")) << restarted.text;
  EXPECT_TRUE(has(restarted, "stopped at step 6, resumed from step 4 on 1 node (2 steps lost)"))
      << restarted.text;
  const std::string final_state = "/step-00000016/state-0-of-1.pt";
  const std::string expected = file_bytes(dir / "straight" + final_state);
  ASSERT_FALSE(expected.empty());
  EXPECT_TRUE(file_bytes(dir / "restarted" + final_state) == expected)
      << "the restarted run ended with other weights or optimizer state";

  const auto exhausted =
      run("DTRAIN_SIMULATE_FAILURE=1:2 " + kDtrain + job + (dir / "again") + " --max-restarts 1");
  EXPECT_EQ(exhausted.code, 128 + 9) << exhausted.text;
  EXPECT_TRUE(has(exhausted, "failed: rank 1")) << exhausted.text;
  EXPECT_TRUE(has(exhausted, "(after 1 restart)")) << exhausted.text;
}

// A pipeline stage dying: its neighbour, blocked waiting for the next step's activation or
// gradient, is stopped by the launcher (not left to the 2-minute collective timeout), the
// failure is named; with a restart the pipelined job resumes from its checkpoint and ends with
// the uninterrupted run's weights and optimizer state, byte for byte.
TEST(Launcher, APipelineStageDyingStopsItsNeighboursAndARestartResumes) {
  TempDir dir;
  const std::string job =
      " train --nproc 2 --threads 1 --dataset synthetic --model mlp "
      "--hidden 32 32 --synthetic-examples 512 --batch-size 16 "
      "--pipeline-parallel 2 --micro-batches 2 --epochs 1 --no-progress "
      "--checkpoint-every 4 --checkpoint-dir ";
  const auto straight = run(kDtrain + job + (dir / "straight"));
  ASSERT_EQ(straight.code, 0) << straight.text;
  const auto died = run("DTRAIN_SIMULATE_FAILURE=1:6 " + kDtrain + job + (dir / "died"));
  EXPECT_EQ(died.code, 128 + 9) << died.text;
  EXPECT_TRUE(has(died, "rank 1 (pid")) << died.text;
  EXPECT_TRUE(has(died, "killed by signal 9")) << died.text;
  EXPECT_LT(died.seconds, 30) << died.text;
  const auto restarted = run("DTRAIN_SIMULATE_FAILURE=1:6:1 " + kDtrain + job +
                             (dir / "restarted") + " --max-restarts 1");
  EXPECT_EQ(restarted.code, 0) << restarted.text;
  EXPECT_TRUE(has(restarted, "resumed from step 4")) << restarted.text;
  for (const std::string file : {"state-0-of-2.pt", "state-1-of-2.pt"}) {
    const std::string final_state = "/step-00000016/" + file;
    const std::string expected = file_bytes(dir / "straight" + final_state);
    ASSERT_FALSE(expected.empty()) << file;
    EXPECT_TRUE(file_bytes(dir / "restarted" + final_state) == expected)
        << file << ": the restarted pipeline ended with other weights or optimizer state";
  }
}

// Two nodes (two launchers on 127.0.0.1): a rank dying on one node stops the other node's ranks
// within seconds, both launchers naming the node, rank and signal; a launcher that dies is
// noticed by its heartbeat; a node that never comes is named when the rendezvous times out.
TEST(Launcher, AFailureOnOneNodeStopsEveryNode) {
  const int port = dtrain::free_port();
  auto node = [&](int rank, const std::string& extra, const std::string& program) {
    return kDtrain + " launch --nnodes 2 --nproc-per-node 1 --grace 1 --rdzv-timeout 30 " +
           "--master-port " + std::to_string(port) + " --node-rank " + std::to_string(rank) +
           extra + " -- " + program;
  };
  const std::string killer = "sh -c 'if [ \"$RANK\" = 1 ]; then sleep 1; kill -9 $$; fi; sleep 60'";
  Output first, second;
  std::thread other([&] { second = run(node(1, "", killer)); });
  first = run(node(0, "", killer));
  other.join();
  EXPECT_EQ(first.code, 128 + 9) << first.text;
  EXPECT_TRUE(has(first, "failed: node 1 rank 1 (pid")) << first.text;
  EXPECT_TRUE(has(first, "killed by signal 9")) << first.text;
  EXPECT_LT(first.seconds, 15) << "node 0's rank was not stopped";
  EXPECT_EQ(second.code, 128 + 9) << second.text;

  // Node 1's launcher is SIGKILLed (by its own rank, so after it joined; the rank dies with
  // it): node 0 notices the silence.
  std::thread dying(
      [&] { second = run(node(1, " --heartbeat-timeout 3", "sh -c 'kill -9 $PPID; sleep 60'")); });
  first = run(node(0, " --heartbeat-timeout 3", "sleep 60"));
  dying.join();
  EXPECT_EQ(first.code, 1) << first.text;
  EXPECT_TRUE(has(first, "node 1's launcher stopped responding")) << first.text;
  EXPECT_LT(first.seconds, 15);

  first = run(kDtrain + " launch --nnodes 2 --node-rank 0 --rdzv-timeout 2 --master-port " +
              std::to_string(port) + " -- true");
  EXPECT_EQ(first.code, 1) << first.text;
  EXPECT_TRUE(has(first, "node 1 did not join within 2 s")) << first.text;
}

// `run` throws an InputError whose message holds `fragment`.
template <typename Fn>
void expect_input_error(Fn run, const std::string& fragment) {
  try {
    run();
    ADD_FAILURE() << "no error for " << fragment;
  } catch (const dtrain::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

// Rank discovery reads the process environment: each case sets it, checks, and clears it.
class Discovery : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* name : {"RANK",
                             "WORLD_SIZE",
                             "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE",
                             "MASTER_ADDR",
                             "MASTER_PORT",
                             "SLURM_PROCID",
                             "SLURM_NTASKS",
                             "SLURM_LOCALID",
                             "SLURM_NNODES",
                             "SLURM_JOB_NODELIST",
                             "SLURM_JOB_ID",
                             "SLURM_NTASKS_PER_NODE",
                             "SLURM_STEP_NODELIST",
                             "SLURM_STEP_ID",
                             "SLURM_STEP_TASKS_PER_NODE",
                             "OMPI_COMM_WORLD_RANK",
                             "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK",
                             "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
      ::unsetenv(name);
    }
  }
};

TEST_F(Discovery, TorchrunSlurmOpenMpiAndSingle) {
  auto info = dtrain::launch::discover_rank();
  EXPECT_EQ(info.source, "single");
  EXPECT_EQ(info.world_size, 1);

  ::setenv("SLURM_PROCID", "5", 1);
  ::setenv("SLURM_NTASKS", "8", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  ::setenv("SLURM_NNODES", "2", 1);
  ::setenv("SLURM_JOB_NODELIST", "gpu[07-08]", 1);
  ::setenv("SLURM_JOB_ID", "123", 1);
  // The batch script itself (no step): refused, naming srun.
  expect_input_error([] { dtrain::launch::discover_rank(); }, "start them with srun");
  ::setenv("SLURM_STEP_ID", "0", 1);
  // Over two nodes without --ntasks-per-node: refused, naming the option.
  expect_input_error([] { dtrain::launch::discover_rank(); }, "--ntasks-per-node");
  ::setenv("SLURM_NTASKS_PER_NODE", "4", 1);
  // The first node's name resolves nowhere and no scontrol knows it: named, with the way out.
  expect_input_error([] { dtrain::launch::discover_rank(); },
                     "first node gpu07 (of SLURM_JOB_NODELIST=gpu[07-08]) does not resolve");
  // One that resolves to loopback would have the head listen where node 2 cannot reach.
  ::setenv("SLURM_STEP_NODELIST", "localhost,gpu08", 1);
  expect_input_error([] { dtrain::launch::discover_rank(); }, "resolves to a loopback address");
  ::setenv("MASTER_ADDR", "10.0.0.9", 1);
  info = dtrain::launch::discover_rank();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "10.0.0.9");
  EXPECT_EQ(info.master_port, 20123);
  ::setenv("SLURM_NTASKS_PER_NODE", "3", 1);
  expect_input_error([] { dtrain::launch::discover_rank(); }, "SLURM_NTASKS=8 is not");
  // A step's own count wins over the batch script's (a step of fewer tasks inherits it)...
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)", 1);
  EXPECT_EQ(dtrain::launch::discover_rank().local_world_size, 4);
  // ... and nodes with different counts are refused, naming them.
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "5,3", 1);
  expect_input_error([] { dtrain::launch::discover_rank(); }, "the step runs 5,3 tasks");
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "4(y2)", 1);
  expect_input_error([] { dtrain::launch::discover_rank(); }, "is not N, N(xM) or a list");
  ::unsetenv("SLURM_STEP_TASKS_PER_NODE");
  // One node: its own name (loopback) is where its ranks meet.
  ::unsetenv("MASTER_ADDR");
  ::setenv("SLURM_NNODES", "1", 1);
  ::setenv("SLURM_NTASKS_PER_NODE", "8", 1);
  ::setenv("SLURM_STEP_NODELIST", "localhost", 1);
  EXPECT_EQ(dtrain::launch::discover_rank().master_addr, "localhost");
  TearDown();

  ::setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "10.0.0.1", 1);
  info = dtrain::launch::discover_rank();
  EXPECT_EQ(info.source, "openmpi");
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.master_addr, "10.0.0.1");
  TearDown();

  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_PORT", "4000", 1);
  info = dtrain::launch::discover_rank();
  EXPECT_EQ(info.source, "env");
  EXPECT_EQ(info.master_port, 4000);
  ::setenv("RANK", "two", 1);
  EXPECT_THROW(dtrain::launch::discover_rank(), dtrain::InputError);
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(dtrain::launch::discover_rank(), dtrain::InputError);
}

// Ctrl-C, SIGTERM and SIGUSR1 (Slurm's warning) stop a run after the step it is in, on one
// process or on several ranks: a checkpoint is saved there, the exit code is 128 + the signal,
// the command that resumes it is printed, and the resumed run ends with the uninterrupted run's
// weights and optimizer state, byte for byte. A second signal stops the ranks at once.
TEST(Launcher, AStopOnRequestSavesAndTheResumedRunEqualsAnUninterruptedOne) {
  TempDir dir;
  auto job = [&](int nproc, const std::string& name) {
    return " train --nproc " + std::to_string(nproc) +
           " --threads 1 --dataset synthetic --model mlp --hidden 32 --synthetic-examples 512 "
           "--batch-size 16 --max-steps 40 --log-every 1 --no-progress --checkpoint-dir " +
           (dir / name) + " --metrics " + (dir / name) + ".jsonl";
  };
  struct Case {
    int nproc;
    std::string signal;
    int code;
  };
  for (const Case& c : {Case{1, "INT", 130}, Case{2, "TERM", 143}, Case{2, "USR1", 138}}) {
    const std::string name = "n" + std::to_string(c.nproc) + c.signal;
    const auto straight = run(kDtrain + job(c.nproc, name + "-straight"));
    ASSERT_EQ(straight.code, 0) << straight.text;
    const auto stopped =
        run_and_signal("DTRAIN_SIMULATE_SLOW_STEP_MS=30 " + kDtrain + job(c.nproc, name),
                       dir / name + ".jsonl", c.signal);
    ASSERT_EQ(stopped.code, c.code) << name << ":\n" << stopped.text;
    EXPECT_TRUE(has(stopped, "stopped on request")) << stopped.text;
    EXPECT_TRUE(has(stopped, "checkpoint saved in " + (dir / name))) << stopped.text;
    EXPECT_TRUE(has(stopped, "resume with:\n  " + kDtrain + job(c.nproc, name))) << stopped.text;
    EXPECT_FALSE(has(stopped, "failed")) << stopped.text;
    const auto saved = dtrain::train::latest_checkpoint(dir / name);
    ASSERT_TRUE(saved.has_value()) << stopped.text;
    const int64_t at = dtrain::train::read_meta(*saved).step;
    ASSERT_GT(at, 0);
    ASSERT_LT(at, 40) << "the run was not stopped";
    const auto resumed = run(kDtrain + job(c.nproc, name));
    ASSERT_EQ(resumed.code, 0) << resumed.text;
    EXPECT_TRUE(has(resumed, "resumed from step " + std::to_string(at))) << resumed.text;
    EXPECT_TRUE(has(resumed, "trained " + std::to_string(40 - at) + " steps (steps " +
                                 std::to_string(at + 1) + "-40 of 40, resumed from step " +
                                 std::to_string(at) + ")"))
        << resumed.text;
    const std::string final_state = "/step-00000040/state-0-of-1.pt";
    const std::string expected = file_bytes(dir / (name + "-straight") + final_state);
    ASSERT_FALSE(expected.empty());
    EXPECT_TRUE(file_bytes(dir / name + final_state) == expected)
        << name << ": the resumed run ended with other weights or optimizer state";
  }
  // A second Ctrl-C while the ranks finish a (10 s) step: they are stopped at once.
  const auto twice =
      run_and_signal("DTRAIN_SIMULATE_SLOW_STEP_MS=10000 " + kDtrain + job(2, "twice"),
                     dir / "twice.jsonl", "INT", true);
  EXPECT_EQ(twice.code, 130) << twice.text;
  EXPECT_TRUE(has(twice, "interrupted again (SIGINT): the ranks were stopped at once"))
      << twice.text;
  EXPECT_LT(twice.seconds, 10) << twice.text;
}
