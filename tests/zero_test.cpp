// ZeRO-1, 2 and 3: train to the same weights as single-process / DDP training (Adam, parameter
// counts that do not divide by N, accumulation, clipping, mixed precision), hold the ZeRO
// formulas' memory, and save sharded checkpoints that load into other strategies and world
// sizes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <numeric>

#include "Oracle.h"
#include "RankThreads.h"
#include "TempDir.h"
#include "dtrain/parallel/ddp/Buckets.h"
#include "dtrain/parallel/zero/Zero3Options.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"
#include "dtrain/parallel/zero/ZeroQuantizedOptions.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/Zero3Strategy.h"
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

// 144*7+7 + 7*5+5 + 5*10+10 = 1115 parameters in three stages, none divisible by 2 or 4.
models::ModelSpec odd_deep_mlp() {
  auto spec = odd_mlp();
  spec.hidden = {7, 5};
  return spec;
}

parallel::StrategyPtr make_zero(int stage, const parallel::StrategyOptions& options = {}) {
  if (stage == 3) return std::make_unique<parallel::zero::Zero3Strategy>(options);
  return std::make_unique<parallel::zero::ZeroStrategy>(options, stage);
}

// ZeRO-`stage` with `options` trained 3 steps, saved, loaded into a fresh strategy and trained 3
// more steps ends where 6 uninterrupted steps end (checkpoints in TempDir()/`name`); every step
// reports how long it waited for the parameter gathers.
void saves_and_resumes(int stage, const parallel::StrategyOptions& options,
                       const std::string& name) {
  at::set_num_threads(1);
  const std::string dir = ::testing::TempDir() + "/" + name;
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
    models.push_back(models::make_model(odd_deep_mlp()));
  }
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    auto grid = std::make_shared<comm::ProcessGrid>(comm);
    const int r = comm->rank();
    parallel::zero::ZeroStrategy straight(options, stage);
    straight.setup(models[r], optim::optimizer_factory(adam()), grid);
    parallel::zero::ZeroStrategy first(options, stage);
    first.setup(models[2 + r], optim::optimizer_factory(adam()), grid);
    {
      torch::NoGradGuard no_grad;  // same start for both
      auto a = straight.model().module->parameters();
      auto b = first.model().module->parameters();
      for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
    }
    for (int i = 0; i < 3; ++i) {
      straight.train_step({batches[i]}, parallel::cross_entropy);
      const auto result = first.train_step({batches[i]}, parallel::cross_entropy);
      EXPECT_GE(result.metrics.at("param_gather_wait_ms"), 0.0);
    }
    comm->barrier()->wait();
    first.save(dir);
    comm->barrier()->wait();
    torch::manual_seed(99);
    parallel::zero::ZeroStrategy resumed(options, stage);
    resumed.setup(models::make_model(odd_deep_mlp()), optim::optimizer_factory(adam()), grid);
    resumed.load(dir);
    for (int i = 3; i < 6; ++i) {
      straight.train_step({batches[i]}, parallel::cross_entropy);
      resumed.train_step({batches[i]}, parallel::cross_entropy);
    }
    EXPECT_LE(max_abs_diff(snapshot(straight.model()), snapshot(resumed.model())), 1e-6);
  });
  std::filesystem::remove_all(dir);
}

}  // namespace

class ZeroEquivalence : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZeroEquivalence, MatchesSingleProcessAdam) {
  at::set_num_threads(1);
  const auto [stage, world] = GetParam();
  auto f = make_fixture(odd_deep_mlp(), adam(), 20);
  const auto expected = train_single(f, 20);
  const auto got = train_distributed(f, world, 20, [stage = stage] { return make_zero(stage); });
  EXPECT_GT(max_abs_diff(expected, f.initial), 1e-2) << "training did not move the weights";
  EXPECT_LE(max_abs_diff(expected, got), kTightBound);
  // ... and the bound notices one rank's gradient left out of the reduction.
  const auto lost = train_distributed(
      f, world, 4, [stage = stage] { return make_zero(stage); }, 1,
      [](const comm::CommunicatorPtr& c) { return drop_rank_gradient(0, c); });
  EXPECT_GT(max_abs_diff(train_single(f, 4), lost), 1e6 * kTightBound);
}

INSTANTIATE_TEST_SUITE_P(StagesAndWorlds, ZeroEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(2, 4)));

