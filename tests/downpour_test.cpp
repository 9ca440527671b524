// Downpour SGD workers (--strategy downpour) against in-process parameter-server shards: one
// worker with n_fetch = n_push = 1 and SGD on the shards is single-process SGD step for step (and
// is not when it fetches less often); the staleness cap makes a worker wait for fresh
// parameters; several workers train one model through the Trainer without stepping together;
// a shard that goes away is an error naming it, within the deadline.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <thread>

#include <filesystem>
#include "RankThreads.h"
#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Loops.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/parallel/ps/PsOptions.h"
#include "dtrain/services/ps/ShardServer.h"
#include "dtrain/train/Trainer.h"

using namespace dtrain;
using namespace dtrain::parallel::ps;
using namespace dtrain::services::ps;
using namespace std::chrono_literals;
using dtrain::test::run_ranks;

namespace {

models::ModelSpec mlp_spec() { return test::small_mlp(16, 32, 4); }

// Shards with `optimizer` at `lr`, on free local ports.
struct Shards {
  std::vector<std::unique_ptr<ShardServer>> servers;
  Shards(int n, const std::string& optimizer, double lr) {
    for (int i = 0; i < n; ++i) {
      ShardServerOptions options;
      options.shard = i;
      options.shards = n;
      options.optimizer.name = optimizer;
      options.optimizer.lr = lr;
      servers.push_back(std::make_unique<ShardServer>(options));
    }
  }
  std::vector<std::string> addresses() const {
    std::vector<std::string> out;
    for (const auto& s : servers) out.push_back(s->address());
    return out;
  }
  int64_t version() const { return servers[0]->shard().version(); }
};

train::TrainerOptions sgd_options() {
  train::TrainerOptions o;
  o.batch_size = 8;
  o.epochs = 1;
  o.max_steps = 15;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.1;
  o.seed = 3;
  o.progress = false;
  return o;
}

struct Outcome {
  train::FitResult fit;
  std::vector<at::Tensor> weights;
};

// `world` workers (rank threads) with `options`, the model in the dataset's dtype; rank 0's
// result and final weights.
Outcome run(int world, const train::TrainerOptions& options, const data::TensorDataset& dataset,
            const data::TensorDataset* validation = nullptr) {
  std::vector<Model> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(11);  // the same initialization as the reference run
    models.push_back(models::make_model(mlp_spec()));
    models.back().module->to(dataset.raw_inputs().scalar_type());
  }
  Outcome out;
  run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        train::Trainer trainer(options, comm);
        auto fit = trainer.fit(models[comm->rank()], dataset, validation);
        if (comm->rank() == 0) {
          out.fit = fit;
          for (const auto& p : trainer.strategy().model().module->parameters()) {
            out.weights.push_back(p.detach().clone());
          }
        }
      },
      60s);
  return out;
}

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

data::TensorDataset synthetic(int64_t n, uint64_t seed) {
  return data::make_synthetic(n, {16}, 4, seed);
}

}  // namespace

// The oracle runs in float64 (the shards then hold float64), so its bound holds on any CPU.
constexpr double kTightBound = 1e-12;

data::TensorDataset in_float64(const data::TensorDataset& d) {
  return data::TensorDataset(d.raw_inputs().to(at::kDouble), d.targets());
}

