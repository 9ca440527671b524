// Memory measured with a counting allocator (every CPU tensor of this binary goes through it):
// what a GPT block keeps for backward without recomputation and with selective recomputation of
// attention's core, against Korthikanti et al. 2022's accounting; what ZeRO-3's setup holds.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../bench/BenchMemory.h"
#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/DeferredInit.h"
#include "parallel/zero/Zero3Strategy.h"

using namespace dtrain;

namespace {

bench::CountingAllocator counting;
// Before any tensor of the binary is made.
const bool installed = [] {
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  return true;
}();

struct Shape {
  int64_t batch = 2, sequence = 64, width = 64, heads = 8;
};

// Bytes a forward of a `layers`-block GPT keeps until its backward (its output included).
int64_t kept_by_forward(const Shape& shape, int64_t layers, const std::string& checkpointing) {
  models::GptConfig c;
  c.vocab = 16;
  c.layers = layers;
  c.heads = shape.heads;
  c.width = shape.width;
  c.context = shape.sequence;
  c.dropout = 0.1;  // the written-out attention on every LibTorch (SDPA has no dropout here)
  c.checkpointing = checkpointing;
  torch::manual_seed(3);
  Model model = models::make_gpt(c);
  model.module->train();
  const at::Tensor ids = at::randint(16, {shape.batch, shape.sequence}, at::kLong);
  const int64_t before = bench::CountingAllocator::bytes_in_use();
  at::Tensor out = model(ids);
  const int64_t kept = bench::CountingAllocator::bytes_in_use() - before;
  out.sum().backward();
  return kept;
}

// What one block keeps: the difference of a 3-block and a 1-block model, halved.
double per_block(const Shape& shape, const std::string& checkpointing) {
  return (kept_by_forward(shape, 3, checkpointing) - kept_by_forward(shape, 1, checkpointing)) /
         2.0;
}

}  // namespace

// Korthikanti et al.: a block keeps s b h (34 + 5 a s / h) bytes at 16 bits with 1-byte dropout
// masks; selective recomputation drops the 5 a s^2 b (scores' softmax, its dropout mask and
// output), leaving 34 s b h. Measured here in fp32 (4-byte activations, 1-byte masks): the
// 16-bit formula's activations doubled, its masks not.
TEST(ActivationMemory, SelectiveRecomputationKeepsKorthikantisShare) {
  at::set_num_threads(1);
  ASSERT_TRUE(installed);
  const Shape shape;
  const double s = shape.sequence, b = shape.batch, h = shape.width, a = shape.heads;
  const double none = per_block(shape, "none");
  const double selective = per_block(shape, "selective");
  const double full = per_block(shape, "3");
  // Korthikanti's terms in fp32: 34 sbh = 30 sbh of activations (2 bytes each) and 4 sbh of
  // masks (1 byte); 5 a s^2 b = 4 of softmax output and its dropout output, 1 of mask.
  const double kept_sbh = (30 * 2 + 4) * s * b * h;
  const double kept_attention = (4 * 2 + 1) * a * s * s * b;
  std::printf("per block: none %.0f bytes (formula %.0f), selective %.0f (formula %.0f), "
              "3 segments %.0f\n",
              none, kept_sbh + kept_attention, selective, kept_sbh, full);
  EXPECT_NEAR(none / (kept_sbh + kept_attention), 1.0, 0.05);
  EXPECT_NEAR(selective / kept_sbh, 1.0, 0.08);
  // What selective recomputation saves is the attention term.
  EXPECT_NEAR((none - selective) / kept_attention, 1.0, 0.03);
  // Whole blocks recomputed (3 segments of 1 block) keep only each block's input.
  EXPECT_LT(full, 2 * 4 * s * b * h);
}

// ZeRO-3's setup (model built, shards cut, on 2 rank threads: the allocator counts both). Built
// whole, each rank holds the whole model before it keeps its shards; built as placeholders
// (Model::deferred), each rank draws only its shards: the setup's peak is what the ranks keep
// afterwards (their parameter shards; a gradient shard gets its memory at the first step) plus
// at most a parameter each, +10%.
TEST(SetupMemory, Zero3BuiltAsPlaceholdersNeverHoldsTheWholeModel) {
  at::set_num_threads(1);
  ASSERT_TRUE(installed);
  models::ModelSpec spec;
  spec.name = "llama";
  spec.gpt.vocab = 512;
  spec.gpt.layers = 4;
  spec.gpt.heads = 4;
  spec.gpt.width = 64;
  spec.gpt.context = 16;
  const int world = 2;
  int64_t model_bytes = 0, largest_bytes = 0;
  auto setup = [&](bool deferred, int64_t& kept, int64_t& peak) {
    std::vector<parallel::StrategyPtr> strategies(world);
    const int64_t before = bench::CountingAllocator::bytes_in_use();
    bench::CountingAllocator::reset_peak();
    std::vector<Model> models;
    spec.deferred = deferred;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(4);
      models.push_back(models::make_model(spec));
    }
    largest_bytes = 0;
    for (const auto& p : models[0].module->parameters()) {
      largest_bytes = std::max<int64_t>(largest_bytes, p.numel() * 4);
    }
    test::run_ranks(world, [&](const comm::CommunicatorPtr& comm) {
      strategies[comm->rank()] =
          std::make_unique<parallel::zero::Zero3Strategy>(parallel::StrategyOptions{});
      strategies[comm->rank()]->setup(models[comm->rank()], optim::optimizer_factory(test::adam()),
                                      std::make_shared<comm::ProcessGrid>(comm));
    });
    models.clear();
    kept = bench::CountingAllocator::bytes_in_use() - before;
    peak = bench::CountingAllocator::peak_bytes() - before;
  };
  int64_t eager_kept = 0, eager_peak = 0, kept = 0, peak = 0;
  setup(false, eager_kept, eager_peak);
  setup(true, kept, peak);
  model_bytes = models::gpt_parameter_count(models::decoder_config(spec)) * 4;
  std::printf(
      "zero3 setup on %d ranks: model %lld bytes, largest parameter %lld; built whole: "
      "peak %lld, kept %lld; as placeholders: peak %lld, kept %lld\n",
      world, static_cast<long long>(model_bytes), static_cast<long long>(largest_bytes),
      static_cast<long long>(eager_peak), static_cast<long long>(eager_kept),
      static_cast<long long>(peak), static_cast<long long>(kept));
  EXPECT_GE(eager_peak, world * model_bytes);  // the measure sees every whole model
  EXPECT_NEAR(static_cast<double>(kept), static_cast<double>(eager_kept), 0.02 * eager_kept);
  EXPECT_LE(peak, 1.1 * (kept + world * largest_bytes));
  EXPECT_LT(peak, eager_peak);
}
