// DDP against the correctness oracle: N ranks on global batch B train to the same weights as one
// process on batch B. Also: accumulation, compression, unused parameters, bucketing/overlap.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <fstream>

#include "Oracle.h"
#include "RankThreads.h"
#include "SmallModels.h"
#include "TempDir.h"
#include "TrainerRuns.h"
#include "dtrain/comm/Hierarchical.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "parallel/StrategySupport.h"
#include "parallel/ddp/DdpStrategy.h"

using namespace dtrain;
using namespace std::chrono_literals;
using namespace dtrain::test;

namespace {

constexpr int kSteps = 20;

optim::OptimizerSpec sgd_momentum() {
  optim::OptimizerSpec spec;
  spec.name = "sgd";
  spec.lr = 0.05;
  spec.momentum = 0.9;
  spec.weight_decay = 1e-4;
  return spec;
}

Fixture make_setup(const std::string& model_name, at::ScalarType dtype = at::kDouble,
                   std::vector<int64_t> hidden = {48, 32}) {
  models::ModelSpec spec;
  spec.name = model_name;
  spec.input_shape = {1, 12, 12};
  spec.hidden = std::move(hidden);
  return make_fixture(spec, sgd_momentum(), kSteps, 32, dtype);
}

std::vector<at::Tensor> train_ddp(const Fixture& f, int world, int steps,
                                  const parallel::StrategyOptions& options, int micro = 1) {
  return train_distributed(
      f, world, steps, [&] { return std::make_unique<parallel::ddp::DdpStrategy>(options); },
      micro);
}

}  // namespace

class DdpEquivalence : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(DdpEquivalence, MatchesSingleProcessOnTheGlobalBatch) {
  at::set_num_threads(1);
  const auto [model_name, world] = GetParam();
  auto s = make_setup(model_name);
  auto expected = train_single(s, kSteps);
  parallel::StrategyOptions options;
  options.bucket_cap_bytes = 16 * 1024;  // several buckets even for these small models
  auto got = train_ddp(s, world, kSteps, options);
  EXPECT_GT(max_abs_diff(expected, s.initial), 1e-2) << "training did not move the weights";
  EXPECT_LE(max_abs_diff(expected, got), kTightBound);
}

INSTANTIATE_TEST_SUITE_P(Models, DdpEquivalence,
                         ::testing::Combine(::testing::Values("mlp", "cnn"),
                                            ::testing::Values(2, 4)));

TEST(Ddp, GradientAccumulationMatchesTheFullBatch) {
  at::set_num_threads(1);
  auto s = make_setup("mlp");
  auto expected = train_single(s, 10);
  auto got = train_ddp(s, 2, 10, {}, /*micro=*/4);
  EXPECT_LE(max_abs_diff(expected, got), kTightBound);
}

// The oracle's bound is tight enough to notice one rank's gradient or one micro-batch missing.
TEST(Ddp, TheOracleNoticesALostGradientOrMicroBatch) {
  at::set_num_threads(1);
  auto s = make_setup("mlp");
  const auto expected = train_single(s, 10);
  auto make = [] {
    return std::make_unique<parallel::ddp::DdpStrategy>(parallel::StrategyOptions{});
  };
  const auto lost_rank = train_distributed(
      s, 2, 10, make, 1, [](const comm::CommunicatorPtr& c) { return drop_rank_gradient(1, c); });
  EXPECT_GT(max_abs_diff(expected, lost_rank), 1e6 * kTightBound);
  const auto lost_micro = train_distributed(s, 2, 10, make, 2, [](const comm::CommunicatorPtr& c) {
    auto calls = std::make_shared<int>(0);  // rank 0 drops its second micro-batch every step
    return parallel::LossFn([c, calls](const at::Tensor& out, const at::Tensor& target) {
      const auto loss = parallel::cross_entropy(out, target);
      return c->rank() == 0 && (*calls)++ % 2 == 1 ? loss * 0.0 : loss;
    });
  });
  EXPECT_GT(max_abs_diff(expected, lost_micro), 1e6 * kTightBound);
}

