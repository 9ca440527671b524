// The planner's simulation of one optimizer step. Ranks that differ only in their data- or
// tensor-parallel index do the same work at the same times, so one replica's pipeline is
// simulated (every stage, every action of the schedule builder's lists) and its collectives are
// timed on the links its groups really use. This file: what a rank computes (each layer's
// time) and where the layers sit (Step), and predict, which composes the step's parts
// (StepModel.h). docs/PLAN.md states each rule and its source.
#include "dtrain/plan/Planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/ddp/Buckets.h"
#include "dtrain/parallel/pipeline/Partition.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "plan/PlannedStrategies.h"
#include "plan/StepModel.h"

namespace dtrain::plan {

namespace pp = parallel::pipeline;

Bytes bytes_of(const Layout& layout) {
  const double moments = layout.optimizer == "adam" ? 2 : layout.optimizer == "momentum" ? 1 : 0;
  const std::string& p = layout.precision;
  if (p == "fp32") return {4, 4, 4, 4 * moments, "fp32", false};
  if (p == "bf16") return {2, 2, 2, 2 * moments, "bf16", false};
  const std::string dtype = p.rfind("fp16", 0) == 0 ? "fp16" : "bf16";
  if (p == "bf16-mixed" || p == "fp16-mixed") return {2, 4, 4, 4 * moments, dtype, true};
  const double gradient = dtype == "bf16" ? 4 : 2;
  return {2, 2, gradient, 4 * moments + 4, dtype, false};  // bf16-master, fp16-master
}

double allreduce(double bytes, int ranks, const Link& link, bool tree) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const double n = ranks;
  const double ring =
      comm::ring_wire_bytes("allreduce", static_cast<int64_t>(bytes), ranks) / link.bandwidth_Bps +
      2 * (n - 1) * link.latency_s;
  if (!tree) return ring;
  const double trees =
      2 * bytes / link.bandwidth_Bps + 2 * std::ceil(std::log2(n)) * link.latency_s;
  return std::min(ring, trees);
}
double all_to_all(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  const double n = ranks;
  return bytes * (n - 1) / n / link.bandwidth_Bps + (n - 1) * link.latency_s;
}
double ring_half(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  return comm::ring_wire_bytes("reduce_scatter", static_cast<int64_t>(bytes), ranks) /
             link.bandwidth_Bps +
         (ranks - 1) * link.latency_s;
}

int Placement::node_of(int pp_index, int dp_index, int tp_index) const {
  const int rank = (pp_index * layout.dp + dp_index) * layout.tp + tp_index;
  return rank / cluster.per_node();
}

Link Placement::group_link(int stride, int size) const {
  const int per_node = cluster.per_node();
  const Hardware& hw = cluster.hardware;
  // The grid's groups are aligned runs: one spanning stride x size ranks fits in a node.
  if (static_cast<int64_t>(stride) * size <= per_node) {
    return hw.intra_node;
  }
  // Members of the group inside one node (1 when the stride spans nodes).
  const int members_per_node = std::max(1, std::min(size, per_node / std::max(1, stride)));
  const double share = hw.inter_node.bandwidth_Bps * members_per_node / per_node;
  return {hw.inter_node.latency_s, std::min(share, hw.intra_node.bandwidth_Bps)};
}