// --zero-quantized (ZeRO++'s qgZ, and qwZ for zero3): with the quantization turned to identity the
// same exchanges (all-to-all reduce-scatter, packed allgather) train to the oracle's weights; with
// int8 blocks training stays close but not equal (applied), and each step sends >= 3.5x fewer
// bytes.
TEST(Zero, QuantizedCollectivesAtIdentityEqualTheOracleAndInt8SendsFewerBytes) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_deep_mlp(), adam(), 10);
  const auto expected = train_single(f, 10);
  auto loss_of = [&f](const std::vector<at::Tensor>& weights) {
    Model model = make_model_as(f.spec, f.dtype);
    restore(model, weights);
    const data::Batch all = f.dataset.get(std::vector<int64_t>([&] {
      std::vector<int64_t> i(f.dataset.size());
      std::iota(i.begin(), i.end(), 0);
      return i;
    }()));
    torch::NoGradGuard no_grad;
    return parallel::cross_entropy(model.forward(all.inputs), all.targets).item<double>();
  };
  for (int stage : {2, 3}) {
    for (int world : {2, 4}) {
      SCOPED_TRACE(concat("zero", stage, " world ", world));
      parallel::StrategyOptions identity;
      identity.of<parallel::zero::ZeroQuantizedOptions>() = {true, 256, /*identity=*/true};
      EXPECT_LE(
          max_abs_diff(expected,
                       train_distributed(f, world, 10, [&] { return make_zero(stage, identity); })),
          kTightBound);
      parallel::StrategyOptions int8;
      int8.of<parallel::zero::ZeroQuantizedOptions>() = {true, 32};
      const auto got = train_distributed(f, world, 10, [&] { return make_zero(stage, int8); });
      EXPECT_GT(max_abs_diff(expected, got), 1e-8) << "int8 changed nothing: not applied?";
      // The loss on the training set falls as far (within 5%) as exact training's.
      const double start = loss_of(f.initial), exact = loss_of(expected);
      EXPECT_NEAR(loss_of(got), exact, 0.05 * (start - exact));
    }
  }
  // Bytes per step of a larger model (units of ~10k parameters), as the world's count has them.
  models::ModelSpec spec = odd_mlp();
  spec.hidden = {64, 64};
  auto g = make_fixture(spec, adam(), 2);
  for (int stage : {2, 3}) {
    std::map<bool, int64_t> sent;
    for (bool quantized : {false, true}) {
      parallel::StrategyOptions options;
      options.of<parallel::zero::ZeroQuantizedOptions>().enabled = quantized;
      run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
        auto zero = make_zero(stage, options);
        zero->setup(make_model_as(g.spec, at::kFloat), optim::optimizer_factory(adam()),
                    std::make_shared<comm::ProcessGrid>(comm));
        const data::Batch batch = g.dataset.get({0, 1, 2, 3, 4, 5, 6, 7});
        const auto batch32 = data::Batch{batch.inputs.to(at::kFloat), batch.targets};
        zero->train_step({batch32}, parallel::cross_entropy);  // warm: no first-step extras
        const int64_t before = comm->wire_bytes();
        zero->train_step({batch32}, parallel::cross_entropy);
        if (comm->rank() == 0) sent[quantized] = comm->wire_bytes() - before;
      });
    }
    EXPECT_GE(static_cast<double>(sent[false]) / sent[true], stage == 3 ? 3.5 : 1.5)
        << "zero" << stage << ": " << sent[false] << " vs " << sent[true] << " bytes";
  }
  EXPECT_THROW(make_zero(1,
                         [] {
                           parallel::StrategyOptions o;
                           o.of<parallel::zero::ZeroQuantizedOptions>().enabled = true;
                           return o;
                         }()),
               InputError);
}