// 16-bit wire formats of float32 gradients, alone and for PowerSGD's factors at full rank (where
// the factors are the only approximation): close to the oracle, and not equal to it.
TEST(Ddp, CompressedGradientsStayClose) {
  at::set_num_threads(1);
  auto s = make_setup("mlp", at::kFloat);
  auto expected = train_single(s, 10);
  const double exact_powersgd = [&] {
    parallel::StrategyOptions options;
    options.grad_compression = "powersgd:100000:0:0";
    return max_abs_diff(expected, train_ddp(s, 2, 10, options));
  }();
  EXPECT_LE(exact_powersgd, 1e-5);  // float32 round-off of the factors' products
  for (const std::string compression :
       {"fp16", "bf16", "powersgd:100000:0:0:fp16", "powersgd:100000:0:0:bf16"}) {
    parallel::StrategyOptions options;
    options.grad_compression = compression;
    auto got = train_ddp(s, 2, 10, options);
    const double diff = max_abs_diff(expected, got);
    const bool fp16 = compression.find("fp16") != std::string::npos;
    EXPECT_LE(diff, fp16 ? 2e-3 : 2e-2) << compression;
    EXPECT_GT(diff, 10 * exact_powersgd) << compression << " changed nothing: not applied?";
  }
  EXPECT_THROW(parallel::ddp::DdpStrategy({.grad_compression = "int3"}), InputError);
}

// PowerSGD at full rank (every matrix compressed: minimum rate 0) reconstructs the mean gradient
// exactly, so DDP with it trains to the oracle's weights in float64, step after step (error
// feedback and warm-started Q included: the mlp's 160 x 144 layer has more rows than columns, so
// each rank's error is not zero, only their sum); at rank 1 it is visibly not exact (so the
// compression is applied).
TEST(Ddp, PowerSgdAtFullRankEqualsTheExactAllreduce) {
  at::set_num_threads(1);
  for (const std::string model : {"mlp", "cnn"}) {
    SCOPED_TRACE(model);
    auto s = make_setup(model, at::kDouble, {160, 32});
    const auto expected = train_single(s, 8);
    for (const std::string spec : {"powersgd:100000:0:0", "powersgd:1"}) {
      parallel::StrategyOptions options;
      options.bucket_cap_bytes = 16 * 1024;
      options.grad_compression = spec;
      const double diff = max_abs_diff(expected, train_ddp(s, 2, 8, options));
      if (spec == "powersgd:1") {
        EXPECT_GT(diff, 1e-4) << "rank 1 changed nothing: not applied?";
      } else {
        EXPECT_LE(diff, kTightBound) << spec;
      }
    }
  }
}

// Error feedback: with the same gradients every step, what rank-1 PowerSGD applies over T steps
// adds up to T x the mean gradient up to the error left over, which stays bounded (without the
// error buffer the shortfall grows with T: the part outside rank 1 would never be sent). Both
// ranks apply the same gradient.
TEST(Ddp, PowerSgdErrorFeedbackSendsWhatEarlierStepsLeftOut) {
  at::set_num_threads(1);
  run_ranks(2, [](const comm::CommunicatorPtr& comm) {
    at::Tensor weight = at::zeros({24, 16}, at::kDouble).requires_grad_(true);
    at::Tensor bias = at::zeros({16}, at::kDouble).requires_grad_(true);
    auto generator = at::detail::createCPUGenerator(11 + comm->rank());
    const at::Tensor g_weight = at::randn({24, 16}, generator, at::kDouble);
    const at::Tensor g_bias = at::randn({16}, generator, at::kDouble);
    parallel::ddp::ReducerOptions options;
    options.powersgd.rank = 1;
    parallel::ddp::Reducer reducer({weight, bias}, {"weight", "bias"}, comm, options);
    ASSERT_EQ(reducer.stats().compressed_matrices, 1);
    options.powersgd.start_step = 2;  // exact for 2 steps: their bytes, then PowerSGD's
    parallel::ddp::Reducer later(
        {weight.detach().clone().requires_grad_(true), bias.detach().clone().requires_grad_(true)},
        {"weight", "bias"}, comm, options);
    EXPECT_EQ(later.stats().bytes_per_step, (24 * 16 + 16) * 8);
    for (int t = 0; t < 2; ++t) {
      later.zero_grad();
      later.prepare_for_backward();
      later.finalize();  // no backward: zero gradients, still reduced
    }
    EXPECT_EQ(later.stats().bytes_per_step, (24 + 16 + 16) * 8);
    at::Tensor mean = g_weight.clone();
    comm->allreduce(mean)->wait();
    mean.div_(2);
    at::Tensor applied = at::zeros_like(mean);
    const int steps = 200;
    for (int t = 0; t < steps; ++t) {
      reducer.zero_grad();
      reducer.prepare_for_backward();
      ((weight * g_weight).sum() + (bias * g_bias).sum()).backward();
      reducer.finalize();
      applied += weight.grad();
      if (t == 0) {  // one step sends only the rank-1 part
        EXPECT_GT((weight.grad() - mean).norm().item<double>(), 0.3 * mean.norm().item<double>());
      }
    }
    const double shortfall = (applied - steps * mean).norm().item<double>();
    // Measured: about 9 x |mean| whatever T (bounded); without error feedback about 0.9 T |mean|.
    EXPECT_LT(shortfall, 0.1 * steps * mean.norm().item<double>());
    at::Tensor other = applied.clone();  // the same on both ranks
    comm->broadcast(other)->wait();
    EXPECT_EQ((other - applied).abs().max().item<double>(), 0.0);
  });
}