namespace {

/// A layer's matrix products on one TP rank for one micro-batch of `b` samples: forward,
/// backward's input and weight gradients (of those, the column-parallel layers'), what backward
/// computes beyond them (FlashAttention's scores), and attention's core (what selective
/// recomputation runs again).
struct MatmulTime {
  double forward = 0, input_grad = 0, weight_grad = 0, column_weight_grad = 0;
  double recomputed = 0, attention = 0;
};

MatmulTime matmul_time(const Layer& l, const Rates& r, double b, int tp) {
  const double split = l.tensor_parallel ? tp : 1;
  const double size_rate = r.hw.matmul_rate(r.dtype, l.matmul_dim / split) * r.share;
  MatmulTime t;
  t.recomputed = l.recomputed_backward_flops * b / split / size_rate;
  t.attention = l.attention_flops * b / split / size_rate;
  // (What the kernels compute: a causal FlashAttention kernel skips half the scores.)
  const double computed = (l.matmul_flops - l.skipped_flops) * b / split;
  if (l.gemms.empty() || !r.hw.matmul_table.has(r.dtype)) {
    t.forward = t.input_grad = t.weight_grad = computed / size_rate;
    t.column_weight_grad = l.column_parallel_flops * b / split / size_rate;
    return t;
  }
  // By shape: each product at its own rate, and backward's two at theirs (dX = dY W is m x n by
  // n x k, dW = dY^T X is n x m by m x k); the rest (attention's core) has no weights.
  double by_shape = 0;
  for (const Gemm& g : l.gemms) {
    const double m = g.rows * b;
    const double n = g.split == Gemm::Columns ? g.n / split : g.n;
    const double k = g.split == Gemm::Inner ? g.k / split : g.k;
    auto time = [&](double rows, double cols, double inner) {
      return 2 * m * n * k / (r.hw.matmul_table.rate(r.dtype, rows, cols, inner) * r.share);
    };
    t.forward += time(m, n, k);
    t.input_grad += time(m, k, n);
    const double weight = time(n, k, m);
    t.weight_grad += weight;
    if (g.split == Gemm::Columns) t.column_weight_grad += weight;
    by_shape += g.flops() * b / split;
  }
  const double rest = std::max(0.0, computed - by_shape) / size_rate;
  t.forward += rest;
  t.input_grad += 2 * rest;
  return t;
}

/// Context parallelism's exchange of one attention layer on a TP rank, one micro-batch of `b`
/// samples (the layer's figures a rank's share of the sequence): forward and backward. The
/// ring's C - 1 steps each pass a block of keys and values (backward: their gradients too)
/// while the block before is computed, exposing only what the block's share of the core does not
/// hide; the all-gather gathers them once (backward: reduce-scatters their gradients); Ulysses'
/// four all-to-alls (queries, keys, values; the output) each way.
std::pair<double, double> context_exchange(const Layer& l, const Rates& rates, const Bytes& bytes,
                                           double b, int tp, const Link& link) {
  const int c = l.context_ranks;
  if (c <= 1 || l.kv_elements <= 0) return {0.0, 0.0};
  const double split = l.tensor_parallel ? tp : 1;
  const double kv = l.kv_elements * b / split * bytes.activation;
  if (l.context_method == "ulysses") {
    const double each = all_to_all(l.qkvo_elements * b / split * bytes.activation, c, link);
    return {each, each};
  }
  if (l.context_method == "allgather") {
    const double gather = ring_half(kv * c, c, link);
    return {gather, gather};
  }
  const double block = l.core_flops * b / split / c /
                       (rates.hw.matmul_rate(rates.dtype, l.matmul_dim / split) * rates.share);
  const double transfer = kv / link.bandwidth_Bps + link.latency_s;
  return {(c - 1) * std::max(0.0, transfer - block),
          (c - 1) * std::max(0.0, 2 * transfer - 2 * block)};
}

/// Every layer's forward and backward on one TP rank, one micro-batch.
std::vector<LayerTime> layer_times(const ModelCost& model, const Layout& layout, const Rates& rates,
                                   const Bytes& bytes, const std::vector<double>& local_params,
                                   const Link& tp_link, const Link& ep_link, const Link& cp_link,
                                   bool tree) {
  const double b = layout.micro_batch_size;
  const bool tp_overlap = layout.tp_comm_overlap && layout.tp > 1 &&
                          !(layout.pp > 1 && pp::splits_backward(layout.schedule));
  std::vector<LayerTime> times(model.layers.size());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const Layer& l = model.layers[i];
    const double split = l.tensor_parallel ? layout.tp : 1;
    const MatmulTime mm = matmul_time(l, rates, b, layout.tp);
    const double replicated = layout.sequence_parallel
                                  ? 0
                                  : l.replicated_saved_elements / std::max(1.0, l.saved_elements);
    const double elements = l.elementwise_elements * b * (replicated + (1 - replicated) / split);
    const double elementwise = elements * bytes.activation / rates.elementwise_rate;
    const double alltoall =
        2 * all_to_all(l.alltoall_elements * b * bytes.activation, layout.ep, ep_link);
    const double tp_comm = l.tp_allreduces * allreduce(l.output_elements * b * bytes.activation,
                                                       layout.tp, tp_link, tree) +
                           alltoall;
    // dtrain's autocast: each micro-batch's forward casts the fp32 weights to 16 bits (read 4,
    // write 2 bytes), backward turns the 16-bit weight gradients into fp32 and accumulates them
    // (read 2, read and write 4).
    const double casts_f = bytes.casts_per_micro_batch ? 6 * local_params[i] : 0;
    const double casts_b = bytes.casts_per_micro_batch ? 10 * local_params[i] : 0;
    const auto [cp_f, cp_b] = context_exchange(l, rates, bytes, b, layout.tp, cp_link);
    LayerTime& t = times[i];
    t.alltoall = alltoall;
    t.forward = mm.forward + elementwise + casts_f / rates.byte_rate + l.kernels * rates.overhead +
                tp_comm + cp_f;
    // --tp-comm-overlap: each input-gradient all-reduce of backward runs beside the weight
    // gradient of the column-parallel layer it follows (not under a split backward).
    const double tp_comm_b = tp_overlap ? std::max(0.0, tp_comm - mm.column_weight_grad) : tp_comm;
    t.backward = mm.input_grad + mm.weight_grad + mm.recomputed + 2 * elementwise +
                 casts_b / rates.byte_rate + 2 * l.kernels * rates.overhead + tp_comm_b + cp_b;
    // dW = dY^T X and its fp32 accumulation; a recomputed layer computes it during B (dtrain
    // defers nothing from inside a checkpoint), and so does autocast's (its weight is cast).
    if (!layout.checkpointing && !bytes.casts_per_micro_batch) t.weight = mm.weight_grad;
    if (layout.checkpointing) {
      t.backward += t.forward;  // recomputed before its backward
    } else if (layout.selective_recompute) {
      t.backward += mm.attention +
                    l.attention_elements * b / split * bytes.activation / rates.elementwise_rate +
                    l.attention_kernels * rates.overhead;
    }
  }
  return times;
}

