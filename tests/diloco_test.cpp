// DiLoCo: with H = 1 and an outer SGD at lr 1 without momentum it is DDP (float64, 1e-10), for
// islands of any size and inner ddp, zero1, zero2 or zero3 (whose islands average shard by shard);
// with one island it is its inner strategy; a run checkpointed between outer steps resumes on the
// same trajectory, and its checkpoint resumes as ddp; islands drift apart between outer steps; bad
// options are one-line errors. Streaming DiLoCo (fragments at staggered steps, overlapped
// exchanges, merged) follows a reference of the algorithm written out here, sends one fragment at a
// time and resumes where it saved; the run's last inner steps reach the result through a final
// outer step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "Oracle.h"
#include "SmallModels.h"
#include "TempDir.h"
#include "TrainerRuns.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
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
  for (const std::string inner : {"ddp", "zero1", "zero2", "zero3"}) {
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
// loss is agreed within the island), where DDP's runner allreduces the loss every step; only
// at the outer steps, where the islands meet anyway, one small allreduce asks whether a stop
// was requested (dtrain/train/Stop.h).
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
      if (strategy == "ddp") {
        EXPECT_GE(count, 10);  // the loss, every step
      } else {
        EXPECT_EQ(count, 10 / d.outer_steps);  // the stop checks, at steps 5 and 10
      }
    }
  }
}

// Checkpointed at step 7 with H = 3 (one inner step past an outer step): the resumed run makes
// the uninterrupted one's steps; its checkpoint also resumes as plain ddp (the outer model).
TEST(Diloco, ResumesBetweenOuterStepsOnTheSameTrajectory) {
  at::set_num_threads(1);
  for (const std::string inner : {"ddp", "zero3"}) {  // zero3: islands of shards
    TempDir dir;
    auto options = sgd_options(12);
    options.optimizer.name = "adam";
    options.optimizer.lr = 0.01;
    DilocoOptions d;
    d.inner_strategy = inner;
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
    EXPECT_EQ(resumed.start_step, 7) << inner;
    RunOutput tail = full;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 7);
    expect_same(resumed, tail, 1e-12, inner + ", resumed at step 7");
    // The outer model as a ddp run's start.
    auto as_ddp = sgd_options(12);
    as_ddp.batch_size = 8;  // the checkpoint's global batch of 16 on 2 ranks
    as_ddp.checkpoint_dir = dir.path();
    EXPECT_EQ(test::run_training(2, as_ddp, 5, mlp_spec()).start_step, 12) << inner;
  }
}

