// dtrain plan: the pieces it shares with training (the bucket rule, the schedule simulator with
// per-stage costs), the planner's rules checked against what they must equal (the bubble of
// equal stages, ZeRO's memory per stage, TP's all-reduces on the critical path, DP buckets
// hidden behind backward), its refusals, and two published results it must reproduce.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "PlanClusters.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/ddp/Buckets.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {
namespace {

namespace pp = parallel::pipeline;

using test::cluster_of;
using test::profiles;

TEST(PlanBuckets, ReverseOrderCapsAndTheFirstLayersOwnBucket) {
  // Parameters in model order (bytes, dtype, module); buckets fill from the last.
  const std::vector<parallel::ddp::BucketedParameter> params = {
      {400, 0, "first"}, {100, 0, "first"}, {600, 0, "mid"}, {300, 0, "last"}, {300, 0, "last"}};
  parallel::ddp::BucketRule rule{1000, 500, false};
  // First bucket closes at 500 bytes (4, 3), the next at 1000 (2, 1, 0 = 1100).
  EXPECT_EQ(parallel::ddp::assign_buckets(params, rule),
            (std::vector<std::vector<size_t>>{{4, 3}, {2, 1, 0}}));
  // Isolating the first module: 0 and 1 (500 bytes) leave the bucket whose rest (600) is larger.
  rule.isolate_first_layer = true;
  EXPECT_EQ(parallel::ddp::assign_buckets(params, rule),
            (std::vector<std::vector<size_t>>{{4, 3}, {2}, {1, 0}}));
  // One open bucket per dtype.
  const std::vector<parallel::ddp::BucketedParameter> mixed = {
      {10, 1, "a"}, {10, 0, "b"}, {10, 1, "c"}};
  EXPECT_EQ(parallel::ddp::assign_buckets(mixed, {1000, 1000, false}),
            (std::vector<std::vector<size_t>>{{2, 0}, {1}}));
  EXPECT_EQ(parallel::ddp::module_of("blocks.0.fc.weight"), "blocks.0.fc");
  EXPECT_EQ(parallel::ddp::module_of("bias"), "");
}

TEST(PlanSchedule, CostsPerStageAndTransfersBetweenRanks) {
  // GPipe, 2 stages, 1 micro-batch: F0 (1), send (0.5), F1 (2), B1 (4), send (0.5), B0 (3).
  const pp::ScheduleSpec spec{"gpipe", 2, 1, 1};
  const std::vector<std::vector<pp::Action>> lists = {pp::build_schedule(spec, 0),
                                                      pp::build_schedule(spec, 1)};
  pp::ActionCosts costs;
  costs.duration = [](int rank, const pp::Action& a) {
    return a.kind == pp::Action::Forward ? 1.0 + rank : 3.0 + rank;
  };
  costs.transfer = [](int, int, const pp::Action&) { return 0.5; };
  const auto sim = pp::simulate(spec, lists, costs);
  EXPECT_DOUBLE_EQ(sim.makespan, 11.0);
  EXPECT_DOUBLE_EQ(sim.starts[1][0], 1.5);  // rank 1's forward waits for the activation
  EXPECT_DOUBLE_EQ(sim.ends[0][1], 11.0);

  // With equal costs and no transfers it is the fixed-cost simulation.
  const pp::ScheduleSpec one{"1f1b", 4, 8, 1};
  std::vector<std::vector<pp::Action>> four;
  for (int r = 0; r < 4; ++r) four.push_back(pp::build_schedule(one, r));
  pp::ActionCosts equal;
  equal.duration = [](int, const pp::Action& a) {
    return a.kind == pp::Action::Forward ? 1.0 : 2.0;
  };
  EXPECT_DOUBLE_EQ(pp::simulate(one, four, equal).makespan, pp::simulate(one, four).makespan);
}

// A model of identical layers and a cluster whose links cost nothing: what the planner must
// give is known in closed form.
ModelCost uniform_model(int layers) {
  ModelCost model;
  model.name = "uniform";
  for (int i = 0; i < layers; ++i) {
    Layer layer;
    layer.name = concat("layer", i);
    layer.parameters = 1000;
    layer.matmul_flops = 1e9;
    layer.output_elements = 10;
    layer.saved_elements = 100;
    model.layers.push_back(layer);
  }
  return model;
}

Cluster ideal_cluster(int gpus) {
  Cluster cluster = cluster_of("a100-selene", 1, gpus);
  cluster.hardware.kernel_overhead_s = 0;
  cluster.hardware.intra_node = {0, 1e30};
  cluster.hardware.inter_node = {0, 1e30};
  return cluster;
}

TEST(Planner, EqualStagesGiveTheTextbookBubble) {
  const ModelCost model = uniform_model(16);
  for (const auto& [schedule, chunks] :
       {std::pair<std::string, int>{"1f1b", 1}, {"gpipe", 1}, {"interleaved", 2}}) {
    Layout layout;
    layout.pp = 4;
    layout.micro_batches = 8;
    layout.schedule = schedule;
    layout.chunks = chunks;
    layout.optimizer = "sgd";
    const Prediction p = predict(model, ideal_cluster(4), layout);
    const double formula = pp::bubble_formula({schedule, 4, 8, chunks});
    EXPECT_NEAR(p.bubble, formula, 1e-9) << schedule;
  }
}

// Zero bubble in the planner: W is the weight gradients' matmuls (a third of a layer's
// forward + backward matmuls here), so zb-h1 idles less than 1F1B; with activation
// checkpointing dtrain defers nothing (the recomputation computes W inside B): 1F1B's bubble.
TEST(Planner, ZeroBubbleIdlesLessUnlessLayersAreRecomputed) {
  const ModelCost model = uniform_model(16);
  auto bubble = [&](const std::string& schedule, bool checkpointing) {
    Layout layout;
    layout.pp = 4;
    layout.micro_batches = 8;
    layout.schedule = schedule;
    layout.chunks = schedule == "zb-v" ? 2 : 1;
    layout.optimizer = "sgd";
    layout.precision = "fp32";  // (under autocast dtrain defers nothing either)
    layout.checkpointing = checkpointing;
    return predict(model, ideal_cluster(4), layout).bubble;
  };
  const double one = bubble("1f1b", false), zb = bubble("zb-h1", false);
  EXPECT_LT(zb, 0.75 * one);
  EXPECT_GT(zb, 0.0);
  EXPECT_NEAR(bubble("zb-h1", true), bubble("1f1b", true), 1e-9);
  // ZB-V's two chunks per rank halve the warm-up's forwards again.
  const double v = bubble("zb-v", false);
  EXPECT_LT(v, 0.75 * zb);
  EXPECT_GT(v, 0.0);
}

// PipeDream's flush-free 1F1B: with equal stages and free links a steady step is M (F + B)
// with no bubble where 1F1B's is (P - 1) / (M + P - 1); 2bw holds two weight versions, async
// up to P - r + 1 and pays an update per micro-batch.
TEST(Planner, PipeDreamStepsWithoutAFlushHaveNoBubbleAndHoldWeightVersions) {
  const ModelCost model = uniform_model(16);
  auto predict_with = [&](const std::string& sync) {
    Layout layout;
    layout.pp = 4;
    layout.micro_batches = 8;
    layout.optimizer = "sgd";
    layout.pipeline_sync = sync;
    return predict(model, ideal_cluster(4), layout);
  };
  const Prediction flush = predict_with("flush"), two = predict_with("2bw"),
                   async = predict_with("async");
  EXPECT_NEAR(flush.bubble, 3.0 / 11.0, 1e-9);
  EXPECT_NEAR(two.bubble, 0.0, 1e-9);
  EXPECT_LT(two.step_s, flush.step_s);
  EXPECT_NEAR(two.memory.parameters, 2 * flush.memory.parameters, 1e-6);
  EXPECT_GT(async.optimizer_s, 7 * two.optimizer_s);  // 8 updates a step against 1
  EXPECT_GT(async.memory.parameters, two.memory.parameters);
  Layout bad;
  bad.pp = 2;
  bad.micro_batches = 4;
  bad.schedule = "gpipe";
  bad.pipeline_sync = "2bw";
  EXPECT_THROW(predict(model, ideal_cluster(2), bad), InputError);
  bad.schedule = "1f1b";
  bad.pipeline_sync = "sometimes";
  EXPECT_THROW(predict(model, ideal_cluster(2), bad), InputError);
}

// --search tries PipeDream's flush-free steps only when asked, beside the flushed layouts: on
// equal stages with free links a 2bw pipeline beats its flushed twin.
// The search's answer does not depend on the order it makes layouts in: equally fast ones rank
// by memory (zero2 keeps less than zero1), then by their description.
TEST(Planner, SearchRanksEquallyFastLayoutsTheSameWhateverTheirOrder) {
  const ModelCost model = uniform_model(16);
  SearchOptions options;
  options.global_batch = 32;
  options.optimizer = "sgd";
  options.precision = "fp32";
  options.allow_checkpointing = false;
  options.strategies = {"zero1", "zero2", "ddp"};
  options.schedules = {"1f1b", "gpipe"};
  const SearchResult one = search(model, ideal_cluster(4), options);
  options.strategies = {"ddp", "zero2", "zero1"};
  options.schedules = {"gpipe", "1f1b"};
  const SearchResult other = search(model, ideal_cluster(4), options);
  ASSERT_EQ(one.ranked.size(), other.ranked.size());
  int ties = 0;
  for (size_t i = 0; i < one.ranked.size(); ++i) {
    EXPECT_EQ(one.ranked[i].layout.describe(), other.ranked[i].layout.describe()) << i;
    if (i > 0 && std::llround(one.ranked[i].step_s * 1e9) ==
                     std::llround(one.ranked[i - 1].step_s * 1e9)) {
      ++ties;
      EXPECT_LE(one.ranked[i - 1].memory.total(), one.ranked[i].memory.total());
    }
  }
  EXPECT_GT(ties, 0);  // (what the rule is for)
}

TEST(Planner, SearchTriesPipeDreamOnlyWhenAsked) {
  const ModelCost model = uniform_model(16);
  SearchOptions options;
  options.global_batch = 32;
  options.strategies = {"ddp"};
  options.optimizer = "sgd";
  options.precision = "fp32";
  options.allow_checkpointing = false;
  auto syncs = [](const SearchResult& r) {
    std::set<std::string> seen;
    for (const auto& p : r.ranked) seen.insert(p.layout.pipeline_sync);
    return seen;
  };
  EXPECT_EQ(syncs(search(model, ideal_cluster(4), options)), std::set<std::string>{"flush"});
  options.pipeline_syncs = {"flush", "2bw"};
  const SearchResult both = search(model, ideal_cluster(4), options);
  EXPECT_EQ(syncs(both), (std::set<std::string>{"flush", "2bw"}));
  int compared = 0;
  for (const auto& a : both.ranked) {
    if (a.layout.pipeline_sync != "2bw") continue;
    for (const auto& b : both.ranked) {
      if (b.layout.pipeline_sync == "flush" && b.layout.pp == a.layout.pp &&
          b.layout.dp == a.layout.dp && b.layout.micro_batch_size == a.layout.micro_batch_size &&
          b.layout.schedule == "1f1b") {
        EXPECT_LT(a.step_s, b.step_s) << a.layout.describe();
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 0);
}

// PipeDream's layouts: a VGG-like model (a convolution with most of the compute and few
// parameters; then large fully-connected layers) on 3 GPUs over a slow link. Data parallelism
// all-reduces the large layers; a 2-stage pipeline idles behind its heavy first stage; the
// convolutions on two replicas and the dense layers on one beat both. The search finds it only when
// asked, and prints flags dtrain train takes.
TEST(Planner, ReplicatedStagesShareTheHeavyStageAndTheSearchFindsThem) {
  ModelCost model;
  model.name = "vgg-like";
  for (int i = 0; i < 4; ++i) {
    Layer layer;
    layer.name = concat(i < 2 ? "conv" : "fc", i);
    layer.parameters = i < 2 ? 1e5 : 5e7;
    layer.matmul_flops = i == 0 ? 4e11 : 1e10;
    layer.output_elements = 1000;
    layer.saved_elements = 10000;
    model.layers.push_back(layer);
  }
  Cluster cluster = ideal_cluster(3);
  cluster.hardware.intra_node = {1e-5, 2e9};
  Layout replicated;
  replicated.pp = 2;
  replicated.stage_replicas = {2, 1};
  replicated.micro_batches = 6;
  replicated.precision = "fp32";
  replicated.optimizer = "sgd";
  Layout piped = replicated;
  piped.stage_replicas = {};
  piped.pp = 3;
  Layout ddp = piped;
  ddp.pp = 1;
  ddp.dp = 3;
  ddp.micro_batches = 2;
  const Prediction r = predict(model, cluster, replicated), p = predict(model, cluster, piped),
                   d = predict(model, cluster, ddp);
  EXPECT_EQ(r.layout.global_batch(), d.layout.global_batch());
  EXPECT_LT(r.step_s, 0.8 * p.step_s) << p.layout.describe();
  EXPECT_LT(r.step_s, 0.8 * d.step_s) << d.layout.describe();
  EXPECT_EQ(r.stage_memory.size(), 3u);  // one per rank
  EXPECT_EQ(r.layout.describe(), "ddp pp2 replicas 2,1 tp1 1f1b mb1x6 fp32");
  EXPECT_EQ(r.layout.train_flags(4),
            "--nproc 3 --strategy ddp --stage-replicas 2,1 --schedule 1f1b --pipeline-balance "
            "time --batch-size 1 --micro-batches 6 --precision fp32");

  SearchOptions options;
  options.global_batch = 6;
  options.strategies = {"ddp"};
  options.optimizer = "sgd";
  options.precision = "fp32";
  options.allow_checkpointing = false;
  const SearchResult grid_only = search(model, cluster, options);
  for (const auto& q : grid_only.ranked) EXPECT_TRUE(q.layout.stage_replicas.empty());
  options.replicated_stages = true;
  const SearchResult with = search(model, cluster, options);
  EXPECT_GT(with.considered, grid_only.considered);
  ASSERT_FALSE(with.ranked.empty());
  EXPECT_FALSE(with.ranked.front().layout.stage_replicas.empty())
      << with.ranked.front().layout.describe();
  EXPECT_LT(with.ranked.front().step_s, grid_only.ranked.front().step_s);

  Layout bad = replicated;
  bad.stage_replicas = {2, 1, 1};
  EXPECT_THROW(predict(model, cluster, bad), InputError);  // 3 counts for pp 2
  bad = replicated;
  bad.micro_batches = 1;
  bad.schedule = "gpipe";
  EXPECT_THROW(predict(model, cluster, bad), InputError);  // a replica without a micro-batch
  bad = replicated;
  bad.strategy = "zero1";
  EXPECT_THROW(predict(model, cluster, bad), InputError);
}

namespace {
// The planner's model states (parameters, gradients, optimizer) per rank of gpt-7.5b at DP 64 in
// `precision`, against `expected` bytes per strategy.
void expect_model_states(
    const std::string& precision, const Cluster& cluster,
    const std::function<std::map<std::string, double>(double, double)>& bytes_of) {
  const ModelCost model = model_named("gpt-7.5b");
  const double psi = model.parameters(), n = 64;
  for (const auto& [strategy, bytes] : bytes_of(psi, n)) {
    Layout layout;
    layout.strategy = strategy;
    layout.dp = 64;
    layout.precision = precision;
    const Memory m = predict(model, cluster, layout).memory;
    EXPECT_NEAR((m.parameters + m.gradients + m.optimizer) / bytes, 1.0, 1e-9)
        << precision << " " << strategy;
  }
}
}  // namespace

TEST(Planner, ModelStatesPerZeroStageAreRajbhandarisFormulas) {
  // Mixed-precision Adam with fp32 master weights (K = 12): baseline 16 psi bytes, Pos
  // 4 psi + 12 psi / N, Pos+g 2 psi + 14 psi / N, Pos+g+p 16 psi / N.
  expect_model_states("fp16-master", cluster_of("v100-dgx2", 4), [](double psi, double n) {
    return std::map<std::string, double>{{"ddp", 16 * psi},
                                         {"zero1", 4 * psi + 12 * psi / n},
                                         {"zero2", 2 * psi + 14 * psi / n},
                                         {"zero3", 16 * psi / n}};
  });
}

TEST(Planner, Bf16MasterKeepsFp32GradientsAsMegatronsDistributedOptimizer) {
  // dtrain train's bf16-master (Megatron's --bf16): 2 bytes of model, 4 of fp32 gradient, 12 of
  // master weight and Adam moments: Megatron's 6 psi + 12 psi / d with its distributed
  // optimizer (zero1), 18 psi without.
  expect_model_states("bf16-master", cluster_of("a100-selene", 8), [](double psi, double n) {
    return std::map<std::string, double>{
        {"ddp", 18 * psi}, {"zero1", 6 * psi + 12 * psi / n}, {"zero2", 2 * psi + 16 * psi / n}};
  });
}

// A GPT of `layers` x 2048 on 128-token samples (GPT-2's vocabulary).
ModelCost short_gpt(int layers) {
  TransformerShape shape;
  shape.layers = layers;
  shape.hidden = 2048;
  shape.heads = 16;
  shape.sequence = 128;
  shape.vocabulary = 50257;
  return transformer(shape, concat("gpt-", layers, "x2048"));
}

TEST(Planner, SetupBuildsTheWholeModelButForZero3sShardTensorParallelSlicesAndStages) {
  // Issue 80: zero3 draws only its shard (bounded by the largest layer, here the embedding);
  // ddp, zero1/2 build every parameter in fp32; TP only its slices; a pipeline rank only its
  // stages.
  const ModelCost model = model_named("gpt-7.5b");
  const Cluster cluster = cluster_of("a100-selene", 8);
  double largest = 0;
  for (const Layer& l : model.layers) largest = std::max<double>(largest, l.parameters);
  const double whole = 4.0 * model.parameters();
  Layout layout;
  layout.dp = 64;
  for (const std::string strategy : {"ddp", "zero1", "zero2"}) {
    layout.strategy = strategy;
    EXPECT_NEAR(predict(model, cluster, layout).memory.setup / whole, 1.0, 1e-9) << strategy;
  }
  layout.strategy = "zero3";
  const Memory zero3 = predict(model, cluster, layout).memory;
  EXPECT_NEAR(zero3.setup, whole / 64 + 4 * largest, 1e-6 * whole);
  // bf16-master: the bf16 shard beside its fp32 master, 6 bytes a parameter.
  const std::string precision = layout.precision;
  layout.precision = "bf16-master";
  EXPECT_NEAR(predict(model, cluster, layout).memory.setup, 1.5 * whole / 64 + 4 * largest,
              1e-6 * whole);
  layout.precision = precision;
  layout.strategy = "ddp";
  layout.dp = 8;
  layout.tp = 8;
  const double tp_setup = predict(model, cluster, layout).memory.setup;
  EXPECT_LT(tp_setup, whole / 7);  // most of the model is split 8 ways
  EXPECT_GT(tp_setup, whole / 8);  // the embedding and norms are not all split
  layout.tp = 1;
  layout.pp = 4;
  layout.dp = 16;
  layout.micro_batches = 8;
  layout.precision = "fp32";
  const Prediction piped = predict(model, cluster, layout);
  EXPECT_LT(piped.memory.setup, whole / 3);                                // about a quarter each
  EXPECT_NEAR(piped.memory.setup, piped.memory.parameters, 1e-3 * whole);  // its stages
}

TEST(Planner, OffloadMovesTheOptimizersStateOutAndCostsItsTraffic) {
  const ModelCost model = short_gpt(16);
  // This machine: two ranks share its memory; the disk's rates from the profile.
  Cluster cpu = cluster_of("this-machine", 1, 2);
  EXPECT_NEAR(rank_memory_bytes(cpu), cpu.hardware.memory_bytes / 2, 1);
  Layout layout;
  layout.strategy = "zero3";
  layout.dp = 2;
  layout.precision = "fp32";
  const Prediction plain = predict(model, cpu, layout);
  layout.offload = "disk";
  const Prediction disk = predict(model, cpu, layout);
  EXPECT_EQ(disk.memory.optimizer, 0);
  EXPECT_NEAR(disk.memory.disk, plain.memory.optimizer, 1);
  EXPECT_NEAR(plain.memory.total() - disk.memory.total(), plain.memory.optimizer, 1);
  // Two ranks read and write their state through the one disk every step.
  const double state = 2 * plain.memory.optimizer;
  EXPECT_NEAR(disk.optimizer_s,
              std::max(plain.optimizer_s,
                       state / cpu.hardware.disk_read_Bps + state / cpu.hardware.disk_write_Bps),
              1e-9);
  layout.offload = "host";  // the ranks' memory is the host's already
  EXPECT_THROW(predict(model, cpu, layout), InputError);
  // A GPU profile without the host's rates cannot predict offload: refused, naming the fields.
  layout.offload = "host";
  try {
    predict(model, cluster_of("a100-selene", 1, 2), layout);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("node.host_link_gb_s"), std::string::npos) << e.what();
  }
  // With them: the state and fp32 master weights in host memory, the step over PCIe.
  Cluster gpu = cluster_of("a100-selene", 1, 2);
  gpu.hardware.host_memory_bytes = 1e12;
  gpu.hardware.host_memory_bandwidth_Bps = 1e11;
  gpu.hardware.host_link_Bps = 2.5e10;
  layout.offload = "none";
  const Prediction device = predict(model, gpu, layout);
  layout.offload = "host";
  const Prediction host = predict(model, gpu, layout);
  EXPECT_EQ(host.memory.optimizer, 0);
  EXPECT_NEAR(host.memory.host, device.memory.optimizer + 4.0 * model.parameters() / 2, 1);
  EXPECT_GT(host.optimizer_s, device.optimizer_s);
  gpu.hardware.host_memory_bytes = host.memory.host;  // one rank's: two do not fit
  EXPECT_FALSE(predict(model, gpu, layout).fits);
}

TEST(Planner, SearchOffloadsOnlyWhatDoesNotFitOtherwise) {
  // On two ranks of this machine: 0.9B parameters fit with zero3 (and with ddp only offloaded);
  // 2B fit only with the Adam state on disk.
  SearchOptions options;
  options.global_batch = 2;
  options.precision = "fp32";
  options.allow_checkpointing = false;
  const Cluster cpu = cluster_of("this-machine", 1, 2);
  const ModelCost small = short_gpt(16);
  const SearchResult some = search(small, cpu, options);
  ASSERT_FALSE(some.ranked.empty());
  bool device = false;
  for (const Prediction& p : some.ranked) {
    if (p.layout.offload == "none") {
      device = true;
      continue;
    }
    Layout on_device = p.layout;
    on_device.offload = "none";
    EXPECT_FALSE(predict(small, cpu, on_device).fits) << p.layout.describe() << " fits without";
  }
  EXPECT_TRUE(device);
  const ModelCost big = short_gpt(40);
  const SearchResult only = search(big, cpu, options);
  ASSERT_FALSE(only.ranked.empty());
  for (const Prediction& p : only.ranked)
    EXPECT_EQ(p.layout.offload, "disk") << p.layout.describe();
  options.allow_offload = false;
  EXPECT_TRUE(search(big, cpu, options).ranked.empty());
}

TEST(Planner, TensorParallelAllReducesAreOnTheCriticalPath) {
  // One replica, tp 2: slowing the node's links by 2x adds exactly the all-reduces' extra time:
  // per micro-batch, 2 per block and 1 for the embedding, in forward and again in backward.
  const ModelCost model =
      model_named("transformer:layers=4,hidden=1024,heads=16,seq=512,vocab=1000");
  Cluster fast = cluster_of("a100-selene", 1, 2);
  Cluster slow = fast;
  slow.hardware.intra_node.bandwidth_Bps /= 2;
  Layout layout;
  layout.tp = 2;
  layout.micro_batch_size = 4;
  layout.micro_batches = 3;
  const double extra = predict(model, slow, layout).step_s - predict(model, fast, layout).step_s;
  const double bytes = 4.0 * 512 * 1024 * 2;  // b s h in 16 bits
  const double per_allreduce = 2 * 0.5 * bytes / slow.hardware.intra_node.bandwidth_Bps -
                               2 * 0.5 * bytes / fast.hardware.intra_node.bandwidth_Bps;
  EXPECT_NEAR(extra, 3 * 2 * (4 * 2 + 1) * per_allreduce, 1e-12);
}

TEST(Planner, DataParallelBucketsHideBehindBackwardUntilTheNetworkIsSlow) {
  const ModelCost model = model_named("resnet50");
  Layout layout;
  layout.dp = 16;
  layout.micro_batch_size = 32;
  layout.precision = "fp32";
  layout.optimizer = "momentum";
  Cluster cluster = cluster_of("p100-bigbasin", 2);
  const Prediction fast = predict(model, cluster, layout);
  cluster.hardware.inter_node.bandwidth_Bps /= 100;  // 0.5 Gbit/s
  const Prediction slow = predict(model, cluster, layout);
  Layout alone = layout;
  alone.dp = 8;
  const Prediction one_node = predict(model, cluster_of("p100-bigbasin", 1), alone);
  // The same computation everywhere; over the fast network most of the all-reduce is hidden,
  // over the slow one the step waits for it: at least the time the bytes need on the link.
  EXPECT_DOUBLE_EQ(fast.compute_s, slow.compute_s);
  const double bytes = model.parameters() * 4.0;
  const double allreduce =
      2 * (15.0 / 16) * bytes / (100 * cluster.hardware.inter_node.bandwidth_Bps);
  EXPECT_LT(fast.exposed_comm_s, 0.5 * allreduce) << "most of the buckets leave during backward";
  EXPECT_GT(slow.step_s, 2 * (15.0 / 16) * bytes / cluster.hardware.inter_node.bandwidth_Bps);
  EXPECT_GT(slow.exposed_comm_s, 10 * fast.exposed_comm_s);
  EXPECT_LT(one_node.exposed_comm_s, fast.exposed_comm_s);  // NVLink inside one node
}

// --overlap-param-gather: ZeRO-1/2's gathers move from the end of the step to the start of the
// next, bucket by bucket, each waited where the first forward reaches its layers: the step
// shrinks by most of the gather time (the same bytes; the first bucket's gather stays exposed)
// with and without a pipeline; a pipeline's zero2 is refused as dtrain train refuses it.
TEST(Planner, OverlappedParameterGathersHideBehindTheForward) {
  const ModelCost model =
      model_named("transformer:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200");
  const Cluster cluster = cluster_of("h100-dgx", 4);
  for (const int pp : {1, 2}) {  // (the data-parallel groups span nodes)
    Layout layout;
    layout.strategy = pp == 1 ? "zero2" : "zero1";
    layout.tp = 2;
    layout.pp = pp;
    layout.dp = 32 / (2 * pp);
    layout.micro_batches = 8;
    layout.bucket_cap_bytes = 8LL << 20;
    const Prediction waited = predict(model, cluster, layout);
    layout.overlap_param_gather = true;
    const Prediction overlapped = predict(model, cluster, layout);
    EXPECT_DOUBLE_EQ(waited.compute_s, overlapped.compute_s) << pp;
    EXPECT_LT(overlapped.step_s, waited.step_s) << pp;
    EXPECT_LT(overlapped.exposed_comm_s, 0.6 * waited.exposed_comm_s) << pp;
    EXPECT_NE(layout.train_flags(24).find("--overlap-param-gather"), std::string::npos);
  }
  Layout zero2_pipeline;
  zero2_pipeline.strategy = "zero2";
  zero2_pipeline.pp = 4;
  zero2_pipeline.dp = 8;
  zero2_pipeline.micro_batches = 8;
  EXPECT_THROW(predict(model, cluster, zero2_pipeline), InputError);
}

// --tp-comm-overlap: backward's input-gradient all-reduces hide behind the column-parallel
// layers' weight gradients: the same forward, a shorter backward (by at most those all-reduces),
// and nothing under a zero-bubble schedule, whose weight gradients wait for W.
TEST(Planner, TensorParallelAllreducesHideBehindWeightGradients) {
  const ModelCost model =
      model_named("transformer:layers=8,hidden=4096,heads=32,seq=2048,vocab=51200");
  const Cluster cluster = cluster_of("h100-dgx", 1);
  Layout layout;
  layout.tp = 8;
  layout.micro_batches = 4;
  const Prediction plain = predict(model, cluster, layout);
  layout.tp_comm_overlap = true;
  const Prediction overlapped = predict(model, cluster, layout);
  EXPECT_LT(overlapped.compute_s, plain.compute_s);
  EXPECT_LT(overlapped.step_s, plain.step_s);
  EXPECT_NE(overlapped.layout.train_flags(8).find("--tp-comm-overlap"), std::string::npos);
  layout.tp_comm_overlap = false;
  Layout zb = layout;
  zb.pp = 2, zb.tp = 4, zb.schedule = "zb-h1", zb.micro_batches = 4, zb.precision = "fp32";
  const Prediction zb_plain = predict(model, cluster_of("h100-dgx", 1), zb);
  zb.tp_comm_overlap = true;
  EXPECT_DOUBLE_EQ(predict(model, cluster_of("h100-dgx", 1), zb).compute_s, zb_plain.compute_s);
}

TEST(Planner, DtrainsGptHasTheParametersThePlannerCounts) {
  // dtrain's GPT is the planner's transformer with untied output and no dropout.
  for (const bool tied : {false, true}) {
    models::GptConfig config;
    config.vocab = 97;
    config.layers = 3;
    config.heads = 4;
    config.width = 64;
    config.context = 32;
    config.tied_embeddings = tied;
    const ModelCost model = model_named(
        concat("transformer:layers=3,hidden=64,heads=4,seq=32,vocab=97,tied=", tied ? 1 : 0,
               ",dropout=0"));
    EXPECT_EQ(model.parameters(), models::gpt_parameter_count(config)) << "tied " << tied;
  }
}

// VGG16 as Simonyan & Zisserman count it (138,357,544 parameters), PipeDream's shape (the
// convolutions most of the compute, the dense layers most of the parameters), and dtrain's
// --model vgg is the planner's vgg-small, layer for layer.
TEST(Planner, VggsConvolutionsComputeAndItsDenseLayersHoldTheParameters) {
  auto shares = [](const ModelCost& model) {
    double conv_flops = 0, flops = 0, dense_params = 0;
    for (const Layer& l : model.layers) {
      flops += l.matmul_flops;
      if (l.name.rfind("conv", 0) == 0) conv_flops += l.matmul_flops;
      if (l.name.rfind("fc", 0) == 0) dense_params += static_cast<double>(l.parameters);
    }
    return std::make_pair(conv_flops / flops, dense_params / model.parameters());
  };
  const ModelCost vgg16 = model_named("vgg16");
  EXPECT_EQ(vgg16.parameters(), 138357544);
  EXPECT_EQ(vgg16.layers.size(), 16u);
  EXPECT_GT(shares(vgg16).first, 0.99);
  EXPECT_GT(shares(vgg16).second, 0.89);
  const ModelCost small = model_named("vgg-small");
  EXPECT_GT(shares(small).first, 0.75);
  EXPECT_GT(shares(small).second, 0.98);
  models::ModelSpec spec;
  spec.name = "vgg";
  spec.input_shape = {1, 28, 28};
  spec.classes = 10;
  const Model dtrains = models::make_model(spec);
  ASSERT_EQ(dtrains.stages.size(), small.layers.size());
  int64_t counted = 0;
  for (size_t i = 0; i < small.layers.size(); ++i) {
    int64_t stage = 0;
    for (const auto& module : dtrains.stages[i].modules) {
      for (const auto& p : module->parameters()) stage += p.numel();
    }
    EXPECT_EQ(stage, small.layers[i].parameters) << small.layers[i].name;
    counted += stage;
  }
  EXPECT_EQ(counted, small.parameters());
}

TEST(Planner, RefusesLayoutsNamingWhatIsWrong) {
  const ModelCost model =
      model_named("transformer:layers=4,hidden=768,heads=12,seq=128,vocab=1000");
  const Cluster cluster = cluster_of("a100-selene", 1);
  auto refusal = [&](Layout layout) {
    try {
      predict(model, cluster, layout);
    } catch (const InputError& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  Layout l;
  l.dp = 1;
  l.tp = 8;
  l.pp = 1;
  EXPECT_NE(refusal(l).find("does not divide the model's 12 attention heads"), std::string::npos);
  l.tp = 4;
  EXPECT_NE(refusal(l).find("uses dp x cp x pp x tp = 4 ranks, the cluster has 8 GPUs"),
            std::string::npos);
  l.dp = 1;
  l.tp = 2;
  l.pp = 4;
  l.micro_batches = 2;
  EXPECT_NE(refusal(l).find("1f1b schedule needs at least as many micro-batches"),
            std::string::npos);
  l.strategy = "zero3";
  l.micro_batches = 4;
  EXPECT_NE(refusal(l).find("--pipeline-parallel combines with --strategy ddp or zero1"),
            std::string::npos);
  l.strategy = "zero4";
  EXPECT_NE(refusal(l).find("unknown strategy 'zero4' (it models ddp, zero1, zero2, zero3, "
                            "downpour)"),
            std::string::npos)
      << refusal(l);
  // What the registry declares: strategies without a cost model, and each strategy's own rules
  // as dtrain train checks them (zero3 takes no sequence parallelism; a PS worker no pp).
  l.strategy = "sandblaster";
  EXPECT_NE(refusal(l).find("the planner does not model strategy 'sandblaster'"),
            std::string::npos);
  l.strategy = "zero3";
  l.pp = 1;
  l.dp = 4;
  l.sequence_parallel = true;
  EXPECT_NE(refusal(l).find("--sequence-parallel sums LayerNorm gradients"), std::string::npos);
  l.sequence_parallel = false;
  EXPECT_EQ(refusal(l), "accepted");
  l.strategy = "downpour";
  EXPECT_NE(refusal(l).find("workers are replicas of the whole model"), std::string::npos);
}

TEST(Hardware, RefusesAMissingOrNonPhysicalField) {
  const std::string good = DTRAIN_SOURCE_DIR "/configs/hardware/a100-selene.toml";
  std::ifstream in(good);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dir = std::filesystem::temp_directory_path() / "dtrain-plan-test";
  std::filesystem::create_directories(dir);
  auto refusal = [&](const std::string& from, const std::string& to) {
    const std::string edited = std::string(text).replace(text.find(from), from.size(), to);
    const std::string file = (dir / "edited.toml").string();
    std::ofstream(file) << edited;
    try {
      load_hardware(file, {});
    } catch (const InputError& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal("memory_gib = 80", "").find("missing field 'accelerator.memory_gib'"),
            std::string::npos);
  EXPECT_NE(refusal("memory_gib = 80", "memory_gib = -80")
                .find("'accelerator.memory_gib' = -80 is not physical"),
            std::string::npos);
  EXPECT_NE(
      refusal("matmul = 0.75", "matmul = 1.5").find("'efficiency.matmul' = 1.5 is not physical"),
      std::string::npos);
  EXPECT_NE(
      refusal("link_gb_s = 300", "link_gb_s = \"fast\"").find("'node.link_gb_s' must be a number"),
      std::string::npos);
  EXPECT_EQ(refusal("memory_gib = 80", "memory_gib = 80"), "accepted");
  const std::string table = "[matmul_table]\nsource = \"test\"\nsizes = [256, 512]\n";
  EXPECT_NE(refusal("[efficiency]", table + "bf16 = [1, 2, 3]\n[efficiency]")
                .find("matmul_table.bf16 has 3 rates; 2 sizes need 8 (m, then n, then k)"),
            std::string::npos);
  EXPECT_NE(refusal("[efficiency]", table + "int8 = [1, 1, 1, 1, 1, 1, 1, 1]\n[efficiency]")
                .find("matmul_table.int8 must be a list of rates for a dtype of"),
            std::string::npos);
  EXPECT_EQ(refusal("[efficiency]", table + "bf16 = [1, 1, 1, 1, 1, 1, 1, 1]\n[efficiency]"),
            "accepted");
  try {
    load_hardware("a100-nowhere", profiles());
    FAIL() << "an unknown profile was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("unknown hardware profile 'a100-nowhere' (known: a100-selene, "),
              std::string::npos)
        << e.message();
  }
}

TEST(Hardware, MeasuredRatesInterpolateBySizeAndCoresAreShared) {
  const std::string good = DTRAIN_SOURCE_DIR "/configs/hardware/a100-selene.toml";
  std::ifstream in(good);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.replace(text.find("[efficiency]"), 12,
               "[accelerator.matmul_tflops_by_dim]\nfp32 = { \"64\" = 1.0, \"256\" = 4.0 }\n\n"
               "[efficiency]");
  text.replace(text.find("gpus = 8"), 8, "gpus = 2\ncores = 2");
  const auto file = std::filesystem::temp_directory_path() / "dtrain-plan-measured.toml";
  std::ofstream(file) << text;
  const Hardware hw = load_hardware(file.string(), {});
  // log-log between the measured sizes, held at the ends; other dtypes from the peak
  EXPECT_NEAR(hw.matmul_rate("fp32", 128), 2e12, 1e3);
  EXPECT_DOUBLE_EQ(hw.matmul_rate("fp32", 16), 1e12);
  EXPECT_DOUBLE_EQ(hw.matmul_rate("fp32", 4096), 4e12);
  EXPECT_DOUBLE_EQ(hw.matmul_rate("bf16", 128), 312e12 * 0.75);
  EXPECT_TRUE(hw.shared_cores);
  // Four ranks on a node of two cores: each computes at half speed.
  const ModelCost model = uniform_model(4);
  Cluster two;
  two.hardware = hw;
  two.gpus_per_node = 2;
  Cluster four = two;
  four.gpus_per_node = 4;
  Layout layout;
  layout.optimizer = "sgd";
  layout.precision = "fp32";
  layout.dp = 2;
  const double alone = predict(model, two, layout).compute_s;
  layout.dp = 4;
  EXPECT_NEAR(predict(model, four, layout).compute_s / alone, 2.0, 1e-9);
}

}  // namespace
}  // namespace dtrain::plan