TEST(Zero3, UnitsOfAnyGranularityAndConvolutionsMatchSingleProcess) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_deep_mlp(), adam(), 10);
  const auto expected = train_single(f, 10);
  parallel::StrategyOptions merged;
  merged.of<dtrain::parallel::zero::Zero3Options>().min_unit_params =
      1100;  // layers 0 and 1 in one unit, layer 2 alone
  merged.of<dtrain::parallel::zero::Zero3Options>().prefetch = false;
  EXPECT_LE(
      max_abs_diff(expected, train_distributed(f, 2, 10, [&] { return make_zero(3, merged); })),
      kTightBound);
  models::ModelSpec cnn;
  cnn.input_shape = {1, 8, 8};
  auto g = make_fixture(cnn, adam(), 6, 16);
  EXPECT_LE(
      max_abs_diff(train_single(g, 6), train_distributed(g, 2, 6, [] { return make_zero(3); })),
      kTightBound);
  // Activation checkpointing: units recompute their forward (after the pre-backward gather).
  auto checkpointed = odd_deep_mlp();
  checkpointed.checkpointing = "3";
  auto h = make_fixture(checkpointed, adam(), 6);
  EXPECT_LE(
      max_abs_diff(train_single(h, 6), train_distributed(h, 2, 6, [] { return make_zero(3); })),
      kTightBound);
}

TEST(Zero3, SequentialModelsGetOneUnitPerParameterizedStage) {
  at::set_num_threads(1);
  torch::manual_seed(6);
  auto build = [] {
    torch::nn::Sequential net(torch::nn::Flatten(), torch::nn::Linear(144, 9), torch::nn::ReLU(),
                              torch::nn::Linear(9, 10), torch::nn::ReLU());
    net->to(torch::kDouble);
    return net;
  };
  std::vector<torch::nn::Sequential> nets{build(), build()};
  auto reference = build();
  {
    torch::NoGradGuard no_grad;
    auto from = nets[0]->parameters();
    auto to = reference->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  const auto inputs = torch::randn({8, 1, 12, 12}, torch::kDouble);
  const auto targets = torch::randint(0, 10, {8});
  auto optimizer = optim::make_optimizer(reference->parameters(), adam());
  for (int step = 0; step < 4; ++step) {
    optimizer->zero_grad();
    parallel::cross_entropy(reference->forward(inputs), targets).backward();
    optimizer->step();
  }
  std::vector<at::Tensor> got;
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    parallel::zero::Zero3Strategy zero3({});
    zero3.setup(sequential_model(nets[comm->rank()]), optim::optimizer_factory(adam()),
                std::make_shared<comm::ProcessGrid>(comm));
    EXPECT_EQ(zero3.sharder().unit_count(), 2u);  // Flatten+Linear, ReLU+Linear+ReLU
    const int64_t half = 4 * comm->rank();
    for (int step = 0; step < 4; ++step) {
      zero3.train_step({{inputs.narrow(0, half, 4), targets.narrow(0, half, 4)}},
                       parallel::cross_entropy);
    }
    zero3.materialize();
    if (comm->rank() == 0) got = snapshot(zero3.model());
  });
  std::vector<at::Tensor> expected;
  for (const auto& p : reference->parameters()) expected.push_back(p.detach());
  EXPECT_LE(max_abs_diff(expected, got), kTightBound);
}

TEST(Zero3, ModelWithoutStagesIsOneUnit) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_deep_mlp(), adam(), 6);
  const auto expected = train_single(f, 6);
  std::vector<Model> replicas;
  for (int r = 0; r < 2; ++r) {
    Model full = make_model_as(f.spec, f.dtype);
    if (r == 0) restore(full, f.initial);
    replicas.emplace_back(full.module, full.forward);  // no stages
  }
  std::vector<at::Tensor> got;
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    parallel::zero::Zero3Strategy zero3({});
    zero3.setup(replicas[comm->rank()], optim::optimizer_factory(adam()),
                std::make_shared<comm::ProcessGrid>(comm));
    EXPECT_EQ(zero3.sharder().unit_count(), 1u);
    auto order =
        data::DistributedSampler(f.dataset.size(), 2, comm->rank(), {true, 5, true}).indices();
    for (int step = 0; step < 6; ++step) {
      zero3.train_step({f.dataset.get(std::vector<int64_t>(order.begin() + step * 16,
                                                           order.begin() + (step + 1) * 16))},
                       parallel::cross_entropy);
    }
    zero3.materialize();
    if (comm->rank() == 1) got = snapshot(zero3.model());
  });
  EXPECT_LE(max_abs_diff(expected, got), kTightBound);
}

