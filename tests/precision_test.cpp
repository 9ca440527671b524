// Mixed precision (modes, autocast, the dynamic loss scaler incl. overflow on one rank only) and
// activation checkpointing (exact gradients with dropout, under DDP and under autocast).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "RankThreads.h"
#include "dtrain/common/Cpu.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/precision/LossScaler.h"
#include "dtrain/precision/Precision.h"
#include "parallel/ddp/DdpStrategy.h"

using namespace dtrain;
using dtrain::test::run_ranks;
using precision::Precision;

TEST(Precision, NamesAndFp16OnCpuIsRefusedWithAHint) {
  EXPECT_EQ(precision::parse_precision("bf16-mixed"), Precision::Bf16Mixed);
  EXPECT_EQ(precision::to_string(Precision::Bf16), "bf16");
  EXPECT_THROW(precision::parse_precision("fp8"), InputError);
  try {
    precision::check_supported(Precision::Fp16Mixed);
    ADD_FAILURE();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bf16-mixed"), std::string::npos);
  }
  EXPECT_THROW(parallel::ddp::DdpStrategy({.precision = "fp16-mixed"}), InputError);
  // On a CUDA device fp16-mixed is the usual mode (checked by name: no device is needed).
  EXPECT_NO_THROW(precision::check_supported(Precision::Fp16Mixed, c10::Device("cuda:0")));
  EXPECT_NO_THROW(parallel::ddp::DdpStrategy({.precision = "fp16-mixed", .device = "cuda:0"}));
}

// /proc/cpuinfo's first processor block on three kinds of machine (abridged to the lines read).
TEST(Precision, TheCpusBf16InstructionsAreReadAndBf16WithoutThemIsNamedAsSlow) {
  const CpuInfo epyc = parse_cpuinfo(
      "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
      "processor\t: 1\nmodel name\t: other\nflags\t\t: avx512f avx512_bf16\n");
  EXPECT_EQ(epyc.model, "AMD EPYC 7B12");
  EXPECT_TRUE(epyc.avx2);
  EXPECT_FALSE(epyc.avx512f);  // the second processor's block is not read
  EXPECT_FALSE(epyc.native_bf16());
  EXPECT_EQ(epyc.vector_summary(), "AVX2 only, no bf16 instructions");
  const CpuInfo sapphire = parse_cpuinfo(
      "processor : 0\nmodel name : Intel(R) Xeon(R) Platinum 8481C\n"
      "flags : avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n");
  EXPECT_TRUE(sapphire.native_bf16());
  EXPECT_EQ(sapphire.vector_summary(), "AVX-512 with AVX512-BF16 and AMX-BF16");
  const CpuInfo skylake =
      parse_cpuinfo("processor : 0\nmodel name : Intel Xeon\nflags : avx2 avx512f avx512bw\n");
  EXPECT_FALSE(skylake.native_bf16());
  EXPECT_EQ(skylake.vector_summary(), "AVX-512, no bf16 instructions");
  const CpuInfo graviton = parse_cpuinfo("processor : 0\nFeatures : fp asimd sve bf16 i8mm\n");
  EXPECT_TRUE(graviton.native_bf16());
  const CpuInfo nothing = parse_cpuinfo("");  // no /proc/cpuinfo: nothing claimed, no warning
  EXPECT_TRUE(nothing.unknown);
  EXPECT_TRUE(nothing.native_bf16());

  // This machine: the warning says what it is, exactly when its CPU lacks the instructions.
  const c10::Device cpu(c10::DeviceType::CPU);
  const std::string warning = precision::cost_warning(Precision::Bf16Mixed, cpu);
  EXPECT_EQ(warning.empty(), cpu_info().native_bf16()) << warning;
  if (!warning.empty()) {
    EXPECT_NE(warning.find(cpu_info().model), std::string::npos) << warning;
    EXPECT_NE(warning.find("--precision fp32 is faster"), std::string::npos) << warning;
  }
  EXPECT_EQ(precision::cost_warning(Precision::Bf16, cpu).empty(), cpu_info().native_bf16());
  EXPECT_EQ(precision::cost_warning(Precision::Fp32, cpu), "");
  EXPECT_EQ(precision::cost_warning(Precision::Bf16Mixed, c10::Device(c10::DeviceType::CUDA, 0)),
            "");
}

