// Activation memory measured with a counting allocator (every CPU tensor of this binary goes
// through it): what a GPT block keeps for backward without recomputation and with selective
// recomputation of attention's core, against Korthikanti et al. 2022's accounting.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../bench/BenchMemory.h"
#include "dtrain/models/Gpt.h"

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