TEST(Zero, MatchesDdpWithAccumulationAndGlobalNormClipping) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_mlp(), adam(), 10);
  parallel::StrategyOptions options;
  options.max_grad_norm = 0.05;  // small enough to clip every step
  const auto ddp = train_distributed(
      f, 2, 10, [&] { return std::make_unique<parallel::ddp::DdpStrategy>(options); }, 2);
  for (int stage : {1, 2, 3}) {  // stages 2, 3: the norm is summed over gradient shards
    const auto zero = train_distributed(
        f, 2, 10, [&] { return make_zero(stage, options); }, 2);
    EXPECT_LE(max_abs_diff(ddp, zero), kTightBound) << "stage " << stage;
  }
}

// ZeRO's shard layout (Megatron's distributed optimizer): every bucket padded and split evenly,
// so each bucket's reduce-scatter and all-gather is balanced over the ranks (a contiguous cut of
// the whole flat order left most buckets inside one rank's shard: a ring then carries the whole
// bucket through every step).
TEST(ZeroLayout, EveryBucketIsSplitEvenlyOverTheRanks) {
  // Parameters of 6, 4, 1, 9 and 3 elements in buckets {4}, {2, 3}, {0, 1} (launch order).
  const auto layout = parallel::ddp::shard_layout({6, 4, 1, 9, 3}, {{4}, {3, 2}, {1, 0}}, 4);
  ASSERT_EQ(layout.buckets.size(), 3U);
  EXPECT_EQ(layout.buckets[0].parameters, (std::vector<size_t>{0, 1}));
  EXPECT_EQ(layout.buckets[0].numel, 10);
  EXPECT_EQ(layout.buckets[0].part, 3);  // 10 over 4 ranks: 3 each, 2 of padding
  EXPECT_EQ(layout.buckets[1].flat_begin, 12);
  EXPECT_EQ(layout.buckets[1].part, 3);  // 1 + 9 = 10
  EXPECT_EQ(layout.buckets[1].shard_offset, 3);
  EXPECT_EQ(layout.buckets[2].flat_begin, 24);
  EXPECT_EQ(layout.buckets[2].part, 1);  // 3 over 4 ranks
  EXPECT_EQ(layout.parameter_offset, (std::vector<int64_t>{0, 6, 12, 13, 24}));
  EXPECT_EQ(layout.bucket_of, (std::vector<size_t>{0, 0, 1, 1, 2}));
  EXPECT_EQ(layout.flat_numel, 28);
  EXPECT_EQ(layout.shard_numel, 7);
  // Buckets that skip or repeat a parameter are refused.
  EXPECT_THROW(parallel::ddp::shard_layout({6, 4, 1}, {{0}, {2}}, 2), Error);
  EXPECT_THROW(parallel::ddp::shard_layout({6, 4, 1}, {{0, 2}, {1}}, 2), Error);
}

// --overlap-param-gather: the all-gathers of the update are left running and the next forward
// waits for each bucket where its stage begins; the same numbers as waiting at once (float64,
// many small buckets, accumulation, clipping; zero1 and zero2 on 2 and 4 ranks), and a
// checkpoint saved and loaded between steps resumes to the uninterrupted weights.
TEST(Zero, OverlappedParameterGathersEqualGatheringAtOnce) {
  at::set_num_threads(1);
  auto f = make_fixture(odd_deep_mlp(), adam(), 6);
  parallel::StrategyOptions plain;
  plain.max_grad_norm = 0.05;
  plain.bucket_cap_bytes = 512;  // several buckets (the model has 8,920 bytes of float64)
  plain.first_bucket_cap_bytes = 256;
  parallel::StrategyOptions overlapped = plain;
  overlapped.of<parallel::zero::ZeroOverlapOptions>().param_gather = true;
  const auto single = train_single(f, 6);
  for (int world : {2, 4}) {
    for (int stage : {1, 2}) {
      const auto waited = train_distributed(
          f, world, 6, [&] { return make_zero(stage, plain); }, 2);
      const auto overlaid = train_distributed(
          f, world, 6, [&] { return make_zero(stage, overlapped); }, 2);
      EXPECT_EQ(max_abs_diff(waited, overlaid), 0.0) << "zero" << stage << " on " << world;
      EXPECT_GT(max_abs_diff(single, f.initial), 1e-2);
    }
  }
  // Saved after 3 steps (gathers in flight), loaded into a fresh strategy, 3 more steps.
  saves_and_resumes(2, overlapped, "dtrain-zero-overlap-ckpt");
  // A strategy (and its data-parallel group) going away right after a step, its gathers still
  // running, waits for them first (a group destroyed with collectives queued would crash).
  torch::manual_seed(4);
  const data::Batch batch{torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})};
  std::vector<Model> models;
  for (int i = 0; i < 10; ++i) models.push_back(models::make_model(odd_deep_mlp()));
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    for (int i = 0; i < 5; ++i) {
      auto grid = std::make_shared<comm::ProcessGrid>(comm);
      parallel::zero::ZeroStrategy strategy(overlapped, 2);
      strategy.setup(models[2 * i + comm->rank()], optim::optimizer_factory(adam()), grid);
      strategy.train_step({batch}, parallel::cross_entropy);
    }
  });
}