TEST(Downpour, OneWorkerWithSgdOnTheShardsIsSingleProcessSgdStepForStep) {
  at::set_num_threads(1);
  const auto dataset = in_float64(synthetic(160, 2));
  const Outcome reference = run(1, sgd_options(), dataset);
  ASSERT_EQ(reference.fit.losses.size(), 15u);

  // n_fetch = n_push = 1: every step computes on the parameters its predecessor's push made.
  auto options = sgd_options();
  options.strategy = "downpour";
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().max_staleness = 0;
  {
    Shards shards(2, "sgd", 0.1);
    options.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
    const Outcome downpour = run(1, options, dataset);
    ASSERT_EQ(downpour.fit.losses.size(), reference.fit.losses.size());
    for (size_t i = 0; i < reference.fit.losses.size(); ++i) {
      EXPECT_NEAR(downpour.fit.losses[i], reference.fit.losses[i], kTightBound) << "step " << i + 1;
    }
    EXPECT_LE(max_diff(downpour.weights, reference.weights), kTightBound);
    EXPECT_EQ(shards.version(), 15);
    EXPECT_EQ(shards.servers[0]->shard().dtype(), at::kDouble);
  }
  // The bound notices one step's gradient left out of the pushes (its loss times zero).
  {
    Shards shards(2, "sgd", 0.1);
    auto lossy = options;
    lossy.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
    auto calls = std::make_shared<int>(0);
    lossy.loss = [calls](const at::Tensor& out, const at::Tensor& target) {
      const auto loss = parallel::cross_entropy(out, target);
      return ++*calls == 7 ? loss * 0.0 : loss;
    };
    EXPECT_GT(max_diff(run(1, lossy, dataset).weights, reference.weights), 1e6 * kTightBound);
  }
  // Fetching every 2nd step with the staleness cap at 0 still waits for each push's result...
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().n_fetch = 2;
  {
    Shards shards(2, "sgd", 0.1);
    options.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
    EXPECT_LE(max_diff(run(1, options, dataset).weights, reference.weights), kTightBound);
  }
  // ...and without the cap every 2nd step computes on parameters one update old: the oracle
  // sees it.
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().max_staleness = -1;
  {
    Shards shards(2, "sgd", 0.1);
    options.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
    EXPECT_GT(max_diff(run(1, options, dataset).weights, reference.weights), 1e-4);
  }
}

// A step whose gradient holds NaN (a worker's bug, a flipped bit) is left out of the pushes,
// said and counted; the shared model stays finite and the run is single-process SGD with that
// step's gradient zeroed (the worker's 15 steps make 14 updates).
TEST(Downpour, AStepWhoseGradientIsNotFiniteIsSkippedAndTheShardsStayFinite) {
  at::set_num_threads(1);
  const auto dataset = in_float64(synthetic(160, 2));
  auto zeroed = [](int bad_call, double factor) {
    auto calls = std::make_shared<int>(0);
    return [calls, bad_call, factor](const at::Tensor& out, const at::Tensor& target) {
      const auto loss = parallel::cross_entropy(out, target);
      return ++*calls == bad_call ? loss * factor : loss;
    };
  };
  auto reference_options = sgd_options();
  reference_options.loss = zeroed(7, 0.0);
  const Outcome reference = run(1, reference_options, dataset);

  auto options = sgd_options();
  options.strategy = "downpour";
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().max_staleness = 0;
  options.loss = zeroed(7, std::numeric_limits<double>::quiet_NaN());
  Shards shards(2, "sgd", 0.1);
  options.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
  testing::internal::CaptureStderr();
  const Outcome downpour = run(1, options, dataset);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("downpour worker 0: step 7's non-finite gradient: element "),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("; its update is skipped"), std::string::npos) << said;
  EXPECT_EQ(shards.version(), 14);
  EXPECT_TRUE(std::isnan(downpour.fit.losses.at(6)));
  EXPECT_LE(max_diff(downpour.weights, reference.weights), kTightBound);
  for (const auto& server : shards.servers) {
    EXPECT_TRUE(
        at::isfinite(server->shard().read(server->shard().begin(), server->shard().end(), nullptr))
            .all()
            .item<bool>());
  }
}

TEST(Downpour, TheStalenessCapBoundsTheAgeOfTheParametersAWorkerComputesOn) {
  at::set_num_threads(1);
  const auto dataset = synthetic(64, 4);
  for (int64_t cap : {1, -1}) {
    Shards shards(1, "adagrad", 0.05);
    std::vector<double> ages;
    run_ranks(1, [&](const comm::CommunicatorPtr& comm) {
      parallel::StrategyOptions options;
      options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
      options.of<dtrain::parallel::ps::DownpourOptions>().n_fetch = 5;
      options.of<dtrain::parallel::ps::DownpourOptions>().max_staleness = cap;
      auto strategy = parallel::make_strategy("downpour", options);
      torch::manual_seed(1);
      optim::OptimizerSpec spec;
      strategy->setup(models::make_model(mlp_spec()), optim::optimizer_factory(spec),
                      std::make_shared<comm::ProcessGrid>(comm));
      for (int step = 0; step < 20; ++step) {
        const auto batch = dataset.slice((step % 8) * 8, (step % 8) * 8 + 8);
        auto result = strategy->train_step({batch}, parallel::cross_entropy);
        ages.push_back(result.metrics.at("param_age"));
        std::this_thread::sleep_for(2ms);  // lets the push replies land
      }
      parallel::as_asynchronous(*strategy).finish();
    });
    const double oldest = *std::max_element(ages.begin(), ages.end());
    if (cap >= 0) {
      EXPECT_LE(oldest, static_cast<double>(cap));
    } else {
      EXPECT_GE(oldest, 2.0) << "without a cap, 5 steps between fetches leave the parameters "
                                "several of this worker's own updates behind";
    }
    EXPECT_EQ(shards.version(), 20);
  }
}