/// A rank's rates on `cluster` in `bytes`' compute dtype; CPU profiles: ranks beyond the node's
/// accelerators share its cores.
Rates rates_of(const Cluster& cluster, const Bytes& bytes) {
  const Hardware& hw = cluster.hardware;
  const double share =
      hw.shared_cores ? std::min(1.0, hw.gpus_per_node / static_cast<double>(cluster.per_node()))
                      : 1.0;
  const double memory = hw.memory_bandwidth_Bps * hw.memory_efficiency;
  const double elementwise = hw.elementwise_Bps > 0 ? hw.elementwise_Bps : memory;
  return {hw,
          bytes.compute_dtype,
          share,
          memory * share,
          elementwise * share,
          hw.kernel_overhead_s / share};
}

}  // namespace

Step::Step(const ModelCost& model_, const Cluster& cluster_, const Layout& layout_)
    : model(model_),
      cluster(cluster_),
      layout(layout_),
      hw(cluster_.hardware),
      strategy(planned_strategy(layout_.strategy)),
      bytes(bytes_of(layout_)),
      tree(!hw.shared_cores),
      rates(rates_of(cluster_, bytes)),
      place{cluster_, layout_},
      P(layout_.pp),
      V(layout_.chunks),
      stages(P * V),
      replicated(!layout_.stage_replicas.empty()) {
  const size_t n = model.layers.size();
  local_params.resize(n);
  local_expert_params.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const Layer& l = model.layers[i];
    const double split = l.tensor_parallel ? layout.tp : 1;
    // (Experts: split over the expert group, whole on every TP rank.)
    local_expert_params[i] = static_cast<double>(l.expert_parameters) / layout.ep;
    local_params[i] =
        static_cast<double>(l.parameters - l.replicated_parameters - l.expert_parameters) / split +
        l.replicated_parameters + local_expert_params[i];
  }
  // The expert group: ep consecutive data-parallel ranks (stride tp); the context group likewise
  // (a layout with context parallelism is simulated with it folded into dp: predict).
  int context_ranks = 1;
  for (const Layer& l : model.layers) context_ranks = std::max(context_ranks, l.context_ranks);
  times = layer_times(model, layout, rates, bytes, local_params, place.group_link(1, layout.tp),
                      place.group_link(layout.tp, layout.ep),
                      place.group_link(layout.tp, context_ranks), tree);
  // Layers onto virtual stages: dtrain's balanced partition, by forward + backward time
  // (replicated stages: a stage's work is shared by its replicas, PipeDream's partition).
  std::vector<double> costs(n);
  for (size_t i = 0; i < n; ++i) costs[i] = times[i].forward + times[i].backward;
  partition = pp::balanced_partition(costs, stages, layout.stage_replicas);
  // The schedule: with pp = 1 the micro-batches one after another (gradient accumulation).
  spec = pp::ScheduleSpec{P > 1 ? layout.schedule : pp::ScheduleSpec{}.kind, P,
                          layout.micro_batches, V, layout.stage_replicas};
  slots = spec.slots();
  lists = pp::build_slot_schedules(spec);
  split = pp::splits_backward(spec.kind);
  flush_free = P > 1 && layout.pipeline_sync != "flush";
  for (int s = 0; s < stages; ++s) {
    double f = 0, b = 0, w = 0, params = 0, alltoall = 0;
    for (int i = partition.first(s); i < partition.end(s); ++i) {
      alltoall += times[i].alltoall;
      f += times[i].forward;
      b += times[i].backward;
      w += times[i].weight;
      params += local_params[i];
    }
    stage_f.push_back(f);
    stage_b.push_back(b);
    stage_w.push_back(split ? w : 0.0);
    stage_params.push_back(params);
    stage_alltoall.push_back(alltoall);
    std::vector<parallel::ddp::BucketedParameter> described;
    for (int i = partition.first(s); i < partition.end(s); ++i) {
      described.push_back(
          {static_cast<int64_t>(local_params[i] * bytes.gradient), 0, model.layers[i].name});
    }
    buckets.push_back(parallel::ddp::assign_buckets(
        described,
        {layout.bucket_cap_bytes, std::min<int64_t>(1 << 20, layout.bucket_cap_bytes), true}));
  }
}

