// DiLoCo: with H = 1 and an outer SGD at lr 1 without momentum it is DDP (float64, 1e-10), for
// islands of any size and inner ddp or zero1; with one island it is its inner strategy; a run
// checkpointed between outer steps resumes on the same trajectory, and its checkpoint resumes
// as ddp; islands drift apart between outer steps; bad options are one-line errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "SmallModels.h"
#include "TempDir.h"
#include "TrainerRuns.h"
#include "dtrain/parallel/Registry.h"
#include "dtrain/parallel/diloco/DilocoOptions.h"
#include "dtrain/train/Checkpoint.h"

using namespace dtrain;
using dtrain::parallel::diloco::DilocoOptions;
using dtrain::test::RunOutput;
using dtrain::test::TempDir;

namespace {

models::ModelSpec mlp_spec() { return test::small_mlp(16, 32, 4); }

train::TrainerOptions sgd_options(int64_t steps) {
  train::TrainerOptions o;
  o.batch_size = 4;
  o.epochs = 3;  // 10 steps an epoch at 4 ranks
  o.max_steps = steps;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.05;
  o.optimizer.momentum = 0.9;  // per-island momentum: still linear in the gradients
  o.seed = 3;
  o.progress = false;
  return o;
}

train::TrainerOptions diloco(train::TrainerOptions o, const DilocoOptions& d) {
  o.strategy = "diloco";
  o.strategy_options.of<DilocoOptions>() = d;
  return o;
}

// The same weights (and, with `losses`, the same reported losses: DiLoCo reports its island's
// mean, DDP the world's).
void expect_same(const RunOutput& a, const RunOutput& b, double bound, const std::string& what,
                 bool losses = true) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; losses && i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], bound * std::abs(b.losses[i])) << what << ", step " << i;
  }
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  for (size_t i = 0; i < a.weights.size(); ++i) {
    EXPECT_LE((a.weights[i] - b.weights[i]).abs().max().item<double>(), bound) << what;
  }
}

}  // namespace

// The islands' mean parameter change applied at lr 1 is the mean of their SGD updates: the
// update of the averaged gradient.
TEST(Diloco, OneStepOuterSgdAtLrOneIsDdp) {
  at::set_num_threads(1);
  const RunOutput ddp = test::run_training(4, sgd_options(12), 1, mlp_spec());
  for (const std::string inner : {"ddp", "zero1"}) {
    for (int island : {1, 2}) {
      DilocoOptions d;
      d.inner_strategy = inner;
      d.island_size = island;
      d.outer_steps = 1;
      d.outer_optimizer = "sgd";
      d.outer_lr = 1.0;
      d.outer_momentum = 0.0;
      const RunOutput run = test::run_training(4, diloco(sgd_options(12), d), 1, mlp_spec());
      expect_same(run, ddp, 1e-10, inner + ", islands of " + std::to_string(island),
                  /*losses=*/false);
    }
  }
}

// Compressed outer gradients: top-k keeping every element sends the exact gradient (DDP again);
// 8-bit quantization sends a quarter of the bytes and still learns.
TEST(Diloco, CompressedOuterGradients) {
  at::set_num_threads(1);
  const RunOutput ddp = test::run_training(4, sgd_options(10), 1, mlp_spec());
  DilocoOptions d;
  d.island_size = 1;
  d.outer_steps = 1;
  d.outer_optimizer = "sgd";
  d.outer_lr = 1.0;
  d.outer_momentum = 0.0;
  d.outer_compression = "topk:1";
  for (int island : {1, 2}) {  // islands of 2: each rank sends half (its slice) across
    d.island_size = island;
    expect_same(test::run_training(4, diloco(sgd_options(10), d), 1, mlp_spec()), ddp, 1e-10,
                "topk:1, islands of " + std::to_string(island), /*losses=*/false);
  }
  d.island_size = 1;
  d.outer_compression = "q8";
  const RunOutput q8 = test::run_training(4, diloco(sgd_options(10), d), 1, mlp_spec());
  double largest = 0;
  for (size_t i = 0; i < q8.weights.size(); ++i) {
    largest = std::max(largest, (q8.weights[i] - ddp.weights[i]).abs().max().item<double>());
  }
  EXPECT_GT(largest, 0.0);   // quantized: not exact
  EXPECT_LT(largest, 0.05);  // but close to DDP's after 10 steps
  EXPECT_LT(q8.losses.back(), q8.losses.front());
}

// One island: the outer step at lr 1 only restates the island's parameters, whatever H.
TEST(Diloco, OneIslandIsItsInnerStrategy) {
  at::set_num_threads(1);
  auto options = sgd_options(12);  // 3 outer steps: the result is the island's own
  options.optimizer.name = "adam";
  options.optimizer.lr = 0.01;
  const RunOutput inner = test::run_training(2, options, 1, mlp_spec());
  DilocoOptions d;
  d.island_size = 2;
  d.outer_steps = 4;
  d.outer_optimizer = "sgd";
  d.outer_lr = 1.0;
  d.outer_momentum = 0.0;
  expect_same(test::run_training(2, diloco(options, d), 1, mlp_spec()), inner, 1e-10,
              "one island of 2");
}