TEST(Downpour, WorkersTrainOneModelThroughTheTrainerWithoutSteppingTogether) {
  at::set_num_threads(1);
  const auto dataset = synthetic(320, 5);
  const auto held_out = synthetic(80, 6);
  test::TempDir dir;
  Shards shards(2, "adagrad", 0.05);
  auto options = sgd_options();
  options.strategy = "downpour";
  options.max_steps = 20;  // 20 global steps = 40 worker steps between the two workers
  options.strategy_options.of<dtrain::parallel::ps::PsOptions>().addresses = shards.addresses();
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().n_fetch = 2;
  options.strategy_options.of<dtrain::parallel::ps::DownpourOptions>().n_push = 2;
  options.checkpoint_dir = dir.path();
  options.checkpoint_every = 5;
  const Outcome result = run(2, options, dataset, &held_out);
  // The run ends on the workers' combined budget (each push holds 2 worker steps).
  EXPECT_GE(shards.version() * 2, 40);
  EXPECT_LE(shards.version() * 2, 40 + 2 * 2);
  EXPECT_GE(result.fit.steps, 20);
  ASSERT_TRUE(result.fit.validation.has_value());
  EXPECT_EQ(result.fit.validation->examples, 80);
  EXPECT_LT(result.fit.losses.back(), result.fit.losses.front());
  // Rank 0's model after fit() is the shards' final state.
  PsClient client(shards.addresses());
  at::Tensor flat = at::empty({shards.servers[0]->shard().total()});
  client.pull(flat);
  std::vector<at::Tensor> pieces;
  for (const auto& w : result.weights) pieces.push_back(w.reshape({-1}));
  EXPECT_TRUE(at::equal(at::cat(pieces), flat));
  // A checkpoint for the end of training, written by rank 0 alone, resumable by ddp.
  const std::string latest = dir.path() + "/latest";
  ASSERT_TRUE(std::filesystem::exists(latest));
  auto resume = sgd_options();
  resume.checkpoint_dir = dir.path();
  resume.max_steps = result.fit.steps + 2;
  const Outcome continued = run(2, resume, dataset);
  EXPECT_EQ(continued.fit.start_step, result.fit.steps);
}

TEST(Downpour, AShardThatGoesAwayIsNamedWithinTheDeadline) {
  at::set_num_threads(1);
  const auto dataset = synthetic(64, 7);
  Shards shards(1, "sgd", 0.05);
  const std::string address = shards.addresses()[0];
  run_ranks(1, [&](const comm::CommunicatorPtr& comm) {
    parallel::StrategyOptions options;
    options.of<dtrain::parallel::ps::PsOptions>().addresses = {address};
    options.of<dtrain::parallel::ps::PsOptions>().rpc_timeout_ms = 1000;
    options.of<dtrain::parallel::ps::PsOptions>().retry_ms = 1500;
    auto strategy = parallel::make_strategy("downpour", options);
    optim::OptimizerSpec spec;
    strategy->setup(models::make_model(mlp_spec()), optim::optimizer_factory(spec),
                    std::make_shared<comm::ProcessGrid>(comm));
    for (int step = 0; step < 3; ++step) {
      strategy->train_step({dataset.slice(0, 8)}, parallel::cross_entropy);
    }
    shards.servers[0]->shutdown();
    shards.servers[0].reset();
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    for (int step = 0; step < 50 && error.empty(); ++step) {
      try {
        strategy->train_step({dataset.slice(0, 8)}, parallel::cross_entropy);
        std::this_thread::sleep_for(20ms);
      } catch (const Error& e) {
        error = e.what();
      }
    }
    EXPECT_NE(error.find("parameter server " + address), std::string::npos) << error;
    // Retried for the retry window (the shard might have been restarting), then named.
    EXPECT_NE(error.find("unreachable for 1500 ms"), std::string::npos) << error;
    EXPECT_GE(std::chrono::steady_clock::now() - start, 1500ms);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
    std::printf("%s\n", error.c_str());
  });
}

