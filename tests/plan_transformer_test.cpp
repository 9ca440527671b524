// The planner on transformers: selective recomputation and FlashAttention against their papers'
// accounting, and published layouts it must keep reproducing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "PlanClusters.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {
namespace {

using test::cluster_of;

// Mixtral 8x7B's shape (configs/mixtral-8x7b.toml).
models::GptConfig mixtral_8x7b() {
  models::GptConfig mixtral;
  mixtral.layers = 32, mixtral.width = 4096, mixtral.heads = 32, mixtral.kv_heads = 8;
  mixtral.ffn_width = 14336, mixtral.context = 4096, mixtral.vocab = 32000;
  mixtral.rope_theta = 1e6, mixtral.moe_experts = 8, mixtral.moe_top_k = 2;
  models::llama_preset(mixtral);
  return mixtral;
}

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

// The h100-dgx profile's rates by shape are XLA's measured H100 table: at its sizes the figures
// themselves, between them log-linear, above them held, below them a narrower product no faster.
TEST(Hardware, MatmulRatesByShapeAreXlasH100Table) {
  const Hardware hw = cluster_of("h100-dgx", 1).hardware;
  const MatmulTable& table = hw.matmul_table;
  ASSERT_TRUE(table.has("bf16"));
  EXPECT_FALSE(table.has("fp16"));  // timed by efficiency.matmul
  EXPECT_NE(table.source.find("openxla/xla"), std::string::npos);
  // The quoted points of the table (bf16, m = n = k): 6.5, 40.7, 236.3, 632.0, 783.3.
  const std::vector<std::pair<double, double>> cubes = {
      {256, 6.5}, {512, 40.7}, {1024, 236.3}, {2048, 632.0}, {4096, 783.3}};
  for (const auto& [n, tflops] : cubes) {
    EXPECT_NEAR(table.rate("bf16", n, n, n), tflops * 1e12, 1e-9 * tflops * 1e12);
  }
  const double low = table.rate("bf16", 4096, 1024, 2048);
  const double high = table.rate("bf16", 4096, 1024, 4096);
  EXPECT_NEAR(table.rate("bf16", 4096, 1024, std::sqrt(2048.0 * 4096)), std::sqrt(low * high),
              1e-6 * high);
  EXPECT_DOUBLE_EQ(table.rate("bf16", 16384, 1024, 4096), high);
  EXPECT_NEAR(table.rate("bf16", 4096, 1024, 128), table.rate("bf16", 4096, 1024, 256) / 2, 1);
}

// With rates by shape, tensor parallelism's narrower products run further from the peak: the
// same block split 8 ways computes at a lower rate per GPU than whole, where one efficiency for
// every size made the split free (and the search preferred narrow TP, unlike Megatron).
TEST(Planner, TensorParallelSplitsRunAtTheirShapesRate) {
  const ModelCost model = model_named(
      "transformer:layers=24,hidden=2048,heads=16,seq=4096,vocab=131072,tied=0,flash=1");
  Cluster measured = cluster_of("h100-dgx", 1);
  Cluster flat = measured;
  flat.hardware.matmul_table = MatmulTable{};
  auto per_gpu_time = [&](const Cluster& cluster, int tp) {
    Layout layout;
    layout.tp = tp;
    layout.dp = 8 / tp;
    layout.precision = "bf16-master";
    return predict(model, cluster, layout).compute_s * tp;
  };
  const double flat_ratio = per_gpu_time(flat, 8) / per_gpu_time(flat, 1);
  const double measured_ratio = per_gpu_time(measured, 8) / per_gpu_time(measured, 1);
  EXPECT_GT(measured_ratio, flat_ratio * 1.05) << measured_ratio << " vs " << flat_ratio;
  // Large products reach the table's rate (about 0.75-0.8 of peak), as the flat profile says.
  Layout whole;
  whole.dp = 8;
  whole.precision = "bf16-master";
  EXPECT_NEAR(predict(model, measured, whole).compute_s / predict(model, flat, whole).compute_s,
              1.0, 0.1);
}

// Unless the user pins them, the search decides sequence parallelism and the two overlaps: each
// layout with them on wherever they apply, then the fastest layouts with every combination.
// They usually help, but not always (they move the stages' balance and the pipeline's timing):
// checked here over every layout of a small search, each predicted with them off and on.
TEST(Planner, TheSearchDecidesTheStepOptionsUnlessPinned) {
  const ModelCost model =
      model_named("transformer:layers=8,hidden=2048,heads=16,seq=4096,vocab=131072,tied=0,flash=1");
  SearchOptions options;
  options.global_batch = 32;
  options.precision = "bf16-master";
  options.sequence_parallel = options.overlap_param_gather = options.tp_comm_overlap = false;
  const Cluster cluster = cluster_of("h100-dgx", 2);
  const SearchResult off = search(model, cluster, options);
  ASSERT_GT(off.ranked.size(), 100u);
  auto all_on = [](Layout layout) {
    layout.tp_comm_overlap = layout.tp > 1;
    // (dtrain train refuses sequence parallelism with zero3, and so does the planner.)
    layout.sequence_parallel = layout.tp > 1 && layout.strategy != "zero3";
    layout.overlap_param_gather = layout.strategy == "zero1" || layout.strategy == "zero2";
    return layout;
  };
  int faster = 0, slower = 0;
  for (const Prediction& p : off.ranked) {
    EXPECT_FALSE(p.layout.sequence_parallel || p.layout.overlap_param_gather ||
                 p.layout.tp_comm_overlap);
    const Prediction q = predict(model, cluster, all_on(p.layout));
    faster += q.step_s < p.step_s * (1 - 1e-9);
    slower += q.step_s > p.step_s * (1 + 1e-9);
  }
  EXPECT_GT(faster, slower);
  EXPECT_GT(slower, 0);  // why the search tries both
  options.sequence_parallel = options.overlap_param_gather = options.tp_comm_overlap = std::nullopt;
  options.refine = off.ranked.size();  // (a small search: every layout's variants)
  const SearchResult searched = search(model, cluster, options);
  EXPECT_EQ(searched.considered, off.considered);
  EXPECT_GT(searched.variants, 0);
  EXPECT_EQ(off.variants, 0);
  EXPECT_LT(searched.ranked.front().step_s, off.ranked.front().step_s);
  // Each layout is the fastest of its variants that fit: all on, all off.
  for (size_t i = 0; i < searched.ranked.size(); ++i) {
    Layout plain = searched.ranked[i].layout;
    plain.sequence_parallel = plain.overlap_param_gather = plain.tp_comm_overlap = false;
    for (const Layout& variant : {plain, all_on(plain)}) {
      const Prediction v = predict(model, cluster, variant);
      if (v.fits) {
        EXPECT_LE(searched.ranked[i].step_s, v.step_s) << variant.describe();
      }
    }
  }
}

// The planner's decoder is dtrain's: from the same flags (a config file's shape), its parameters
// are what dtrain train builds and its flops what the trainer's MFU counts, for GPT-2's
// architecture and Llama's (grouped-query attention, SwiGLU, RMSNorm, rotary, no biases).
TEST(Planner, DecodersAreWhatDtrainTrainBuilds) {
  models::GptConfig gpt;
  gpt.layers = 6, gpt.width = 384, gpt.heads = 6, gpt.context = 256, gpt.vocab = 50257;
  gpt.tied_embeddings = true;
  gpt.dropout = 0.1;
  models::GptConfig llama;  // configs/llama-1b.toml
  llama.layers = 16, llama.width = 2048, llama.heads = 32, llama.kv_heads = 8;
  llama.ffn_width = 8192, llama.context = 2048, llama.vocab = 128256;
  llama.tied_embeddings = true, llama.rope_theta = 500000;
  models::llama_preset(llama);
  for (const models::GptConfig& config : {gpt, llama}) {
    const ModelCost cost =
        decoder(config, config.mlp == "swiglu" ? "llama" : "gpt", config.vocab, true);
    EXPECT_EQ(cost.parameters(), models::gpt_parameter_count(config)) << cost.name;
    EXPECT_NEAR(cost.model_flops_per_sample() / config.context,
                models::gpt_training_flops_per_token(config),
                1e-12 * models::gpt_training_flops_per_token(config))
        << cost.name;
  }
  EXPECT_EQ(models::gpt_parameter_count(llama), 1235814400);  // Llama 3.2 1B: 1.24 B
  const ModelCost cost = decoder(llama, "llama", llama.vocab, true);
  EXPECT_EQ(cost.kv_heads, 8);
  EXPECT_EQ(cost.train_flags,
            "--model llama --layers 16 --width 2048 --heads 32 --kv-heads 8 --ffn-width 8192 "
            "--context 2048 --tied-embeddings --rope-theta 500000");
  // TP must divide the key/value heads or be a multiple of them, as dtrain train's: 6 ranks
  // split 12 heads, not 4 key/value heads.
  models::GptConfig grouped = llama;
  grouped.heads = 12, grouped.kv_heads = 4, grouped.width = 768;
  const ModelCost twelve = decoder(grouped, "llama", grouped.vocab, true);
  Layout layout;
  layout.tp = 6;
  try {
    predict(twelve, cluster_of("h100-dgx", 1, 6), layout);
    ADD_FAILURE() << "tp 6 over 4 key/value heads was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("4 key/value heads: one must divide the other"), std::string::npos)
        << e.message();
  }
  layout.tp = 2;
  layout.dp = 3;
  EXPECT_NO_THROW(predict(twelve, cluster_of("h100-dgx", 1, 6), layout));
  // Its tied embedding under zero3 is refused by name, as dtrain train refuses it (the planner
  // printed such a command once); untied, zero3 plans.
  Layout sharded;
  sharded.strategy = "zero3";
  sharded.dp = 8;
  try {
    predict(cost, cluster_of("h100-dgx", 1), sharded);
    ADD_FAILURE() << "zero3 with a tied embedding was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("--tied-embeddings with zero3"), std::string::npos) << e.message();
  }
  models::GptConfig untied = llama;
  untied.tied_embeddings = false;
  EXPECT_NO_THROW(
      predict(decoder(untied, "llama", untied.vocab, true), cluster_of("h100-dgx", 1), sharded));
}

// Qwen3-30B-A3B's shape (configs/qwen3-30b-a3b.toml): heads 128 wide where width / heads is 64,
// per-head query/key norms. The planner counts the parameters and flops dtrain train builds and
// counts (the query and output projections heads x 128 wide), and prints the flags that build it.
TEST(Planner, HeadsWiderThanWidthOverHeadsCountAsBuilt) {
  models::GptConfig qwen;
  qwen.layers = 48, qwen.width = 2048, qwen.heads = 32, qwen.kv_heads = 4, qwen.head_dim = 128;
  qwen.qk_norm = true, qwen.context = 4096, qwen.vocab = 151936, qwen.moe_experts = 128;
  qwen.moe_top_k = 8, qwen.moe_ffn_width = 768;
  models::llama_preset(qwen);
  for (const bool flash : {false, true}) {
    const ModelCost cost = decoder(qwen, "llama", qwen.vocab, flash);
    EXPECT_EQ(cost.parameters(), models::gpt_parameter_count(qwen));
    EXPECT_NEAR(cost.model_flops_per_sample() / qwen.context,
                models::gpt_training_flops_per_token(qwen),
                1e-12 * models::gpt_training_flops_per_token(qwen));
    EXPECT_NE(cost.train_flags.find("--head-dim 128 --qk-norm"), std::string::npos)
        << cost.train_flags;
    // Attention's products on 32 x 128 columns, not 2048.
    models::GptConfig narrow = qwen;
    narrow.head_dim = 0;
    const ModelCost narrower = decoder(narrow, "llama", qwen.vocab, flash);
    EXPECT_GT(cost.model_flops_per_sample(), narrower.model_flops_per_sample());
    EXPECT_EQ(cost.layers[1].kv_elements, 2.0 * 4 * 128 * 4096);
  }
}

// A mixture of experts in the planner (issue 81), Mixtral 8x7B's shape: the decoder counts every
// expert's parameters and the active ones' flops, as dtrain train builds and counts them. Expert
// parallelism over ep ranks keeps 1/ep of the experts on a rank (and zero1 their optimizer state
// over the dp / ep ranks holding the same experts), and each MoE block's forward and backward
// exchange its tokens' k copies twice each way. The search tries every ep dividing the experts
// and the data-parallel ranks, and prints dtrain train's --expert-parallel.
TEST(Planner, MixturesOfExpertsCountActiveFlopsAndSplitTheirExperts) {
  const models::GptConfig mixtral = mixtral_8x7b();
  const ModelCost cost = decoder(mixtral, "llama", mixtral.vocab, true);
  EXPECT_EQ(cost.parameters(), models::gpt_parameter_count(mixtral));
  EXPECT_NEAR(cost.model_flops_per_sample() / mixtral.context,
              models::gpt_training_flops_per_token(mixtral),
              1e-12 * models::gpt_training_flops_per_token(mixtral));
  EXPECT_EQ(cost.experts, 8);
  EXPECT_NE(cost.train_flags.find("--moe-experts 8 --moe-top-k 2 --moe-ffn-width 14336"),
            std::string::npos)
      << cost.train_flags;
  double experts = 0;
  int moe_blocks = 0;
  for (const Layer& l : cost.layers) {
    experts += static_cast<double>(l.expert_parameters);
    moe_blocks += l.alltoall_elements > 0 ? 1 : 0;
  }
  EXPECT_EQ(moe_blocks, 32);
  const Cluster node = cluster_of("h100-dgx", 1);
  Layout whole;
  whole.strategy = "zero1";
  whole.dp = 8;
  whole.micro_batches = 2;
  Layout split = whole;
  split.ep = 8;
  const Prediction p1 = predict(cost, node, whole), p8 = predict(cost, node, split);
  const double total = static_cast<double>(cost.parameters());
  EXPECT_NEAR(p1.memory.parameters, total * 4, 1e-6 * total);  // fp32 weights (bf16-mixed)
  EXPECT_NEAR(p8.memory.parameters, (total - experts + experts / 8) * 4, 1e-6 * total);
  // zero1's Adam state: the dense part over 8 ranks, each rank's experts over 8 / 8 = 1.
  EXPECT_NEAR(p8.memory.optimizer, ((total - experts) / 8 + experts / 8) * 8, 1e-6 * total);
  // The all-to-alls: 4 per MoE block and micro-batch, each (n-1)/n of the rank's tokens x k x
  // hidden in bf16 over NVLink. (In bf16, where no cast of the rank's weights changes with it.)
  Layout bf16 = whole;
  bf16.strategy = "ddp";
  bf16.precision = "bf16";
  Layout bf16_split = bf16;
  bf16_split.ep = 8;
  const Link& nvlink = node.hardware.intra_node;
  const double bytes = 4096.0 * 2 * 4096 * 2;
  const double exchange = bytes * 7 / 8 / nvlink.bandwidth_Bps + 7 * nvlink.latency_s;
  const double with = predict(cost, node, bf16_split).compute_s;
  EXPECT_NEAR(with - predict(cost, node, bf16).compute_s, 2 * 32 * 4 * exchange, 1e-6 * with);
  try {
    Layout odd = whole;
    odd.ep = 3;
    predict(cost, cluster_of("h100-dgx", 1, 6), odd);
    ADD_FAILURE() << "ep 3 over 8 experts was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("does not divide the model's 8 experts"), std::string::npos)
        << e.message();
  }
  // The search, on a smaller mixture (8 experts of width 1024) over 8 GPUs: layouts with the
  // experts split are among those ranked, each a split dtrain train accepts.
  models::GptConfig small = mixtral;
  small.layers = 4, small.width = 1024, small.heads = 8, small.kv_heads = 8, small.ffn_width = 1024;
  small.context = 1024;
  SearchOptions options;
  options.global_batch = 16;
  options.allow_checkpointing = false;
  options.allow_offload = false;
  options.refine = 4;
  const SearchResult result =
      search(decoder(small, "llama", small.vocab, true), cluster_of("h100-dgx", 1), options);
  int with_experts_split = 0;
  for (const Prediction& p : result.ranked) {
    if (p.layout.ep == 1) continue;
    ++with_experts_split;
    EXPECT_EQ(p.layout.dp % p.layout.ep, 0);
    EXPECT_EQ(8 % p.layout.ep, 0);
    EXPECT_NE(p.layout.command(cost, node).find(concat("--expert-parallel ", p.layout.ep)),
              std::string::npos);
  }
  EXPECT_GT(with_experts_split, 0);
}

// DualPipe-V in the planner (issue 81): a pair's forward and backward run on two threads, each
// one's expert all-to-alls hidden behind the other's compute. Without experts to exchange with
// (ep 1) the pairs hide nothing: the busiest rank computes what it computes under zb-v, the same
// V without pairs. With Mixtral's experts split over 8 ranks, it computes less, by no more than
// the step's all-to-alls (what ep 8 adds to zb-v's). (Its step: that, plus the bubble its
// both-inputs-first rule costs; on one node's NVLink the exchanges are too short for the pairs
// to win it back: docs/benchmarks/moe.md.)
TEST(Planner, DualPipeVsPairsHideTheirAllToAlls) {
  const models::GptConfig mixtral = mixtral_8x7b();
  const ModelCost cost = decoder(mixtral, "llama", mixtral.vocab, true);
  const Cluster nodes = cluster_of("h100-dgx", 4);
  Layout layout;
  layout.strategy = "zero1";
  layout.dp = 8;
  layout.pp = 4;
  layout.micro_batches = 8;
  layout.chunks = 2;
  layout.precision = "bf16";
  auto compute = [&](const std::string& schedule, int ep) {
    Layout l = layout;
    l.schedule = schedule;
    l.ep = ep;
    return predict(cost, nodes, l).compute_s;
  };
  const double plain = compute("zb-v", 1);
  EXPECT_NEAR(compute("dualpipev", 1), plain, 1e-9 * plain);
  const double zbv = compute("zb-v", 8), dualpipev = compute("dualpipev", 8);
  EXPECT_LT(dualpipev, zbv - 1e-3 * (zbv - plain));
  EXPECT_LE(zbv - dualpipev, zbv - plain + 1e-9 * plain);
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
  // With the paper's means (data parallelism without sharding, no sequence parallelism, 1F1B
  // and its interleaved form), the search ranks the paper's layout first: TP 8 (a node) x PP 64,
  // interleaved.
  SearchOptions options;
  options.global_batch = 3072;
  options.strategies = {"ddp"};
  options.schedules = {"1f1b", "interleaved"};
  options.precision = "fp16-master";
  options.sequence_parallel = options.tp_comm_overlap = false;
  const SearchResult result =
      search(model_named("gpt-1t"), cluster_of("a100-selene", 384), options);
  ASSERT_FALSE(result.ranked.empty());
  const Layout& best = result.ranked.front().layout;
  EXPECT_EQ(best.tp, 8);
  EXPECT_EQ(best.pp, 64);
}

// Context parallelism in the planner (issue 82): a rank of a context group of C computes and
// keeps 1/C of each sample (its activations 1/C of one rank's without the split, at the same
// samples per replica), the gradients reduced over dp x cp; the ring's transfers hide behind a
// block of attention where it is long enough (Llama 3 8B at 131072 tokens: the same step as the
// compute alone), the all-gather and Ulysses' all-to-alls add their time; the search splits a
// long sequence that does not fit one rank, and the refusals are named.
TEST(Planner, ContextParallelismSplitsTheSequenceAndHidesTheRing) {
  models::GptConfig llama;  // Llama 3 8B
  llama.layers = 32, llama.width = 4096, llama.heads = 32, llama.kv_heads = 8;
  llama.ffn_width = 14336, llama.context = 131072, llama.vocab = 128256, llama.rope_theta = 5e5;
  models::llama_preset(llama);
  const ModelCost cost = decoder(llama, "llama", llama.vocab, true);
  Layout one;
  one.strategy = "zero1";
  one.precision = "bf16";
  one.tp = 8;
  one.sequence_parallel = true;
  one.micro_batches = 2;
  Layout split = one;
  split.cp = 4;
  const Prediction p1 = predict(cost, cluster_of("h100-dgx", 1), one);
  const Prediction p4 = predict(cost, cluster_of("h100-dgx", 4), split);
  EXPECT_EQ(split.ranks(), 32);
  EXPECT_NEAR(p4.memory.activations, p1.memory.activations / 4, 1e-9 * p1.memory.activations);
  EXPECT_EQ(p4.layout.describe(), "zero1 dp1 pp1 tp8 cp4 mb1x2 bf16 sp");
  EXPECT_EQ(p4.samples_per_s * p4.step_s, 2);  // the global batch: samples, not their shares
  // zero1's shards over the 4 context ranks: a quarter of the optimizer's state.
  EXPECT_NEAR(p4.memory.optimizer, p1.memory.optimizer / 4, 1e-9 * p1.memory.optimizer);
  // The ring hidden: the step is the work of a quarter of each sample (and the optimizer's
  // shard and the gradient reduction over 4 ranks), about a quarter of one rank's step.
  EXPECT_LT(p4.step_s, 0.3 * p1.step_s);
  Layout gathered = split, ulysses = split;
  gathered.cp_method = "allgather";
  ulysses.cp_method = "ulysses";
  EXPECT_GT(predict(cost, cluster_of("h100-dgx", 4), gathered).compute_s, p4.compute_s);
  EXPECT_GT(predict(cost, cluster_of("h100-dgx", 4), ulysses).compute_s, p4.compute_s);
  EXPECT_NE(split.train_flags(34).find("--context-parallel 4"), std::string::npos);
  // The search at 131072 tokens on 32 GPUs: a layout that fits splits the sequence.
  SearchOptions options;
  options.global_batch = 4;
  options.strategies = {"zero1"};
  const SearchResult found = search(cost, cluster_of("h100-dgx", 4), options);
  ASSERT_FALSE(found.ranked.empty());
  EXPECT_GT(found.ranked.front().layout.cp, 1) << found.ranked.front().layout.describe();
  Layout odd = split;
  odd.cp = 3;
  odd.tp = 1;
  odd.sequence_parallel = false;
  try {
    predict(cost, cluster_of("h100-dgx", 1, 3), odd);
    ADD_FAILURE() << "cp 3 was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("cuts the 131072 tokens of a sample into 6 chunks"),
              std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace dtrain::plan