// zero1 is Megatron's distributed optimizer: the step's gradients are reduce-scattered (each rank
// receives its shard's average: half an allreduce's bytes), then the updated shards gathered;
// with tensor-parallel partial sums it allreduces (TensorParallel.* check those runs).
TEST(Zero1, ReduceScattersTheGradientsInsteadOfAllreducing) {
  at::set_num_threads(1);
  torch::manual_seed(2);
  const data::Batch batch{torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})};
  std::vector<Model> models;
  for (int i = 0; i < 4; ++i) models.push_back(models::make_model(odd_deep_mlp()));
  int64_t parameters = 0;
  for (const auto& p : models[0].module->parameters()) parameters += p.numel();
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    for (int stage : {0, 1}) {  // 0: ddp
      auto grid = std::make_shared<comm::ProcessGrid>(comm);
      parallel::StrategyPtr strategy =
          stage == 0 ? parallel::StrategyPtr(std::make_unique<parallel::ddp::DdpStrategy>(
                           parallel::StrategyOptions{}))
                     : make_zero(1);
      strategy->setup(models[2 * stage + comm->rank()], optim::optimizer_factory(adam()), grid);
      grid->dp()->reset_tally();
      strategy->train_step({batch}, parallel::cross_entropy);
      auto tally = grid->dp()->tally();
      if (stage == 0) {
        EXPECT_GE(tally["allreduce"].elements, parameters);
        EXPECT_EQ(tally["reduce_scatter"].count, 0);
      } else {
        EXPECT_GE(tally["reduce_scatter"].elements, parameters);
        EXPECT_LT(tally["allreduce"].elements, parameters) << "the gradients were allreduced";
        EXPECT_GE(tally["allgather"].elements, parameters);
      }
    }
  });
}

TEST(Zero1, MemoryReportFollowsTheZeroFormula) {
  at::set_num_threads(1);
  for (int world : {2, 4}) {
    run_ranks(world, [world](const comm::CommunicatorPtr& comm) {
      auto grid = std::make_shared<comm::ProcessGrid>(comm);
      torch::manual_seed(1);
      parallel::zero::ZeroStrategy zero({});
      zero.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      data::Batch batch{torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})};
      zero.train_step({batch}, parallel::cross_entropy);  // Adam allocates its state
      const int64_t p = 1095;
      const int64_t shard = (p + world - 1) / world;
      const int64_t mine = std::min(p, (comm->rank() + 1) * shard) - comm->rank() * shard;
      const auto report = zero.memory_report();
      EXPECT_EQ(report.parameter_bytes, 4 * shard * world);  // 4P + padding
      EXPECT_EQ(report.gradient_bytes, 4 * p);               // 4P
      EXPECT_EQ(report.optimizer_bytes, 8 * mine);           // 8P/N (the last shard is short)

      parallel::zero::ZeroStrategy zero2({}, 2);
      zero2.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      zero2.train_step({batch}, parallel::cross_entropy);
      const auto report2 = zero2.memory_report();
      EXPECT_EQ(report2.parameter_bytes, 4 * shard * world);  // 4P + padding
      EXPECT_EQ(report2.gradient_bytes, 4 * shard);           // 4P/N (+ padding)
      EXPECT_EQ(report2.optimizer_bytes, 8 * mine);           // 8P/N
      for (const auto& p : zero2.model().module->parameters()) {
        EXPECT_FALSE(p.grad().defined()) << "a full gradient outlived its reduce-scatter";
      }

      parallel::ddp::DdpStrategy ddp({});
      ddp.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      ddp.train_step({batch}, parallel::cross_entropy);
      EXPECT_EQ(ddp.memory_report().optimizer_bytes, 8 * p);  // every rank holds all of it

      // Stage 3: each unit (layer) is padded and split on its own: 16P/N plus padding.
      parallel::zero::Zero3Strategy zero3({});
      zero3.setup(models::make_model(odd_mlp()), optim::optimizer_factory(adam()), grid);
      zero3.train_step({batch}, parallel::cross_entropy);
      int64_t padded_shard = 0, owned = 0;
      for (int64_t unit : {144 * 7 + 7, 7 * 10 + 10}) {
        const int64_t s = (unit + world - 1) / world;
        padded_shard += s;
        owned += std::clamp<int64_t>(unit - comm->rank() * s, 0, s);
      }
      const auto report3 = zero3.memory_report();
      EXPECT_EQ(report3.parameter_bytes, 4 * padded_shard);  // 4P/N (+ padding)
      EXPECT_EQ(report3.gradient_bytes, 4 * padded_shard);   // 4P/N (+ padding)
      EXPECT_EQ(report3.optimizer_bytes, 8 * owned);         // 8P/N
      for (const auto& p : zero3.model().module->parameters()) {
        EXPECT_EQ(p.storage().nbytes(), 0u) << "a full parameter outlived its unit's step";
        EXPECT_FALSE(p.grad().defined()) << "a full gradient outlived its reduce-scatter";
      }
    });
  }
}

