// ZeRO-1 and ZeRO-2: train to the same weights as single-process / DDP training (Adam, parameter
// counts that do not divide by N, accumulation, clipping), hold the ZeRO formulas' memory, and
// save and resume their sharded optimizer state.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "Oracle.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/ZeroStrategy.h"

using namespace dtrain;
using namespace dtrain::test;

namespace {

models::ModelSpec odd_mlp() {  // 144*7 + 7 + 7*10 + 10 = 1095 parameters: odd
  models::ModelSpec spec;
  spec.name = "mlp";
  spec.input_shape = {1, 12, 12};
  spec.hidden = {7};
  return spec;
}

optim::OptimizerSpec adam() {
  optim::OptimizerSpec spec;
  spec.name = "adam";
  spec.lr = 0.01;
  spec.weight_decay = 1e-4;
  return spec;
}

}  // namespace

class ZeroEquivalence : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroEquivalence, MatchesSingleProcessAdam) {
  at::set_num_threads(1);
  const auto [stage, world] = GetParam();
  auto f = make_fixture(odd_mlp(), adam(), 20);
  const auto expected = train_single(f, 20);
  const auto got = train_distributed(f, world, 20, [stage = stage] {
    return std::make_unique<parallel::ZeroStrategy>(parallel::StrategyOptions{}, stage);
  });
  EXPECT_GT(max_abs_diff(expected, f.initial), 1e-2) << "training did not move the weights";
  EXPECT_LE(max_abs_diff(expected, got), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(StagesAndWorlds, ZeroEquivalence,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(2, 4)));

TEST(Zero, MatchesDdpWithAccumulationAndGlobalNormClipping) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_mlp(), adam(), 10);
  parallel::StrategyOptions options;
  options.max_grad_norm = 0.05;  // small enough to clip every step
  const auto ddp = train_distributed(
      f, 2, 10, [&] { return std::make_unique<parallel::DdpStrategy>(options); }, 2);
  for (int stage : {1, 2}) {  // stage 2: the norm is summed over gradient shards
    const auto zero = train_distributed(
        f, 2, 10, [&] { return std::make_unique<parallel::ZeroStrategy>(options, stage); }, 2);
    EXPECT_LE(max_abs_diff(ddp, zero), 1e-5) << "stage " << stage;
  }
}

TEST(Zero1, MemoryReportFollowsTheZeroFormula) {
  at::set_num_threads(1);
  for (int world : {2, 4}) {
    run_ranks(world, [world](const comm::CommunicatorPtr& comm) {
      auto grid = std::make_shared<comm::ProcessGrid>(comm);
      torch::manual_seed(1);
      parallel::ZeroStrategy zero({});
      zero.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      data::Batch batch{torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})};
      zero.train_step({batch}, parallel::cross_entropy);  // Adam allocates its state
      const int64_t p = 1095;
      const int64_t shard = (p + world - 1) / world;
      const int64_t mine = std::min(p, (comm->rank() + 1) * shard) - comm->rank() * shard;
      const auto report = zero.memory_report();
      EXPECT_EQ(report.parameter_bytes, 4 * shard * world);  // 4P + padding
      EXPECT_EQ(report.gradient_bytes, 4 * p);                // 4P
      EXPECT_EQ(report.optimizer_bytes, 8 * mine);            // 8P/N (the last shard is short)

      parallel::ZeroStrategy zero2({}, 2);
      zero2.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      zero2.train_step({batch}, parallel::cross_entropy);
      const auto report2 = zero2.memory_report();
      EXPECT_EQ(report2.parameter_bytes, 4 * shard * world);  // 4P + padding
      EXPECT_EQ(report2.gradient_bytes, 4 * shard);           // 4P/N (+ padding)
      EXPECT_EQ(report2.optimizer_bytes, 8 * mine);           // 8P/N
      for (const auto& p : zero2.model().module->parameters()) {
        EXPECT_FALSE(p.grad().defined()) << "a full gradient outlived its reduce-scatter";
      }

      parallel::DdpStrategy ddp({});
      ddp.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      ddp.train_step({batch}, parallel::cross_entropy);
      EXPECT_EQ(ddp.memory_report().optimizer_bytes, 8 * p);  // every rank holds all of it
    });
  }
}

TEST(Zero1, SavesAndResumesItsShards) {
  at::set_num_threads(1);
  const std::string dir = ::testing::TempDir() + "/dtrain-zero1-ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  torch::manual_seed(2);
  std::vector<data::Batch> batches;
  for (int i = 0; i < 6; ++i) {
    batches.push_back({torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})});
  }
  std::vector<Model> models;
  for (int i = 0; i < 4; ++i) {
    torch::manual_seed(3 + i);
    models.push_back(models::make_model(odd_mlp()));
  }
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    auto grid = std::make_shared<comm::ProcessGrid>(comm);
    const int r = comm->rank();
    parallel::ZeroStrategy straight({});
    straight.setup(models[r], optim::optimizer_factory(adam()), grid);
    parallel::ZeroStrategy first({});
    first.setup(models[2 + r], optim::optimizer_factory(adam()), grid);
    {
      torch::NoGradGuard no_grad;  // same start for both
      auto a = straight.model().module->parameters();
      auto b = first.model().module->parameters();
      for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
    }
    for (int i = 0; i < 3; ++i) {
      straight.train_step({batches[i]}, parallel::cross_entropy);
      first.train_step({batches[i]}, parallel::cross_entropy);
    }
    comm->barrier()->wait();
    first.save(dir);
    comm->barrier()->wait();
    torch::manual_seed(99);
    parallel::ZeroStrategy resumed({});
    resumed.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
    resumed.load(dir);
    for (int i = 3; i < 6; ++i) {
      straight.train_step({batches[i]}, parallel::cross_entropy);
      resumed.train_step({batches[i]}, parallel::cross_entropy);
    }
    EXPECT_LE(max_abs_diff(snapshot(straight.model()), snapshot(resumed.model())), 1e-6);
  });
  // Another world size: the missing shard is named.
  run_ranks(4, [&](const comm::CommunicatorPtr& comm) {
    parallel::ZeroStrategy other({});
    other.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()),
                std::make_shared<comm::ProcessGrid>(comm));
    try {
      other.load(dir);
      ADD_FAILURE() << "loaded 2-rank shards into 4 ranks";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer-shard"), std::string::npos) << e.what();
    }
  });
  std::filesystem::remove_all(dir);
}

TEST(Zero, MixedPrecisionMatchesDdpAndPureBf16IsRefused) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_mlp(), adam(), 8);
  parallel::StrategyOptions mixed;
  mixed.precision = "bf16-mixed";
  const auto ddp = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::DdpStrategy>(mixed); });
  const auto zero2 = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::ZeroStrategy>(mixed, 2); });
  EXPECT_LE(max_abs_diff(ddp, zero2), 1e-5);
  const auto zero = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::ZeroStrategy>(mixed); });
  EXPECT_LE(max_abs_diff(ddp, zero), 1e-5);
  const auto fp32 = train_distributed(
      f, 2, 8, [] { return std::make_unique<parallel::ZeroStrategy>(parallel::StrategyOptions{}); });
  EXPECT_GT(max_abs_diff(fp32, zero), 0.0) << "bf16-mixed changed nothing: autocast not applied?";
  EXPECT_THROW(parallel::ZeroStrategy({.precision = "bf16"}), InputError);
}