// Between outer steps the islands train apart: with H = 5 and the default Nesterov outer
// optimizer the run is not DDP's, yet it learns.
TEST(Diloco, IslandsTrainApartBetweenOuterSteps) {
  at::set_num_threads(1);
  const RunOutput ddp = test::run_training(4, sgd_options(20), 1, mlp_spec());
  DilocoOptions d;
  d.island_size = 1;
  d.outer_steps = 5;
  const RunOutput run = test::run_training(4, diloco(sgd_options(20), d), 1, mlp_spec());
  ASSERT_EQ(run.losses.size(), 20u);
  double differs = 0;
  for (size_t i = 0; i < run.weights.size(); ++i) {
    differs = std::max(differs, (run.weights[i] - ddp.weights[i]).abs().max().item<double>());
  }
  EXPECT_GT(differs, 1e-6);
  EXPECT_LT(run.losses.back(), 0.8 * run.losses.front());
}

// No step waits on the link between islands: the world sees no per-step collective (each step's
// loss is agreed within the island), where DDP's runner allreduces the loss every step.
TEST(Diloco, IslandsMeetOnlyAtOuterSteps) {
  at::set_num_threads(1);
  const auto data = data::make_synthetic(160, {16}, 4, 2);
  const data::TensorDataset dataset(data.raw_inputs().to(at::kDouble), data.targets());
  for (const std::string strategy : {"ddp", "diloco"}) {
    DilocoOptions d;
    d.island_size = 1;
    d.outer_steps = 5;
    auto options = strategy == "ddp" ? sgd_options(10) : diloco(sgd_options(10), d);
    std::vector<int64_t> world_allreduces(2, -1);
    test::run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
      train::Trainer trainer(options, comm);
      torch::manual_seed(1);
      Model model = models::make_model(mlp_spec());
      model.module->to(at::kDouble);
      comm->reset_tally();
      trainer.fit(model, dataset);
      world_allreduces[comm->rank()] = comm->tally()["allreduce"].count;
    });
    for (int64_t count : world_allreduces) {
      if (strategy == "ddp") EXPECT_GE(count, 10);  // the loss, every step
      if (strategy == "diloco") EXPECT_EQ(count, 0);
    }
  }
}

// Checkpointed at step 7 with H = 3 (one inner step past an outer step): the resumed run makes
// the uninterrupted one's steps; its checkpoint also resumes as plain ddp (the outer model).
TEST(Diloco, ResumesBetweenOuterStepsOnTheSameTrajectory) {
  at::set_num_threads(1);
  TempDir dir;
  auto options = sgd_options(12);
  options.optimizer.name = "adam";
  options.optimizer.lr = 0.01;
  DilocoOptions d;
  d.island_size = 2;
  d.outer_steps = 3;
  options = diloco(options, d);
  const RunOutput full = test::run_training(4, options, 1, mlp_spec());
  options.checkpoint_dir = dir.path();
  options.checkpoint_every = 7;
  auto first = options;
  first.stop_at_step = 7;
  test::run_training(4, first, 1, mlp_spec());
  EXPECT_EQ(train::read_meta(dir / "step-00000007").strategy, "diloco");
  const RunOutput resumed = test::run_training(4, options, 999, mlp_spec());
  EXPECT_EQ(resumed.start_step, 7);
  RunOutput tail = full;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 7);
  expect_same(resumed, tail, 1e-12, "resumed at step 7");
  // The outer model as a ddp run's start.
  auto as_ddp = sgd_options(12);
  as_ddp.batch_size = 8;  // the checkpoint's global batch of 16 on 2 ranks
  as_ddp.checkpoint_dir = dir.path();
  EXPECT_EQ(test::run_training(2, as_ddp, 5, mlp_spec()).start_step, 12);
}

TEST(Diloco, BadOptionsAreOneLineErrors) {
  auto expect_error = [](const DilocoOptions& d, const std::string& message) {
    parallel::StrategyOptions options;
    options.of<DilocoOptions>() = d;
    try {
      parallel::make_strategy("diloco", options);
      ADD_FAILURE() << "accepted: " << message;
    } catch (const InputError& e) {
      EXPECT_NE(e.message().find(message), std::string::npos) << e.message();
      EXPECT_EQ(e.message().find('\n'), std::string::npos) << e.message();
    }
  };
  DilocoOptions d;
  d.outer_steps = 0;
  expect_error(d, "--outer-steps must be >= 1, got 0");
  d = {};
  d.inner_strategy = "downpour";
  expect_error(d, "--inner-strategy must be a synchronous strategy");
  d = {};
  d.outer_optimizer = "lamb";
  expect_error(d, "--outer-optimizer must be nesterov, sgd or adam, got 'lamb'");
  d = {};
  d.outer_momentum = 0;
  expect_error(d, "--outer-optimizer nesterov needs --outer-momentum > 0");
  d = {};
  d.outer_compression = "zip";
  expect_error(d, "--outer-compression 'zip': expected none, q8 or topk:FRACTION");
  // Islands that do not divide the ranks: refused by every rank at setup.
  d = {};
  d.island_size = 3;
  try {
    test::run_training(2, diloco(sgd_options(2), d), 1, mlp_spec());
    ADD_FAILURE() << "islands of 3 over 2 ranks accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--island-size 3 does not divide the 2 ranks"),
              std::string::npos)
        << e.what();
  }
}