// A shard that dies and comes back from its checkpoint: the worker retries until it is back,
// notices the restart, reports the updates lost since the checkpoint, and trains on from the
// resumed version (pushes computed on lost versions are accepted as of the resumed one).
TEST(Downpour, AShardRestartedFromItsCheckpointIsRetriedAndItsLostUpdatesReported) {
  at::set_num_threads(1);
  dtrain::test::TempDir dir;
  const auto dataset = synthetic(64, 5);
  ShardServerOptions base;
  base.shards = 2;
  base.optimizer.name = "adagrad";
  base.optimizer.lr = 0.05;
  base.checkpoint_dir = dir.path();
  base.checkpoint_interval_s = 1000;  // saved when the test says (and at shutdown)
  std::vector<std::unique_ptr<ShardServer>> servers;
  for (int i = 0; i < 2; ++i) {
    ShardServerOptions o = base;
    o.shard = i;
    servers.push_back(std::make_unique<ShardServer>(o));
  }
  const std::vector<std::string> addresses = {servers[0]->address(), servers[1]->address()};
  const std::string file = shard_checkpoint_file(dir.path(), 1, 2);
  run_ranks(1, [&](const comm::CommunicatorPtr& comm) {
    parallel::StrategyOptions options;
    options.of<dtrain::parallel::ps::PsOptions>().addresses = addresses;
    options.of<dtrain::parallel::ps::PsOptions>().rpc_timeout_ms = 2000;
    options.of<dtrain::parallel::ps::PsOptions>().retry_ms = 20000;
    options.of<dtrain::parallel::ps::DownpourOptions>().max_staleness =
        0;  // every step waits for its push: versions are exact
    auto strategy = parallel::make_strategy("downpour", options);
    optim::OptimizerSpec spec;
    strategy->setup(models::make_model(mlp_spec()), optim::optimizer_factory(spec),
                    std::make_shared<comm::ProcessGrid>(comm));
    // Waits (bounded) for the last push to land on shard 1.
    auto reach = [&](int64_t version) {
      for (int i = 0; i < 500 && servers[1]->shard().version() < version; ++i) {
        std::this_thread::sleep_for(10ms);
      }
      ASSERT_EQ(servers[1]->shard().version(), version);
    };
    for (int step = 0; step < 5; ++step)
      strategy->train_step({dataset.slice(0, 8)}, parallel::cross_entropy);
    reach(5);
    EXPECT_EQ(servers[1]->save_checkpoint(), 5);
    std::filesystem::copy_file(file, dir / "saved-at-5.pt");
    for (int step = 0; step < 4; ++step)
      strategy->train_step({dataset.slice(0, 8)}, parallel::cross_entropy);
    reach(9);
    // The shard dies as if killed: the state it had since version 5 is gone.
    servers[1].reset();
    std::filesystem::copy_file(dir / "saved-at-5.pt", file,
                               std::filesystem::copy_options::overwrite_existing);
    std::thread restart([&] {
      std::this_thread::sleep_for(700ms);  // the worker retries meanwhile
      ShardServerOptions o = base;
      o.shard = 1;
      o.listen = addresses[1];
      servers[1] = std::make_unique<ShardServer>(o);
    });
    parallel::StepResult result;
    for (int step = 0; step < 4; ++step) {
      result = strategy->train_step({dataset.slice(0, 8)}, parallel::cross_entropy);
    }
    restart.join();
    parallel::as_asynchronous(*strategy).finish();  // every push in
    EXPECT_EQ(servers[1]->resumed_version(), 5);
    EXPECT_EQ(result.metrics.at("ps_lost_updates"), 4.0);  // versions 6..9 of shard 1
    EXPECT_EQ(servers[1]->shard().version(), 5 + 4);       // trained on from the checkpoint
    EXPECT_EQ(servers[0]->shard().version(), 9 + 4);       // the other shard lost nothing
    EXPECT_TRUE(std::isfinite(result.loss));
  });
}