// The hierarchical allreduce (2 hosts x 2 ranks): the oracle's weights, and across hosts each rank
// sends 2 x 1/2 of its half of the gradients where a flat ring over 4 sends 2 x 3/4 of all of
// them. Hosts of unequal size are refused.
TEST(Ddp, HierarchicalAllreduceMatchesTheOracleAndCrossesHostsOnce) {
  at::set_num_threads(1);
  auto s = make_setup("mlp");
  const auto expected = train_single(s, 6);
  parallel::StrategyOptions options;
  options.bucket_cap_bytes = 16 * 1024;
  options.hierarchical_allreduce = true;
  options.ranks_per_host = 2;
  EXPECT_LE(max_abs_diff(expected, train_ddp(s, 4, 6, options)), kTightBound);
  run_ranks(4, [&](const comm::CommunicatorPtr& comm) {
    comm::HierarchicalAllreduce hierarchy(comm, 2);
    EXPECT_EQ(hierarchy.local()->size(), 2);
    EXPECT_EQ(hierarchy.cross()->size(), 2);
    at::Tensor grads = at::full({1000}, comm->rank() + 1.0, at::kDouble);
    hierarchy.allreduce(grads)->wait();
    EXPECT_TRUE(at::allclose(grads, at::full({1000}, 10.0, at::kDouble)));
    EXPECT_EQ(hierarchy.cross()->tally().at("allreduce").wire_bytes, 2 * 500 * 8 / 2);
    EXPECT_THROW(comm::HierarchicalAllreduce(comm, 3), InputError);  // hosts of 3 and 1
  });
}

TEST(Ddp, PowerSgdCountsItsMatricesAndBytesAndRefusesBadSpecs) {
  at::set_num_threads(1);
  auto s = make_setup("mlp");  // 48 x 144, 32 x 48, 10 x 32 weights and three biases
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    std::map<std::string, parallel::ddp::ReducerStats> stats;
    for (const std::string spec :
         {"none", "powersgd:1", "powersgd:100000:0:0", "powersgd:4:5", "powersgd:1:0:2:bf16"}) {
      parallel::ddp::DdpStrategy ddp({.grad_compression = spec});
      Model replica = make_model_as(s.spec, s.dtype);
      ddp.setup(replica, optim::optimizer_factory(s.optimizer),
                std::make_shared<comm::ProcessGrid>(comm));
      stats[spec] = ddp.reducer().stats();
    }
    const int64_t params = 48 * 144 + 48 + 32 * 48 + 32 + 10 * 32 + 10;
    EXPECT_EQ(stats["none"].bytes_per_step, params * 8);
    EXPECT_EQ(stats["powersgd:1"].compressed_matrices, 3);
    // Rank 1: (48 + 144) + (32 + 48) + (10 + 32) factor elements and the 90 bias elements.
    EXPECT_EQ(stats["powersgd:1"].bytes_per_step, (192 + 80 + 42 + 90) * 8);
    EXPECT_EQ(stats["powersgd:1:0:2:bf16"].bytes_per_step, (192 + 80 + 42 + 90) * 2);
    EXPECT_EQ(stats["powersgd:100000:0:0"].compressed_matrices, 3);
    // Exact for the first 5 steps: the bytes of the exact allreduce until then.
    EXPECT_EQ(stats["powersgd:4:5"].bytes_per_step, params * 8);
  });
  for (const std::string bad :
       {"powersgd", "powersgd:0", "powersgd:x", "powersgd:4:-1", "powersgd:4:1:z",
        "powersgd:4:1:2:3", "powersgd:4:1:2:fp8", "powersgd:4:1:2:fp16:1"}) {
    EXPECT_THROW(parallel::ddp::DdpStrategy({.grad_compression = bad}), InputError) << bad;
  }
  EXPECT_THROW(parallel::make_strategy("zero2", {.grad_compression = "powersgd:4"}), InputError);
}