TEST(Precision, AutocastScopeComputesInBf16AndRestores) {
  torch::nn::Linear linear(8, 4);
  auto x = torch::randn({2, 8});
  {
    precision::AutocastScope scope(Precision::Bf16Mixed);
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    {
      precision::AutocastScope inner(Precision::Bf16Mixed);
      EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
    }
    EXPECT_EQ(linear(x).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
  precision::AutocastScope off(Precision::Fp32);
  EXPECT_EQ(linear(x).scalar_type(), torch::kFloat);
}

TEST(LossScaler, ScalesUnscalesBacksOffGrowsAndStopsBelowTheMinimum) {
  precision::LossScaler scaler({.init_scale = 8,
                                .growth_factor = 2,
                                .backoff_factor = 0.5,
                                .growth_interval = 2,
                                .min_scale = 1});
  EXPECT_DOUBLE_EQ(scaler.scale(torch::ones({1})).item<double>(), 8.0);
  auto w = torch::ones({3}, torch::requires_grad());
  w.mutable_grad() = torch::full({3}, 16.0);
  EXPECT_FALSE(scaler.unscale_and_check({w}, nullptr));
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({3}, 2.0)));
  scaler.update(false);
  scaler.update(false);
  EXPECT_DOUBLE_EQ(scaler.scale_value(), 16.0);  // doubled after 2 clean steps
  w.mutable_grad() = torch::tensor({1.0f, INFINITY, 0.0f});
  EXPECT_TRUE(scaler.unscale_and_check({w}, nullptr));
  scaler.update(true);
  EXPECT_DOUBLE_EQ(scaler.scale_value(), 8.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  w.mutable_grad() = torch::tensor({NAN, 0.0f, 0.0f});
  EXPECT_TRUE(scaler.unscale_and_check({w}, nullptr));

  precision::LossScaler restored;
  restored.load_state(scaler.state());
  EXPECT_DOUBLE_EQ(restored.scale_value(), 8.0);
  EXPECT_EQ(restored.skipped_steps(), 1);

  scaler.update(true);  // 4
  scaler.update(true);  // 2
  scaler.update(true);  // 1
  try {
    scaler.update(true);  // 0.5 < min
    ADD_FAILURE() << "no error when the scale collapsed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("diverged"), std::string::npos);
  }
}

TEST(LossScaler, OverflowOnOneRankSkipsTheStepOnAll) {
  run_ranks(3, [](const comm::CommunicatorPtr& comm) {
    precision::LossScaler scaler;
    auto w = torch::ones({4}, torch::requires_grad());
    w.mutable_grad() = torch::ones({4});
    if (comm->rank() == 2) w.mutable_grad()[1] = INFINITY;
    EXPECT_TRUE(scaler.unscale_and_check({w}, comm));
    w.mutable_grad() = torch::ones({4});
    EXPECT_FALSE(scaler.unscale_and_check({w}, comm));
  });
}

namespace {
// Multiplies its output by inf on one rank at one step: a local overflow.
struct Poisoned : torch::nn::Module {
  Poisoned() { fc = register_module("fc", torch::nn::Linear(6, 3)); }
  at::Tensor forward(const at::Tensor& x) {
    auto y = fc(x);
    return poison ? y * std::numeric_limits<float>::infinity() : y;
  }
  torch::nn::Linear fc{nullptr};
  bool poison = false;
};
}  // namespace

TEST(LossScaler, DdpSkipsAnInjectedOverflowOnEveryRankAndStaysInSync) {
  at::set_num_threads(1);
  run_ranks(2, [](const comm::CommunicatorPtr& comm) {
    auto net = std::make_shared<Poisoned>();
    parallel::ddp::DdpStrategy ddp({.loss_scaling = "dynamic", .loss_scale_init = 1024});
    ddp.setup(Model(net), optim::optimizer_factory({}), std::make_shared<comm::ProcessGrid>(comm));
    data::Batch batch{torch::randn({4, 6}), torch::randint(0, 3, {4})};
    ddp.train_step({batch}, parallel::cross_entropy);
    const auto before = net->fc->weight.detach().clone();
    net->poison = comm->rank() == 1;
    auto result = ddp.train_step({batch}, parallel::cross_entropy);
    net->poison = false;
    EXPECT_EQ(result.metrics.at("step_skipped"), 1.0);
    EXPECT_EQ(result.metrics.at("skipped_steps"), 1.0);
    EXPECT_EQ(result.metrics.at("loss_scale"), 512.0);
    EXPECT_TRUE(torch::equal(net->fc->weight, before)) << "a skipped step changed the weights";
    result = ddp.train_step({batch}, parallel::cross_entropy);
    EXPECT_EQ(result.metrics.at("step_skipped"), 0.0);
    auto mine = net->fc->weight.detach().clone();
    auto root = mine.clone();
    comm->broadcast(root, {0})->wait();
    EXPECT_TRUE(torch::equal(mine, root)) << "replicas diverged";
    EXPECT_FALSE(torch::equal(mine, before));
  });
}

TEST(LossScaler, StateTravelsWithTheCheckpoint) {
  at::set_num_threads(1);
  const std::string dir = ::testing::TempDir() + "/dtrain-scaler-ckpt";
  std::filesystem::create_directories(dir);
  run_ranks(1, [&](const comm::CommunicatorPtr& comm) {
    auto net = std::make_shared<Poisoned>();
    parallel::ddp::DdpStrategy ddp({.loss_scaling = "dynamic", .loss_scale_init = 1024});
    ddp.setup(Model(net), optim::optimizer_factory({}), std::make_shared<comm::ProcessGrid>(comm));
    net->poison = true;
    ddp.train_step({{torch::randn({4, 6}), torch::randint(0, 3, {4})}}, parallel::cross_entropy);
    ddp.save(dir);

    auto fresh = std::make_shared<Poisoned>();
    parallel::ddp::DdpStrategy resumed({.loss_scaling = "dynamic", .loss_scale_init = 1024});
    resumed.setup(Model(fresh), optim::optimizer_factory({}),
                  std::make_shared<comm::ProcessGrid>(comm));
    EXPECT_EQ(resumed.loss_scaler()->scale_value(), 1024.0);
    resumed.load(dir);
    EXPECT_EQ(resumed.loss_scaler()->scale_value(), 512.0);
    EXPECT_EQ(resumed.loss_scaler()->skipped_steps(), 1);
  });
  std::filesystem::remove_all(dir);
}

TEST(Precision, Bf16MixedKeepsFp32MasterWeightsAndTracksFp32) {
  at::set_num_threads(1);
  models::ModelSpec spec;
  spec.name = "mlp";
  spec.input_shape = {32};
  spec.hidden = {64};
  auto data = data::make_synthetic(256, {32}, 10, 1);
  const auto everything = data.slice(0, 256);
  std::map<std::string, std::pair<double, double>> losses;  // full-data loss before, after
  for (const std::string mode : {"fp32", "bf16-mixed", "bf16"}) {
    // Rank threads share LibTorch's generator: build both replicas before they start (seeding
    // inside the threads raced, so rank 0's initial model varied from run to run).
    std::vector<Model> replicas;
    for (int r = 0; r < 2; ++r) {
      torch::manual_seed(4);
      replicas.push_back(models::make_model(spec));
    }
    run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
      parallel::ddp::DdpStrategy ddp({.precision = mode});
      optim::OptimizerSpec sgd;
      sgd.lr = 0.1;
      ddp.setup(replicas[comm->rank()], optim::optimizer_factory(sgd),
                std::make_shared<comm::ProcessGrid>(comm));
      auto full_loss = [&] {
        torch::NoGradGuard no_grad;
        auto inputs = mode == "bf16" ? everything.inputs.to(torch::kBFloat16) : everything.inputs;
        return parallel::cross_entropy(ddp.model()(inputs), everything.targets).item<double>();
      };
      const double before = full_loss();
      for (int step = 0; step < 40; ++step) {
        const int64_t begin = step % 4 * 64 + comm->rank() * 32;
        ddp.train_step({data.slice(begin, begin + 32)}, parallel::cross_entropy);
      }
      if (comm->rank() == 0) losses[mode] = {before, full_loss()};
      for (const auto& p : ddp.model().module->parameters()) {
        EXPECT_EQ(p.scalar_type(), mode == "bf16" ? torch::kBFloat16 : torch::kFloat) << mode;
        EXPECT_EQ(p.grad().scalar_type(), p.scalar_type()) << mode;
      }
    });
  }
  for (const std::string mode : {"fp32", "bf16-mixed", "bf16"}) {
    EXPECT_LT(losses[mode].second, losses[mode].first * 0.8) << mode << " did not train";
  }
  // Mixed precision follows the fp32 trajectory closely; it is not identical (bf16 matmuls).
  EXPECT_NEAR(losses["bf16-mixed"].second, losses["fp32"].second, 0.05);
  EXPECT_NE(losses["bf16-mixed"].second, losses["fp32"].second);
}