TEST(Zero3, HoldsOnlyAFewUnitsWholeAtOnce) {
  at::set_num_threads(1);
  models::ModelSpec deep;  // 14 units: 544 + 12 x 1056 + 330 parameters
  deep.name = "mlp";
  deep.input_shape = {1, 4, 4};
  deep.hidden = std::vector<int64_t>(13, 32);
  torch::manual_seed(4);
  std::vector<Model> replicas{models::make_model(deep), models::make_model(deep)};
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    parallel::zero::Zero3Strategy zero3({});
    zero3.setup(replicas[comm->rank()], optim::optimizer_factory(adam()),
                std::make_shared<comm::ProcessGrid>(comm));
    ASSERT_EQ(zero3.sharder().unit_count(), 14u);
    data::Batch batch{torch::randn({8, 1, 4, 4}), torch::randint(0, 10, {8})};
    const auto result = zero3.train_step({batch}, parallel::cross_entropy);
    const int64_t p = 544 + 12 * 1056 + 330;
    // Whole parameters + gradients of the model would be 8P bytes; gathering a unit and the next,
    // and a few reductions in flight, stay far below.
    const int64_t peak = zero3.sharder().peak_transient_bytes();
    EXPECT_GT(peak, 4 * 1056);
    EXPECT_LT(peak, 8 * p / 3);
    EXPECT_NEAR(result.metrics.at("peak_transient_mb"), peak / double(1 << 20), 1e-9);
  });
}

TEST(Zero1, SavesAndResumesItsShards) { saves_and_resumes(1, {}, "dtrain-zero1-ckpt"); }

TEST(Zero, MixedPrecisionMatchesDdpAndPureBf16IsRefused) {
  at::set_num_threads(1);
  // float32: autocast lowers float32 ops to bf16 (it leaves float64 alone). Both sides round the
  // same bf16 products; only the reduction order differs, so 1e-5 has a wide margin here.
  auto f = make_fixture(odd_mlp(), adam(), 8, 32, at::kFloat);
  parallel::StrategyOptions mixed;
  mixed.precision = "bf16-mixed";
  const auto ddp = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::ddp::DdpStrategy>(mixed); });
  const auto zero2 = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::zero::ZeroStrategy>(mixed, 2); });
  EXPECT_LE(max_abs_diff(ddp, zero2), 1e-5);
  const auto zero = train_distributed(
      f, 2, 8, [&] { return std::make_unique<parallel::zero::ZeroStrategy>(mixed); });
  EXPECT_LE(max_abs_diff(ddp, zero), 1e-5);
  EXPECT_LE(max_abs_diff(ddp, train_distributed(f, 2, 8, [&] { return make_zero(3, mixed); })),
            1e-5);
  const auto fp32 = train_distributed(f, 2, 8, [] {
    return std::make_unique<parallel::zero::ZeroStrategy>(parallel::StrategyOptions{});
  });
  EXPECT_GT(max_abs_diff(fp32, zero), 0.0) << "bf16-mixed changed nothing: autocast not applied?";
  EXPECT_THROW(parallel::zero::ZeroStrategy({.precision = "bf16"}), InputError);
  EXPECT_THROW(parallel::zero::Zero3Strategy({.precision = "bf16"}), InputError);
  EXPECT_THROW(parallel::zero::Zero3Strategy({.grad_compression = "fp16"}), InputError);
}