// Each step record says what this rank sent (wire_bytes): DDP's gradient allreduce over 2 ranks
// is the gradients' bytes (2 x 1/2 of them), PowerSGD's a fraction of that.
TEST(Ddp, StepRecordsCountTheBytesSent) {
  at::set_num_threads(1);
  test::TempDir dir;
  const int64_t params = 16 * 32 + 32 + 32 * 4 + 4;  // small_mlp(16, 32, 4), float64
  std::map<std::string, int64_t> sent;
  for (const std::string compression : {"none", "powersgd:1", "powersgd:1:0:2:fp16"}) {
    train::TrainerOptions options;
    options.batch_size = 8;
    options.optimizer.name = "adam";
    options.progress = false;
    options.metrics_file = dir / (compression + ".jsonl");
    options.max_steps = 4;
    options.log_every = 1;
    options.strategy_options.grad_compression = compression;
    test::run_training(2, options, 1, test::small_mlp(16, 32, 4));
    std::ifstream in(options.metrics_file);
    std::string line;
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line);
      if (record.at("event") != "step") continue;
      ASSERT_TRUE(record.contains("wire_bytes")) << line;
      sent[compression] = record.at("wire_bytes").get<int64_t>();
    }
  }
  EXPECT_EQ(sent["none"], params * 8);
  // Rank 1: (16 + 32) + (32 + 4) factor elements, and the 36 bias elements.
  EXPECT_EQ(sent["powersgd:1"], (48 + 36 + 36) * 8);
  EXPECT_EQ(sent["powersgd:1:0:2:fp16"], (48 + 36 + 36) * 2);  // the factors in 16 bits
}