namespace {
torch::nn::Sequential dropout_net() {
  torch::nn::Sequential net;
  for (int i = 0; i < 6; ++i) {
    net->push_back(torch::nn::Linear(16, 16));
    net->push_back(torch::nn::Dropout(0.3));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

std::vector<at::Tensor> grads_of(const torch::nn::Sequential& net, int64_t segments,
                                 const at::Tensor& x, Precision mode = Precision::Fp32) {
  for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
  torch::manual_seed(77);  // the same dropout masks for every variant
  at::Tensor y;
  {
    precision::AutocastScope autocast(mode);
    y = memory::checkpoint_sequential(net, segments, x);
  }
  y.pow(2).sum().backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
  return grads;
}
}  // namespace

TEST(Checkpointing, GradientsAreExactlyEqualWithDropout) {
  auto net = dropout_net();
  auto x = torch::randn({8, 16}, torch::requires_grad());
  const auto expected = grads_of(net, 0, x);
  for (int64_t segments : {2, 3, 5, 18}) {
    const auto got = grads_of(net, segments, x);
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(torch::equal(expected[i], got[i])) << "segments " << segments << " param " << i;
    }
  }
  // Input gradients flow through the checkpoint too.
  auto a = torch::randn({4, 16}, torch::requires_grad());
  memory::checkpoint_sequential(net, 3, a).sum().backward();
  EXPECT_TRUE(a.grad().defined());
  EXPECT_GT(a.grad().abs().sum().item<double>(), 0.0);
}

TEST(Checkpointing, ExactUnderAutocast) {
  auto net = dropout_net();
  auto x = torch::randn({8, 16});
  const auto expected = grads_of(net, 0, x, Precision::Bf16Mixed);
  const auto got = grads_of(net, 3, x, Precision::Bf16Mixed);
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::equal(expected[i], got[i]));
}