namespace {

struct Streaming {
  int fragments = 1, overlap = 0;
  double alpha = 0;
  int64_t steps = 11;  // not a multiple of H: the last inner steps need the final outer step
  std::string compression = "none";  // topk:1 (every value) must give the reference's result
};

constexpr int64_t kH = 4;
constexpr double kOuterLr = 0.7, kOuterMomentum = 0.9, kInnerLr = 0.05;

// Streaming DiLoCo written out (Douillard et al. 2025, with the staggering and overlap this
// project defines) over the parameters flattened into one vector, fragment p being its elements
// [n p / P, n (p + 1) / P) (boundaries cut tensors): 2 islands of one rank train with SGD on their
// own batches; after inner step t, the exchanges that left overlap steps ago are applied, then
// fragment p leaves when t % H == p * H / P, carrying the islands' mean of (outer - island);
// applying it is a Nesterov step of the outer parameters and a merge into each island. At the
// end, those in flight are applied and each fragment with steps since its last exchange makes one
// more. Returns the outer parameters.
std::vector<at::Tensor> reference(const Streaming& s, const models::ModelSpec& spec,
                                  const std::vector<at::Tensor>& init,
                                  const std::vector<std::vector<data::Batch>>& batches) {
  torch::NoGradGuard outside;
  std::vector<Model> islands;
  std::vector<std::unique_ptr<torch::optim::SGD>> inner;
  for (int i = 0; i < 2; ++i) {
    islands.push_back(test::make_model_as(spec, at::kDouble));
    test::restore(islands.back(), init);
    inner.push_back(std::make_unique<torch::optim::SGD>(islands.back().module->parameters(),
                                                        torch::optim::SGDOptions(kInnerLr)));
  }
  auto flat = [](const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> rows;
    for (const auto& t : tensors) rows.push_back(t.reshape({-1}));
    return at::cat(rows);
  };
  auto write = [](Model& island, const at::Tensor& values) {
    int64_t offset = 0;
    for (auto& p : island.module->parameters()) {
      p.copy_(values.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  };
  at::Tensor outer = flat(init), buffer = at::zeros_like(outer);  // momentum starts at g
  const int64_t n = outer.numel(), P = s.fragments;
  auto lo = [&](int64_t p) { return n * p / P; };
  std::vector<int64_t> last_sync(P, 0);
  struct Flight {
    int64_t fragment;
    at::Tensor delta;
    int64_t due;
  };
  std::vector<Flight> flights;
  auto apply = [&](const Flight& f) {
    const int64_t start = lo(f.fragment), length = lo(f.fragment + 1) - start;
    at::Tensor b = buffer.narrow(0, start, length), o = outer.narrow(0, start, length);
    b.mul_(kOuterMomentum).add_(f.delta);
    o.sub_(kOuterLr * (f.delta + kOuterMomentum * b));
    for (auto& island : islands) {
      at::Tensor values = flat(island.module->parameters());
      at::Tensor mine = values.narrow(0, start, length);
      mine.copy_(s.alpha * mine + (1 - s.alpha) * o);
      write(island, values);
    }
  };
  auto leave = [&](int64_t p, int64_t t, int overlap) {
    const int64_t start = lo(p), length = lo(p + 1) - start;
    Flight f{p, at::zeros({length}, at::kDouble), t + overlap};
    for (auto& island : islands) {
      f.delta += (outer.narrow(0, start, length) -
                  flat(island.module->parameters()).narrow(0, start, length)) /
                 2;
    }
    last_sync[p] = t;
    if (overlap == 0) {
      apply(f);
    } else {
      flights.push_back(f);
    }
  };
  for (int64_t t = 1; t <= s.steps; ++t) {
    for (int i = 0; i < 2; ++i) {
      torch::AutoGradMode grad(true);
      inner[i]->zero_grad();
      const data::Batch& b = batches[i][t - 1];
      parallel::cross_entropy(islands[i](b.inputs), b.targets).backward();
      inner[i]->step();
    }
    for (auto it = flights.begin(); it != flights.end();) {
      if (it->due > t) {
        ++it;
        continue;
      }
      apply(*it);
      it = flights.erase(it);
    }
    for (int64_t p = 0; p < P; ++p) {
      if (t % kH == p * kH / P) leave(p, t, s.overlap);
    }
  }
  for (const auto& f : flights) apply(f);
  for (int64_t p = 0; p < P; ++p) {
    if (last_sync[p] != s.steps) leave(p, s.steps, 0);
  }
  std::vector<at::Tensor> result;
  int64_t offset = 0;
  for (const auto& t : init) {
    result.push_back(outer.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return result;
}

// The strategy over 2 ranks (islands of one), driven step by step on the same batches.
std::vector<at::Tensor> streamed(const Streaming& s, const models::ModelSpec& spec,
                                 const std::vector<at::Tensor>& init,
                                 const std::vector<std::vector<data::Batch>>& batches,
                                 std::vector<double>* outer_bytes = nullptr) {
  std::vector<at::Tensor> result;
  test::run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    parallel::StrategyOptions options;
    auto& d = options.of<DilocoOptions>();
    d.island_size = 1;
    d.outer_steps = kH;
    d.outer_lr = kOuterLr;
    d.outer_momentum = kOuterMomentum;
    d.fragments = s.fragments;
    d.overlap_steps = s.overlap;
    d.merge_alpha = s.alpha;
    d.outer_compression = s.compression;
    auto strategy = parallel::make_strategy("diloco", options);
    optim::OptimizerSpec sgd;
    sgd.name = "sgd";
    sgd.lr = kInnerLr;
    Model model = test::make_model_as(spec, at::kDouble);
    test::restore(model, init);
    strategy->setup(model, optim::optimizer_factory(sgd),
                    std::make_shared<comm::ProcessGrid>(comm));
    parallel::StepResult last;
    for (int64_t t = 1; t <= s.steps; ++t) {
      last = strategy->train_step({batches[comm->rank()][t - 1]}, parallel::cross_entropy);
      if (t == s.steps) strategy->finish_training(last);
      if (outer_bytes && comm->rank() == 0) outer_bytes->push_back(last.metrics["outer_bytes"]);
    }
    strategy->materialize();
    if (comm->rank() == 0) result = test::snapshot(strategy->model());
  });
  return result;
}

std::vector<std::vector<data::Batch>> island_batches(int64_t steps, int64_t features) {
  torch::manual_seed(17);
  std::vector<std::vector<data::Batch>> batches(2);
  for (auto& island : batches) {
    for (int64_t t = 0; t < steps; ++t) {
      island.push_back({at::randn({8, features}, at::kDouble), at::randint(0, 4, {8}, at::kLong)});
    }
  }
  return batches;
}

}  // namespace

// DiLoCo (one fragment), and streaming with overlap and merging, against the reference: the
// same outer parameters after 11 steps at H = 4 (the last 3 only through the final outer step).
// Shown failing: with finish_training a no-op every case differs; with the merge a plain copy,
// the alpha 0.5 cases; with fragments of whole tensors (before they cut tensors), every case of
// more than one fragment. (The topk:1 case with overlap was refused before session #12.)
TEST(Diloco, StreamingFollowsTheReferenceAlgorithm) {
  at::set_num_threads(1);
  // Tensors of 512, 32, 128 and 4 elements (676): 2 fragments cut w1 at 338; 3 are 225, 225 and
  // 226 elements; 4 cut w1 three times, the last holding its end and b1, w2, b2.
  torch::manual_seed(5);
  const models::ModelSpec spec = mlp_spec();
  const auto init = test::snapshot(test::make_model_as(spec, at::kDouble));
  const auto batches = island_batches(12, 16);
  const std::vector<Streaming> cases = {
      {1, 0, 0.0},
      {2, 1, 0.5},
      {3, 2, 0.5},
      {4, 3, 0.0},
      {2, 0, 0.0, 12},
      {3, 2, 0.5, 11, "topk:1"}};  // compressed exchanges overlap the inner steps too
  for (const auto& s : cases) {
    const std::string what = "fragments " + std::to_string(s.fragments) + ", overlap " +
                             std::to_string(s.overlap) + ", alpha " + std::to_string(s.alpha) +
                             ", " + std::to_string(s.steps) + " steps, " + s.compression;
    const auto expected = reference(s, spec, init, batches);
    const auto got = streamed(s, spec, init, batches);
    ASSERT_EQ(got.size(), expected.size()) << what;
    EXPECT_LT(test::max_abs_diff(got, expected), test::kTightBound) << what;
    EXPECT_GT(test::max_abs_diff(got, init), 1e-3) << what;  // it moved
  }
}

// Each exchange carries one fragment: over H steps the fragments together send the model once
// (as DiLoCo does at one step), each step an equal share of it.
TEST(Diloco, StreamingSendsOneFragmentAtATime) {
  at::set_num_threads(1);
  models::ModelSpec spec = test::small_mlp(16, 24, 4);
  spec.hidden = {24, 24, 24, 24};  // 384 + 24, 3 x (576 + 24), 96 + 4 elements
  torch::manual_seed(5);
  const auto init = test::snapshot(test::make_model_as(spec, at::kDouble));
  const auto batches = island_batches(9, 16);
  const int64_t model_bytes = (384 + 24 + 3 * 600 + 100) * 8;
  std::map<int, std::vector<int64_t>> sent;  // per step
  for (int fragments : {1, 4}) {
    Streaming s;
    s.fragments = fragments;
    s.overlap = fragments == 4 ? 1 : 0;
    s.steps = 9;  // the 9th: the final outer step sends what is left
    std::vector<double> cumulative;
    streamed(s, spec, init, batches, &cumulative);
    double before = 0;
    for (double c : cumulative)
      sent[fragments].push_back(static_cast<int64_t>(c - before)), before = c;
  }
  // DiLoCo: the whole model at steps 4 and 8, and at the end.
  EXPECT_EQ(sent[1],
            (std::vector<int64_t>{0, 0, 0, model_bytes, 0, 0, 0, model_bytes, model_bytes}));
  // 4 fragments of 577 elements each (phases 0..3; they cut tensors): a quarter of the model a
  // step, the model every 4 steps.
  for (int t = 0; t < 8; ++t) EXPECT_EQ(sent[4][t], model_bytes / 4) << "step " << t + 1;
  // The end: the 3 fragments with steps since their exchange (the 4th left at step 9).
  EXPECT_EQ(sent[4][8], model_bytes);
}

// Checkpointed at step 6 with 2 fragments and an exchange in flight (left at 6, due at 7): the
// save applies it, and the resumed run continues as the run that saved there does; inner ddp
// (the fragments cut the first weight matrix, so the checkpoint holds runs of it) and zero3 (the
// fragments are shares of each rank's shards), each also with top-k outer gradients (their
// residuals resume; shown failing when they are not restored). The checkpoint also starts a
// plain ddp run.
TEST(Diloco, StreamingResumesWhereItSaved) {
  at::set_num_threads(1);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ddp", "none"}, {"zero3", "none"}, {"ddp", "topk:0.3"}, {"zero3", "topk:0.3"}};
  for (const auto& [inner, compression] : cases) {
    TempDir saving, resuming;
    auto options = sgd_options(12);
    DilocoOptions d;
    d.inner_strategy = inner;
    d.outer_compression = compression;  // top-k: each rank's residuals resume with it
    d.island_size = 2;
    d.outer_steps = 4;
    d.fragments = 2;
    d.overlap_steps = 1;
    d.merge_alpha = 0.5;
    options = diloco(options, d);
    options.checkpoint_every = 6;
    auto through = options;
    through.checkpoint_dir = saving.path();
    const RunOutput full = test::run_training(4, through, 1, mlp_spec());
    auto first = options;
    first.checkpoint_dir = resuming.path();
    first.stop_at_step = 6;
    test::run_training(4, first, 1, mlp_spec());
    auto second = options;
    second.checkpoint_dir = resuming.path();
    const RunOutput resumed = test::run_training(4, second, 999, mlp_spec());
    EXPECT_EQ(resumed.start_step, 6) << inner;
    RunOutput tail = full;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 6);
    expect_same(resumed, tail, 1e-12,
                "streaming over " + inner + ", " + compression + ", resumed at step 6");
    auto as_ddp = sgd_options(12);
    as_ddp.batch_size = 8;  // the checkpoint's global batch of 16 on 2 ranks
    as_ddp.checkpoint_dir = saving.path();
    EXPECT_EQ(test::run_training(2, as_ddp, 5, mlp_spec()).start_step, 12) << inner;
  }
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
  expect_error(d,
               "--inner-strategy must be a synchronous data-parallel strategy (ddp, zero1, zero2 "
               "or zero3), got 'downpour'");
  d = {};
  d.outer_optimizer = "lamb";
  expect_error(d, "--outer-optimizer must be nesterov, sgd or adam, got 'lamb'");
  d = {};
  d.outer_momentum = 0;
  expect_error(d, "--outer-optimizer nesterov needs --outer-momentum > 0");
  d = {};
  d.outer_compression = "zip";
  expect_error(d, "--outer-compression 'zip': expected none, q8 or topk:FRACTION");
  d = {};
  d.fragments = 0;
  expect_error(d, "--streaming-fragments must be >= 1, got 0");
  d = {};
  d.overlap_steps = 50;
  expect_error(d, "--overlap-steps must be in [0, --outer-steps 50), got 50");
  d = {};
  d.merge_alpha = 1;
  expect_error(d, "--merge-alpha must be in [0, 1), got 1");
  // More fragments than elements (refused at setup, when the model is known).
  d = {};
  d.fragments = 1000;
  try {
    test::run_training(2, diloco(sgd_options(2), d), 1, mlp_spec());
    ADD_FAILURE() << "1000 fragments of 676 elements accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "--streaming-fragments 1000 exceeds the model's 676 trainable elements"),
              std::string::npos)
        << e.what();
  }
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