namespace {
// A model whose second head is only used on rank 0's data: rank 1 produces no gradient for it.
struct TwoHeads : torch::nn::Module {
  TwoHeads() {
    body = register_module("body", torch::nn::Linear(4, 4));
    head_a = register_module("head_a", torch::nn::Linear(4, 2));
    head_b = register_module("head_b", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(body(x));
    return use_b ? head_b(h) : head_a(h);
  }
  torch::nn::Linear body{nullptr}, head_a{nullptr}, head_b{nullptr};
  bool use_b = false;
};
}  // namespace

TEST(Ddp, UnusedParametersAreZeroOrNamedNeverAHang) {
  at::set_num_threads(1);
  for (bool strict : {false, true}) {
    run_ranks(
        2,
        [strict](const comm::CommunicatorPtr& comm) {
          auto net = std::make_shared<TwoHeads>();
          net->use_b = comm->rank() == 1;
          parallel::StrategyOptions options;
          options.error_on_unused_parameters = strict;
          parallel::ddp::DdpStrategy ddp(options);
          ddp.setup(Model(net), optim::optimizer_factory({}),
                    std::make_shared<comm::ProcessGrid>(comm));
          data::Batch batch{torch::randn({8, 4}), torch::randint(0, 2, {8})};
          if (!strict) {
            ddp.train_step({batch}, parallel::cross_entropy);
            EXPECT_EQ(ddp.reducer().stats().unused_parameters.size(), 2u);  // weight + bias
            // Gradients agree across ranks even though each rank used a different head.
            auto g = net->head_b->weight.grad().clone();
            auto other = g.clone();
            comm->broadcast(other, {0})->wait();
            EXPECT_TRUE(torch::allclose(g, other));
          } else {
            try {
              ddp.train_step({batch}, parallel::cross_entropy);
              ADD_FAILURE() << "no error for unused parameters";
            } catch (const Error& e) {
              const std::string unused = comm->rank() == 0 ? "head_b.weight" : "head_a.weight";
              EXPECT_NE(std::string(e.what()).find(unused), std::string::npos) << e.what();
            }
          }
        },
        20s);
  }
}

TEST(Ddp, BucketsFollowTheCapAndLaunchDuringBackward) {
  at::set_num_threads(1);
  run_ranks(2, [](const comm::CommunicatorPtr& comm) {
    models::ModelSpec spec;
    spec.name = "mlp";
    spec.input_shape = {64};
    spec.hidden = {64, 64, 64};
    parallel::StrategyOptions options;
    options.bucket_cap_bytes = 64 * 64 * 4;  // one weight matrix per bucket
    parallel::ddp::DdpStrategy ddp(options);
    ddp.setup(models::make_model(spec), optim::optimizer_factory({}),
              std::make_shared<comm::ProcessGrid>(comm));
    const auto layout = ddp.reducer().bucket_layout();
    // Reverse order, a bucket closing once it reaches the cap: [7 6 5 4] [3 2] [1 0].
    ASSERT_EQ(layout.size(), 3u);
    EXPECT_EQ(layout[0], (std::vector<size_t>{7, 6, 5, 4}));
    EXPECT_EQ(layout[1], (std::vector<size_t>{3, 2}));
    EXPECT_EQ(layout[2], (std::vector<size_t>{1, 0}));
    data::Batch batch{torch::randn({16, 64}), torch::randint(0, 10, {16})};
    auto result = ddp.train_step({batch}, parallel::cross_entropy);
    // All but the bucket holding the first layer are launched before backward ends.
    EXPECT_GE(ddp.reducer().stats().buckets_launched_during_backward,
              static_cast<int64_t>(layout.size()) - 1);
    EXPECT_GE(result.metrics.at("exposed_comm_ms"), 0.0);
    auto report = ddp.memory_report();
    EXPECT_EQ(report.parameter_bytes, report.gradient_bytes);
    EXPECT_EQ(report.optimizer_bytes, 0);  // plain SGD keeps no state
  });
}

TEST(Ddp, ParametersReassignedBySetKeepSynchronizing) {
  // torch::load(module, file) re-assigns parameters with set_, which gives them new autograd
  // nodes; the reducer must follow them or gradients silently stop being reduced.
  at::set_num_threads(1);
  run_ranks(2, [](const comm::CommunicatorPtr& comm) {
    models::ModelSpec spec;
    spec.name = "mlp";
    spec.input_shape = {8};
    spec.hidden = {8};
    parallel::ddp::DdpStrategy ddp({});
    ddp.setup(models::make_model(spec), optim::optimizer_factory({}),
              std::make_shared<comm::ProcessGrid>(comm));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ddp.model().module->parameters()) p.set_(p.detach().clone());
    }
    data::Batch batch{torch::randn({4, 8}) * (comm->rank() + 1), torch::randint(0, 10, {4})};
    ddp.train_step({batch}, parallel::cross_entropy);
    EXPECT_TRUE(ddp.reducer().stats().unused_parameters.empty());
    for (const auto& p : ddp.model().module->parameters()) {
      auto mine = p.grad().clone();
      auto root = mine.clone();
      comm->broadcast(root, {0})->wait();
      EXPECT_TRUE(torch::equal(mine, root));  // reduced: identical on both ranks
    }
  });
}