TEST(Checkpointing, WorksWithDdpOverlapHooks) {
  at::set_num_threads(1);
  // Rank threads share LibTorch's RNG: models and batches are made before they start.
  torch::manual_seed(6);
  std::vector<std::vector<data::Batch>> batches(2);
  for (auto& rank_batches : batches) {
    for (int step = 0; step < 3; ++step) {
      rank_batches.push_back({torch::randn({4, 1, 12, 12}), torch::randint(0, 10, {4})});
    }
  }
  for (const std::string model : {"mlp", "cnn", "resnet"}) {
    std::map<std::string, std::vector<at::Tensor>> weights;
    for (const std::string checkpointing : {"none", "sqrt"}) {
      models::ModelSpec spec;
      spec.name = model;
      spec.input_shape = {1, 12, 12};
      spec.hidden = {32, 32, 32};
      spec.checkpointing = checkpointing;
      std::vector<Model> replicas;
      for (int r = 0; r < 2; ++r) {
        torch::manual_seed(5);
        replicas.push_back(models::make_model(spec));
      }
      run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
        parallel::ddp::DdpStrategy ddp({.bucket_cap_bytes = 4096});
        ddp.setup(replicas[comm->rank()], optim::optimizer_factory({}),
                  std::make_shared<comm::ProcessGrid>(comm));
        for (const auto& batch : batches[comm->rank()]) {
          ddp.train_step({batch}, parallel::cross_entropy);
          EXPECT_TRUE(ddp.reducer().stats().unused_parameters.empty());
        }
        if (comm->rank() == 0) {
          for (const auto& p : ddp.model().module->parameters()) {
            weights[checkpointing].push_back(p.detach().clone());
          }
        }
      });
    }
    ASSERT_EQ(weights["none"].size(), weights["sqrt"].size());
    for (size_t i = 0; i < weights["none"].size(); ++i) {
      EXPECT_TRUE(torch::allclose(weights["none"][i], weights["sqrt"][i], 1e-5, 1e-6))
          << model << " param " << i;
    }
  }
}

TEST(Checkpointing, SegmentCounts) {
  EXPECT_EQ(memory::sqrt_segments(32), 6);
  EXPECT_EQ(memory::sqrt_segments(1), 1);
  EXPECT_EQ(memory::parse_segments("none", 32), 0);
  EXPECT_EQ(memory::parse_segments("sqrt", 32), 6);
  EXPECT_EQ(memory::parse_segments("4", 32), 4);
  EXPECT_THROW(memory::parse_segments("lots", 32), InputError);
  EXPECT_THROW(memory::parse_segments("0", 32), InputError);
}