int Step::vstage(int chunk, int slot) const {
  return replicated ? spec.stage_of_slot(slot) : pp::stage_of(spec, chunk, slot);
}

int Step::replicas_of(int slot) const {
  return replicated ? layout.stage_replicas[spec.stage_of_slot(slot)] : layout.dp;
}

int Step::slot_layers(int slot) const {
  int layers = 0;
  for (int c = 0; c < V; ++c)
    layers += partition.end(vstage(c, slot)) - partition.first(vstage(c, slot));
  return layers;
}

double Step::slot_params(int slot) const {
  double params = 0;
  for (int c = 0; c < V; ++c) params += stage_params[vstage(c, slot)];
  return params;
}

double Step::slot_expert_params(int slot) const {
  double params = 0;
  for (int c = 0; c < V; ++c) {
    const int s = vstage(c, slot);
    for (int i = partition.first(s); i < partition.end(s); ++i) params += local_expert_params[i];
  }
  return params;
}

double Step::sharded_share(double params, double experts, int slot) const {
  const double ranks = replicas_of(slot);
  return (params - experts) / ranks + experts / std::max(1.0, ranks / layout.ep);
}

double rank_memory_bytes(const Cluster& cluster) {
  const Hardware& hw = cluster.hardware;
  return hw.shared_cores ? hw.memory_bytes / cluster.per_node() : hw.memory_bytes;
}

namespace {

/// What a rank of a context group of `cp` computes and keeps of each sample: every per-sample
/// figure over cp (its share of the tokens, and of attention's causal work: the zigzag balances
/// it), its attention exchanging with the group by `method`.
ModelCost context_share(const ModelCost& model, int cp, const std::string& method) {
  ModelCost share = model;
  const double c = cp;
  share.tokens_per_sample = model.tokens_per_sample / cp;
  for (Layer& l : share.layers) {
    l.matmul_flops /= c;
    for (Gemm& g : l.gemms) g.rows /= c;
    l.elementwise_elements /= c;
    l.saved_elements /= c;
    l.output_elements /= c;
    l.column_parallel_flops /= c;
    l.replicated_saved_elements /= c;
    l.attention_saved_elements /= c;
    l.attention_flops /= c;
    l.attention_elements /= c;
    l.skipped_flops /= c;
    l.recomputed_backward_flops /= c;
    l.alltoall_elements /= c;
    l.kv_elements /= c;
    l.qkvo_elements /= c;
    l.core_flops /= c;
    l.context_ranks = cp;
    l.context_method = method;
  }
  return share;
}

Prediction predict_step(const ModelCost& model, const Cluster& cluster, const Layout& layout);

}  // namespace