// Sharded checkpoints reshard: zero3 on 4 ranks -> ddp on 2 -> zero1 on 3 (-> zero2 on 2 ->
// zero3 on 3) continues exactly as uninterrupted single-process training.
TEST(ShardedCheckpoint, ReshardsAcrossStrategiesAndWorldSizes) {
  at::set_num_threads(1);
  TempDir dir;
  const int64_t global = 12;  // divisible by 2, 3 and 4
  const int steps_per_phase = 3;
  const std::vector<std::pair<int, int>> phases{
      {3, 4}, {0, 2}, {1, 3}, {2, 2}, {3, 3}};  // stage, N
  const int total = steps_per_phase * static_cast<int>(phases.size());
  const auto synthetic = data::make_synthetic(global * total, {1, 12, 12}, 10, 7);
  const data::TensorDataset dataset(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  auto global_batch = [&](int step) {
    std::vector<int64_t> rows(global);
    std::iota(rows.begin(), rows.end(), step * global);
    return dataset.get(rows);
  };
  torch::manual_seed(5);
  const auto initial = snapshot(make_model_as(odd_deep_mlp(), at::kDouble));
  // The oracle: one process, every global batch.
  Model single = make_model_as(odd_deep_mlp(), at::kDouble);
  restore(single, initial);
  auto optimizer = optim::make_optimizer(single.module->parameters(), adam());
  for (int step = 0; step < total; ++step) {
    const auto batch = global_batch(step);
    optimizer->zero_grad();
    parallel::cross_entropy(single(batch.inputs), batch.targets).backward();
    optimizer->step();
  }
  std::vector<at::Tensor> resumed;
  for (size_t phase = 0; phase < phases.size(); ++phase) {
    const auto [stage, world] = phases[phase];
    std::vector<Model> replicas;
    for (int r = 0; r < world; ++r) {
      replicas.push_back(
          make_model_as(odd_deep_mlp(), at::kDouble));  // random: loading must overwrite
      if (phase == 0) restore(replicas.back(), initial);
    }
    const std::string load_dir = dir / ("phase" + std::to_string(phase));
    const std::string save_dir = dir / ("phase" + std::to_string(phase + 1));
    std::filesystem::create_directories(save_dir);
    run_ranks(
        world,
        [&, stage = stage, world = world](const comm::CommunicatorPtr& comm) {
          auto strategy =
              stage == 0 ? std::make_unique<parallel::ddp::DdpStrategy>(parallel::StrategyOptions{})
                         : make_zero(stage);
          strategy->setup(replicas[comm->rank()], optim::optimizer_factory(adam()),
                          std::make_shared<comm::ProcessGrid>(comm));
          if (phase > 0) strategy->load(load_dir);
          const int64_t local = global / world;
          for (int s = 0; s < steps_per_phase; ++s) {
            const auto batch = global_batch(static_cast<int>(phase) * steps_per_phase + s);
            strategy->train_step({{batch.inputs.narrow(0, comm->rank() * local, local),
                                   batch.targets.narrow(0, comm->rank() * local, local)}},
                                 parallel::cross_entropy);
          }
          comm->barrier()->wait();
          strategy->save(save_dir);
          strategy->materialize();
          if (comm->rank() == 0 && phase + 1 == phases.size())
            resumed = snapshot(strategy->model());
        },
        std::chrono::seconds(60));
  }
  EXPECT_GT(max_abs_diff(snapshot(single), initial), 1e-2);
  EXPECT_LE(max_abs_diff(snapshot(single), resumed), kTightBound);

  // A checkpoint of another model: the error names the tensor it cannot fill.
  auto other = odd_deep_mlp();
  other.hidden = {9, 5};
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    parallel::zero::Zero3Strategy zero3({});
    zero3.setup(make_model_as(other, at::kDouble), optim::optimizer_factory(adam()),
                std::make_shared<comm::ProcessGrid>(comm));
    try {
      zero3.load(dir / "phase5");
      ADD_FAILURE() << "loaded a checkpoint of another model";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("layers.0.weight"), std::string::npos) << e.what();
    }
  });
}