TEST(Ddp, GradientFromAnEarlierMicroBatchSurvivesWhenUnusedInTheLast) {
  // head_b is used only by the first (no_sync) micro-batch: its accumulated gradient must still
  // be reduced and applied, exactly as in one process with the same micro-batches.
  at::set_num_threads(1);
  data::Batch first{torch::randn({4, 4}), torch::randint(0, 2, {4})};
  data::Batch second{torch::randn({4, 4}), torch::randint(0, 2, {4})};
  torch::manual_seed(3);
  auto reference = std::make_shared<TwoHeads>();
  std::vector<at::Tensor> initial;
  for (const auto& p : reference->parameters()) initial.push_back(p.detach().clone());
  {
    reference->use_b = true;
    auto l1 = parallel::cross_entropy(reference->forward(first.inputs), first.targets) / 2;
    reference->use_b = false;
    auto l2 = parallel::cross_entropy(reference->forward(second.inputs), second.targets) / 2;
    (l1 + l2).backward();
  }
  const at::Tensor expected = reference->head_b->weight.grad().clone();
  ASSERT_GT(expected.abs().sum().item<double>(), 0.0);
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    auto net = std::make_shared<TwoHeads>();
    {
      torch::NoGradGuard no_grad;
      auto params = net->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(initial[i]);
    }
    parallel::ddp::DdpStrategy ddp({});
    ddp.setup(Model(net->shared_from_this(),
                    [net](const at::Tensor& x) {
                      // Alternate heads by call: 1st micro-batch head_b, 2nd head_a.
                      auto out = net->forward(x);
                      net->use_b = !net->use_b;
                      return out;
                    }),
              optim::optimizer_factory({}), std::make_shared<comm::ProcessGrid>(comm));
    net->use_b = true;
    ddp.train_step({first, second}, parallel::cross_entropy);  // same data on both ranks
    EXPECT_TRUE(torch::allclose(net->head_b->weight.grad(), expected, 1e-5, 1e-6));
  });
}

TEST(Ddp, TheFirstLayerGetsTheLastBucketToItself) {
  run_ranks(1, [](const comm::CommunicatorPtr& comm) {
    models::ModelSpec spec;  // cnn: conv1.{weight,bias}=0,1 ... fc2.{weight,bias}=6,7
    spec.input_shape = {1, 12, 12};
    auto model = models::make_model(spec);
    const auto [params, names] = parameters_of(model);
    parallel::ddp::ReducerOptions options;  // everything fits the 1 MiB first bucket
    parallel::ddp::Reducer isolated(params, names, comm, options);
    EXPECT_EQ(isolated.bucket_layout(),
              (std::vector<std::vector<size_t>>{{7, 6, 5, 4, 3, 2}, {1, 0}}));
    options.isolate_first_layer = false;
    parallel::ddp::Reducer together(params, names, comm, options);
    EXPECT_EQ(together.bucket_layout(),
              (std::vector<std::vector<size_t>>{{7, 6, 5, 4, 3, 2, 1, 0}}));
  });
}

TEST(Ddp, AFirstLayerLargerThanTheRestOfItsBucketStaysInIt) {
  run_ranks(1, [](const comm::CommunicatorPtr& comm) {
    models::ModelSpec spec;  // mlp 784-256-256-10: layers.0 holds most of the bytes
    spec.name = "mlp";
    auto model = models::make_model(spec);
    const auto [params, names] = parameters_of(model);
    parallel::ddp::Reducer reducer(params, names, comm, {});
    EXPECT_EQ(reducer.bucket_layout(), (std::vector<std::vector<size_t>>{{5, 4, 3, 2, 1, 0}}));
  });
}

// The global norm clipping sees is the norm to float64's accuracy, however long the gradients:
// one float32 reduction along a 2 M-element gradient is 3e-5 off on a CPU (it set a 10 M-parameter
// Mixtral's norm 1.4e-4 below transformers' in float64, found by bench/moe/run_moe_peer.py).
TEST(Ddp, ClippingNormIsAccurateForLongGradients) {
  torch::manual_seed(0);
  std::vector<at::Tensor> holders;
  double expected = 0;
  for (const int64_t n : {int64_t{1} << 21, (int64_t{1} << 21) + 5, int64_t{7}}) {
    at::Tensor p = at::zeros({n});
    p.mutable_grad() = at::randn({n}) * 1e-3;
    expected += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    holders.push_back(p);
  }
  holders.push_back(at::zeros({3}, at::kBFloat16));  // no gradient: left out
  expected = std::sqrt(expected);
  const double norm = parallel::clip_by_global_norm(holders, {}, 1e9);
  EXPECT_NEAR(norm / expected, 1.0, 1e-7);
  // Clipped to 0.5 of it: every gradient scaled alike.
  const at::Tensor before = holders[1].grad().clone();
  parallel::clip_by_global_norm(holders, {}, expected / 2);
  EXPECT_NEAR((holders[1].grad() / before).mean().item<double>(), 0.5, 1e-6);
}