Prediction predict(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  check_layout(model, cluster, layout);
  if (layout.cp == 1) return predict_step(model, cluster, layout);
  // Context parallelism folded into data parallelism (as dtrain's grid folds it: the context
  // group's ranks consecutive inside dp, the gradients reduced and ZeRO's shards cut over
  // dp x cp), each rank computing its share of a sample: the step of dp x cp replicas of the
  // shared model, whose samples are cp times fewer.
  Layout folded = layout;
  folded.dp = layout.dp * layout.cp;
  folded.cp = 1;
  Prediction out = predict_step(context_share(model, layout.cp, layout.cp_method), cluster, folded);
  const double shared_flops = out.model_flops_per_step;
  out.layout = layout;
  out.samples_per_s = layout.global_batch() / out.step_s;
  out.model_flops_per_step = model.model_flops_per_sample() * layout.global_batch();
  out.mfu *= out.model_flops_per_step / shared_flops;
  return out;
}

namespace {

Prediction predict_step(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  const Step step(model, cluster, layout);
  const Timeline timeline = simulate_pipeline(step);
  Prediction out;
  out.layout = layout;
  // The slowest slot sets the step; the pipeline's bubble is the one the busiest slot sees
  // (the one that sets the pace).
  for (int r = 0; r < step.slots; ++r) {
    const SlotStep slot = data_parallel_step(step, timeline, r);
    const double optimizer_s = optimizer_time(step, r);
    if (slot.end + optimizer_s > out.step_s) {
      out.step_s = slot.end + optimizer_s;
      out.exposed_comm_s =
          std::max(0.0, slot.end - timeline.compute_end(step, r) + timeline.gather_exposed);
      out.optimizer_s = optimizer_s;
    }
    if (slot.busy > out.compute_s) {
      out.compute_s = slot.busy;
      const double span = step.flush_free ? timeline.steady_step
                                          : timeline.simulation.makespan - timeline.gather_exposed;
      out.bubble = step.P > 1 ? 1 - slot.busy / span : 0.0;
    }
  }
  if (step.strategy.cost.traffic == parallel::StepCost::Traffic::kParameterServer &&
      layout.dp > 1) {
    const double step_s = parameter_server_step(step, out.step_s);
    out.exposed_comm_s = step_s - out.step_s;
    out.step_s = step_s;
  }
  // Memory of every rank, and of the rank that needs the most.
  out.stage_memory = slot_memory(step, timeline);
  for (const Memory& m : out.stage_memory) {
    if (m.total() > out.memory.total()) out.memory = m;
  }
  for (const Memory& m : out.stage_memory) {
    if (m.setup > out.memory.setup) out.memory.setup = m.setup;
  }
  // The node's host memory holds its ranks' offloaded state (a GPU profile's; a CPU profile's
  // ranks share it, so it is their device memory already).
  double host = 0;
  for (const Memory& m : out.stage_memory) host = std::max(host, m.host);
  out.fits = out.memory.total() <= rank_memory_bytes(cluster) &&
             (host == 0 || host * cluster.per_node() <= cluster.hardware.host_memory_bytes);
  out.setup_fits = out.memory.setup <= rank_memory_bytes(cluster);
  out.samples_per_s = layout.global_batch() / out.step_s;
  out.model_flops_per_step = model.model_flops_per_sample() * layout.global_batch();
  out.mfu = out.model_flops_per_step / out.step_s /
            (cluster.gpus() * cluster.hardware.peak(step.bytes.compute_dtype) * step.rates.share);
  return out;
}

}  // namespace

}  // namespace dtrain::plan
