// The planner on transformers: selective recomputation and FlashAttention against their papers'
// accounting, and published layouts it must keep reproducing.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "PlanClusters.h"
#include "dtrain/common/Error.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {
namespace {

using test::cluster_of;

// Selective recomputation (Korthikanti et al. 2022): a GPT-3 block keeps s b h (34 + 5 a s / h)
// bytes at 16 bits, 34 s b h with attention's core recomputed; the recomputation costs a few
// percent of the step's compute (their 2-4%), whole-layer recomputation about a third more.
TEST(Planner, SelectiveRecomputationKeepsKorthikantisShareForAFewPercent) {
  const ModelCost model =
      model_named("transformer:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200");
  const Layer& block = model.layers[1];
  const double s = 2048, h = 12288, a = 96;
  // In 16-bit elements: 17 s h (34 s h bytes) stay, 2.5 a s^2 (5 a s^2 bytes) go.
  EXPECT_DOUBLE_EQ(block.saved_elements - block.attention_saved_elements, 17 * s * h);
  EXPECT_DOUBLE_EQ(block.attention_saved_elements, 2.5 * a * s * s);
  Layout layout;
  layout.strategy = "zero1";
  layout.tp = 8;
  layout.pp = 8;
  layout.dp = 72;
  layout.schedule = "interleaved";
  layout.chunks = 6;
  layout.micro_batches = 16;
  layout.sequence_parallel = true;
  const Cluster cluster = cluster_of("h100-dgx", 576);
  const Prediction none = predict(model, cluster, layout);
  layout.selective_recompute = true;
  const Prediction selective = predict(model, cluster, layout);
  layout.checkpointing = true;
  const Prediction full = predict(model, cluster, layout);
  // The blocks' share: 34 / (34 + 5 a s / h) = 34 / 114 (the embedding and head add a little).
  const double share = selective.memory.activations / none.memory.activations;
  EXPECT_GT(share, 34.0 / 114);
  EXPECT_LT(share, 1.05 * 34.0 / 114);
  const double extra = selective.compute_s / none.compute_s - 1;
  EXPECT_GT(extra, 0.005);
  EXPECT_LT(extra, 0.04);
  EXPECT_GT(full.compute_s / none.compute_s - 1, 0.2);
  EXPECT_LT(full.memory.activations, selective.memory.activations);
  // dtrain's flag for it.
  EXPECT_NE(Layout(layout).train_flags(98).find("--checkpointing 98"), std::string::npos);
  layout.checkpointing = false;
  EXPECT_NE(layout.train_flags(98).find("--checkpointing selective"), std::string::npos);
  EXPECT_NE(layout.describe().find(" selective"), std::string::npos);
  // A model without attention has nothing to recompute selectively.
  Layout cnn;
  cnn.selective_recompute = true;
  EXPECT_THROW(predict(model_named("resnet50"), cluster_of("h100-dgx", 1, 1), cnn), InputError);
}

// flash=1: attention's core as one FlashAttention kernel. Its blocks keep no score tensors (the
// 5 a s / h term goes; a log-sum-exp per row stays), compute only the causal half of the scores
// and compute them again in backward; the model's flops (what MFU counts) stay the same.
TEST(Planner, FlashAttentionKeepsNoScoresAndComputesTheCausalHalf) {
  const std::string shape = "transformer:layers=24,hidden=2048,heads=16,seq=4096,vocab=131072";
  const ModelCost fused = model_named(shape);
  const ModelCost flash = model_named(shape + ",flash=1");
  const Layer& block = flash.layers[1];
  const double s = 4096, h = 2048, a = 16;
  EXPECT_DOUBLE_EQ(block.saved_elements, 17 * s * h + 2 * a * s);
  EXPECT_DOUBLE_EQ(fused.layers[1].saved_elements, 17 * s * h + 2.5 * a * s * s);
  EXPECT_DOUBLE_EQ(block.skipped_flops, 2 * s * s * h);
  EXPECT_DOUBLE_EQ(block.recomputed_backward_flops, s * s * h);
  EXPECT_EQ(block.attention_saved_elements, 0);  // nothing for selective recomputation
  EXPECT_DOUBLE_EQ(flash.model_flops_per_sample(), fused.model_flops_per_sample());
  Layout layout;
  layout.strategy = "zero1";
  layout.dp = 8;
  layout.micro_batches = 4;
  const Cluster cluster = cluster_of("h100-dgx", 1);
  const Prediction with_scores = predict(fused, cluster, layout);
  const Prediction with_flash = predict(flash, cluster, layout);
  // At s = 2h the scores' traffic is most of a block's element-wise time and their memory most
  // of its activations: flash is faster and keeps a small fraction.
  EXPECT_LT(with_flash.compute_s, 0.8 * with_scores.compute_s);
  EXPECT_LT(with_flash.memory.activations, 0.25 * with_scores.memory.activations);
  EXPECT_GT(with_flash.mfu, with_scores.mfu);
  EXPECT_THROW(model_named(shape + ",flash=2"), InputError);
  // The search divides the blocks into every interleaving depth as for the fused model; only
  // selective recomputation (nothing to drop) is left out: 2 of every 3 layouts.
  SearchOptions options;
  options.global_batch = 64;
  options.strategies = {"ddp", "zero1"};
  const SearchResult searched_fused = search(fused, cluster_of("h100-dgx", 2), options);
  const SearchResult searched_flash = search(flash, cluster_of("h100-dgx", 2), options);
  EXPECT_EQ(3 * searched_flash.considered, 2 * searched_fused.considered);
  EXPECT_TRUE(std::any_of(searched_flash.ranked.begin(), searched_flash.ranked.end(),
                          [](const Prediction& p) { return p.layout.chunks > 2; }));
}

// Two published results the planner must keep reproducing within 20% (BENCHMARKS.md has all).
TEST(Published, NarayananTrillionParametersOn3072A100s) {
  // Narayanan et al. 2021, Table 1: 1008B parameters, TP 8 x PP 64 on 3072 A100s, batch 3072:
  // 163 TFLOP/s per GPU by their formula 96 B s l h^2 (1 + s / 6h + V / 16lh).
  Layout layout;
  layout.tp = 8;
  layout.pp = 64;
  layout.dp = 6;
  layout.micro_batches = 512;
  layout.schedule = "interleaved";
  layout.chunks = 2;
  layout.precision = "fp16-master";
  layout.checkpointing = true;
  const Prediction p = predict(model_named("gpt-1t"), cluster_of("a100-selene", 384), layout);
  const double s = 2048, l = 128, h = 25600, v = 51200;
  const double flops = 96 * 3072 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
  const double tflops = flops / p.step_s / 3072 / 1e12;
  EXPECT_NEAR(tflops / 163, 1.0, 0.2) << tflops;
  EXPECT_TRUE(p.fits);
}

TEST(Published, SearchPicksMegatronsLayoutForTheTrillion) {
  // With the paper's means (data parallelism without sharding, no sequence parallelism), the
  // search ranks the paper's layout first: TP 8 (a node) x PP 64, interleaved.
  SearchOptions options;
  options.global_batch = 3072;
  options.strategies = {"ddp"};
  options.precision = "fp16-master";
  const SearchResult result =
      search(model_named("gpt-1t"), cluster_of("a100-selene", 384), options);
  ASSERT_FALSE(result.ranked.empty());
  const Layout& best = result.ranked.front().layout;
  EXPECT_EQ(best.tp, 8);
  EXPECT_EQ(best.pp, 64);
}

}  // namespace
}  // namespace dtrain::plan
