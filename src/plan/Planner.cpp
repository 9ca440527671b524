// The planner's simulation of one optimizer step. Ranks that differ only in their data- or
// tensor-parallel index do the same work at the same times, so one replica's pipeline is
// simulated (every stage, every action of the schedule builder's lists) and its collectives are
// timed on the links its groups really use. docs/PLAN.md states each rule and its source.
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

namespace dtrain::plan {

namespace pp = parallel::pipeline;

namespace {

/// Bytes per element of what a rank keeps, by precision. "-master" precisions are Megatron's
/// and DeepSpeed's layout (16-bit weights, fp32 master weights in the optimizer, the 16-bit
/// weights reused by every micro-batch): bf16-master (dtrain train's, as Megatron's --bf16)
/// accumulates and reduces the gradients in fp32, fp16-master keeps them in fp16 (Megatron's
/// --fp16 default); dtrain's mixed precision is autocast over fp32 weights (each micro-batch's
/// forward casts them, backward accumulates into fp32).
struct Bytes {
  double activation, parameter, gradient, optimizer;
  std::string compute_dtype;
  bool casts_per_micro_batch;
};
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

/// All-reduce of `bytes` over `ranks`. Ring (Patarasuk & Yuan's bound; Gloo's and NCCL's
/// ring): each rank sends what the step records' wire_bytes count (comm::ring_wire_bytes,
/// 2 (n-1)/n of the data) in 2 (n-1) steps. With `tree` (NCCL, which picks per call): the
/// double binary tree's 2 log2(n) steps when they are faster (each rank still sends and
/// receives about twice the data).
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
/// Reduce-scatter or all-gather: half a ring all-reduce.
double ring_half(double bytes, int ranks, const Link& link) {
  if (ranks <= 1 || bytes <= 0) return 0;
  return comm::ring_wire_bytes("reduce_scatter", static_cast<int64_t>(bytes), ranks) /
             link.bandwidth_Bps +
         (ranks - 1) * link.latency_s;
}

/// Where a rank of the grid sits: ranks are laid out as dtrain's ProcessGrid does, tensor-
/// parallel fastest, then data-parallel, then pipeline; consecutive ranks fill a node.
struct Placement {
  const Cluster& cluster;
  const Layout& layout;
  int node_of(int pp_index, int dp_index, int tp_index) const {
    const int rank = (pp_index * layout.dp + dp_index) * layout.tp + tp_index;
    return rank / cluster.per_node();
  }
  /// The link a group whose members are `stride` ranks apart, `size` of them, runs on: inside
  /// a node when they all fit in one; across nodes otherwise, where every rank of a node that
  /// talks across at once shares the node's network bandwidth (NCCL spreads rings over all the
  /// node's NICs), and no faster than the node's own links.
  Link group_link(int stride, int size) const {
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
};

/// What one rank computes at: its compute dtype's matrix products, memory, the element-wise
/// kernels and one operator's fixed cost (a CPU profile's ranks with their share of the cores).
struct Rates {
  const Hardware& hw;
  std::string dtype;
  double share, byte_rate, elementwise_rate, overhead;
};

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

struct LayerTime {
  double forward = 0, backward = 0;  // one micro-batch, this TP rank, TP all-reduces included
  double weight = 0;                 // the part of backward forming the weight gradients
};

/// Every layer's forward and backward on one TP rank, one micro-batch.
std::vector<LayerTime> layer_times(const ModelCost& model, const Layout& layout, const Rates& rates,
                                   const Bytes& bytes, const std::vector<double>& local_params,
                                   const Link& tp_link, bool tree) {
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
    const double tp_comm = l.tp_allreduces * allreduce(l.output_elements * b * bytes.activation,
                                                       layout.tp, tp_link, tree);
    // dtrain's autocast: each micro-batch's forward casts the fp32 weights to 16 bits (read 4,
    // write 2 bytes), backward turns the 16-bit weight gradients into fp32 and accumulates them
    // (read 2, read and write 4).
    const double casts_f = bytes.casts_per_micro_batch ? 6 * local_params[i] : 0;
    const double casts_b = bytes.casts_per_micro_batch ? 10 * local_params[i] : 0;
    LayerTime& t = times[i];
    t.forward =
        mm.forward + elementwise + casts_f / rates.byte_rate + l.kernels * rates.overhead + tp_comm;
    // --tp-comm-overlap: each input-gradient all-reduce of backward runs beside the weight
    // gradient of the column-parallel layer it follows (not under a split backward).
    const double tp_comm_b = tp_overlap ? std::max(0.0, tp_comm - mm.column_weight_grad) : tp_comm;
    t.backward = mm.input_grad + mm.weight_grad + mm.recomputed + 2 * elementwise +
                 casts_b / rates.byte_rate + 2 * l.kernels * rates.overhead + tp_comm_b;
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

/// Where the layers sit: the partition over virtual stages, and for each slot (a pipeline rank,
/// or a replica of a replicated stage) the virtual stage of its chunk and its data-parallel group.
struct Placed {
  const pp::Partition& partition;
  std::function<int(int chunk, int slot)> vstage;
  std::function<int(int slot)> replicas;
  int slots;
};

/// Each slot's memory: its layers' parameters, gradients and optimizer state as the strategy
/// shards them, the activations of its micro-batches in flight (the schedule's peak), ZeRO's
/// buffers.
std::vector<Memory> slot_memory(const ModelCost& model, const Layout& layout, const Bytes& bytes,
                                const std::vector<double>& local_params, const Placed& placed,
                                const pp::Simulation& timeline, bool flush_free) {
  const int P = layout.pp, V = layout.chunks;
  const double b = layout.micro_batch_size;
  std::vector<Memory> memory;
  for (int r = 0; r < placed.slots; ++r) {
    Memory m;
    double params = 0, saved = 0, boundary = 0, largest_saved = 0, largest_layer = 0;
    for (int c = 0; c < V; ++c) {
      const int s = placed.vstage(c, r);
      for (int i = placed.partition.first(s); i < placed.partition.end(s); ++i) {
        const Layer& l = model.layers[i];
        const double split = l.tensor_parallel ? layout.tp : 1;
        params += local_params[i];
        const double replicated = layout.sequence_parallel ? l.replicated_saved_elements / split
                                                           : l.replicated_saved_elements;
        const double dropped = layout.selective_recompute ? l.attention_saved_elements : 0;
        const double layer_saved =
            (l.saved_elements - l.replicated_saved_elements - dropped) / split + replicated;
        saved += layer_saved;
        boundary += l.output_elements / (layout.sequence_parallel ? split : 1);
        largest_saved = std::max(largest_saved, layer_saved);
        largest_layer = std::max(largest_layer, local_params[i]);
      }
    }
    // A pipeline's last stage keeps its own copy of the tied embedding.
    if (P > 1 && placed.vstage(0, r) == P - 1 && model.layers.front().name == "embedding" &&
        model.layers.back().name == "head") {
      params += local_params.front();
    }
    const double in_flight =
        P > 1 ? std::max(1.0, timeline.peak_live[r] / static_cast<double>(V)) : 1.0;
    const bool z1 =
        layout.strategy == "zero1" || layout.strategy == "zero2" || layout.strategy == "zero3";
    const double sharded = placed.replicas(r);  // ZeRO's shards: 1/DP of what they shard
    m.parameters = params * bytes.parameter / (layout.strategy == "zero3" ? sharded : 1.0);
    // PipeDream's weight versions: 2bw two, async up to one per micro-batch in flight and one.
    if (flush_free) m.parameters *= layout.pipeline_sync == "async" ? P - r + 1 : 2;
    m.gradients = params * bytes.gradient /
                  (layout.strategy == "zero2" || layout.strategy == "zero3" ? sharded : 1.0);
    m.optimizer = params * bytes.optimizer / (z1 ? sharded : 1.0);
    if (layout.strategy == "downpour") {
      // A Downpour worker: the model and the landing buffer of pulls; .grad, the accumulation
      // and the push in flight; the optimizer lives on the shards.
      m.parameters = 2 * params * bytes.parameter;
      m.gradients = 3 * params * bytes.gradient;
      m.optimizer = 0;
    }
    m.activations =
        b * bytes.activation *
        (layout.checkpointing ? in_flight * boundary + largest_saved : in_flight * saved);
    if (layout.strategy == "zero3")
      m.buffers = 2 * largest_layer * bytes.parameter;  // gathered + prefetched
    if (layout.strategy == "zero2") m.buffers = 2.0 * layout.bucket_cap_bytes;
    memory.push_back(m);
  }
  return memory;
}

}  // namespace

Prediction predict(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  check_layout(model, cluster, layout);
  const Hardware& hw = cluster.hardware;
  const Bytes bytes = bytes_of(layout);
  const double peak = hw.peak(bytes.compute_dtype);
  // GPU profiles run NCCL, which picks a ring or a tree per all-reduce; CPU profiles Gloo's ring.
  const bool tree = !hw.shared_cores;
  // CPU profiles: ranks beyond the node's accelerators share its cores.
  const double share =
      hw.shared_cores ? std::min(1.0, hw.gpus_per_node / static_cast<double>(cluster.per_node()))
                      : 1.0;
  const double byte_rate = hw.memory_bandwidth_Bps * hw.memory_efficiency * share;
  const double overhead = hw.kernel_overhead_s / share;
  const Rates rates{hw,
                    bytes.compute_dtype,
                    share,
                    byte_rate,
                    (hw.elementwise_Bps > 0 ? hw.elementwise_Bps
                                            : hw.memory_bandwidth_Bps * hw.memory_efficiency) *
                        share,
                    overhead};
  const double b = layout.micro_batch_size;
  const Placement place{cluster, layout};
  const Link tp_link = place.group_link(1, layout.tp);
  const size_t n_layers = model.layers.size();
  std::vector<double> local_params(n_layers);
  for (size_t i = 0; i < n_layers; ++i) {
    const Layer& l = model.layers[i];
    const double split = l.tensor_parallel ? layout.tp : 1;
    local_params[i] = (l.parameters - l.replicated_parameters) / split + l.replicated_parameters;
  }
  const std::vector<LayerTime> times =
      layer_times(model, layout, rates, bytes, local_params, tp_link, tree);

  // --- Layers onto virtual stages: dtrain's balanced partition, by forward + backward time.
  const int P = layout.pp, V = layout.chunks, stages = P * V;
  std::vector<double> costs(n_layers);
  for (size_t i = 0; i < n_layers; ++i) costs[i] = times[i].forward + times[i].backward;
  // (Replicated stages: a stage's work is shared by its replicas, PipeDream's partition.)
  const bool replicated = !layout.stage_replicas.empty();
  const pp::Partition partition = pp::balanced_partition(costs, stages, layout.stage_replicas);
  auto stage_sum = [&](int vstage, auto field) {
    double total = 0;
    for (int i = partition.first(vstage); i < partition.end(vstage); ++i) total += field(i);
    return total;
  };
  std::vector<double> stage_f(stages), stage_b(stages), stage_params(stages);
  for (int s = 0; s < stages; ++s) {
    stage_f[s] = stage_sum(s, [&](int i) { return times[i].forward; });
    stage_b[s] = stage_sum(s, [&](int i) { return times[i].backward; });
    stage_params[s] = stage_sum(s, [&](int i) { return local_params[i]; });
  }

  // --- The pipeline (or, with pp = 1, the micro-batches one after another), through the
  // schedule builder's lists and its simulator, with each stage's costs and the time an
  // activation or a gradient takes to reach the next stage.
  const pp::ScheduleSpec spec{P > 1 ? layout.schedule : "gpipe", P, layout.micro_batches, V,
                              layout.stage_replicas};
  // The ranks that run the schedule: P, or every replica of every stage (slots).
  const int slots = spec.slots();
  auto vstage = [&](int chunk, int rank) {
    return replicated ? spec.stage_of_slot(rank) : pp::stage_of(spec, chunk, rank);
  };
  // Each pipeline rank's data-parallel group: dp, or its stage's replicas.
  auto replicas_of = [&](int rank) {
    return replicated ? layout.stage_replicas[spec.stage_of_slot(rank)] : layout.dp;
  };
  const std::vector<std::vector<pp::Action>> lists = pp::build_slot_schedules(spec);
  // A split backward (zero bubble): W is the weight gradients' matmuls, B the rest.
  const bool split = pp::splits_backward(spec.kind);
  std::vector<double> stage_w(stages, 0.0);
  if (split) {
    for (int s = 0; s < stages; ++s) {
      stage_w[s] = stage_sum(s, [&](int i) { return times[i].weight; });
    }
  }
  pp::ActionCosts action_costs;
  action_costs.duration = [&](int rank, const pp::Action& a) {
    const int s = vstage(a.chunk, rank);
    if (a.kind == pp::Action::Forward) return stage_f[s];
    if (a.kind == pp::Action::Weight) return stage_w[s];
    return stage_b[s] - stage_w[s];
  };
  action_costs.transfer = [&](int from, int to, const pp::Action& a) {
    const int s = vstage(a.chunk, to);
    const int boundary =
        a.kind == pp::Action::Forward ? partition.first(s) - 1 : partition.end(s) - 1;
    const double elements = model.layers[std::max(0, boundary)].output_elements * b;
    auto node = [&](int rank) {  // (a slot is a world rank: replicated stages have tp 1)
      return replicated ? rank / cluster.per_node() : place.node_of(rank, 0, 0);
    };
    const bool same_node = node(from) == node(to);
    // Every rank of a node sends its stage's activations at once: each gets its share of the
    // node's network.
    const Link link =
        same_node ? hw.intra_node
                  : Link{hw.inter_node.latency_s, hw.inter_node.bandwidth_Bps / cluster.per_node()};
    return elements * bytes.activation / link.bandwidth_Bps + link.latency_s;
  };
  // The reducer's buckets of a virtual stage's layers (one reducer per chunk), each a list of
  // indices into the stage's layers in launch order; ZeRO-1/2's shards follow them.
  const double grad_bytes = bytes.gradient;
  std::vector<std::vector<std::vector<size_t>>> stage_buckets(stages);
  for (int s = 0; s < stages; ++s) {
    std::vector<parallel::ddp::BucketedParameter> described;
    for (int i = partition.first(s); i < partition.end(s); ++i) {
      described.push_back(
          {static_cast<int64_t>(local_params[i] * grad_bytes), 0, model.layers[i].name});
    }
    stage_buckets[s] = parallel::ddp::assign_buckets(
        described,
        {layout.bucket_cap_bytes, std::min<int64_t>(1 << 20, layout.bucket_cap_bytes), true});
  }
  // --overlap-param-gather: the update's all-gathers run at the start of the step, bucket after
  // bucket in the layers' order (chunk 0's first) on the rank's data-parallel link; a chunk's
  // first forward waits until each of its buckets is in when its layers come: it starts no
  // earlier than max over its buckets of (gathered by - forward time of the layers before).
  const bool overlap_gather =
      layout.overlap_param_gather && (layout.strategy == "zero1" || layout.strategy == "zero2");
  std::vector<std::vector<double>> release(slots, std::vector<double>(V, 0.0));
  std::vector<double> gather_total(slots, 0.0);
  if (overlap_gather) {
    for (int r = 0; r < slots; ++r) {
      const int D = replicas_of(r);
      if (D <= 1) continue;
      const Link dp_link = place.group_link(layout.tp, D);
      double gathered = 0;
      for (int c = 0; c < V; ++c) {
        const int s = vstage(c, r);
        auto buckets = stage_buckets[s];
        for (auto& bucket : buckets) std::sort(bucket.begin(), bucket.end());
        std::sort(buckets.begin(), buckets.end());
        for (const auto& bucket : buckets) {
          double bucket_bytes = 0;
          for (size_t k : bucket) bucket_bytes += local_params[partition.first(s) + k];
          gathered += ring_half(bucket_bytes * bytes.parameter, D, dp_link);
          double before = 0;
          for (int i = partition.first(s);
               i < partition.first(s) + static_cast<int>(bucket.front()); ++i) {
            before += times[i].forward;
          }
          release[r][c] = std::max(release[r][c], gathered - before);
        }
      }
      gather_total[r] = gathered;
    }
    action_costs.release = [&](int rank, const pp::Action& a) {
      return a.kind == pp::Action::Forward && a.micro_batch == 0 ? release[rank][a.chunk] : 0.0;
    };
  }
  const pp::Simulation timeline = pp::simulate(spec, lists, action_costs);
  // What the gathers' waits added to the schedule (counted as exposed communication, not as
  // the pipeline's bubble): the same schedule without them.
  double gather_exposed = 0;
  if (overlap_gather) {
    pp::ActionCosts unreleased = action_costs;
    unreleased.release = nullptr;
    gather_exposed =
        std::max(0.0, timeline.makespan - pp::simulate(spec, lists, unreleased).makespan);
  }
  // PipeDream's flush-free steps: one step of an endless 1F1B stream costs what M more
  // micro-batches add to a long flushed one (the marginal step), every rank busy as in a
  // flushed step.
  const bool flush_free = P > 1 && layout.pipeline_sync != "flush";
  double steady_step = 0;
  if (flush_free) {
    auto makespan_of = [&](int steps) {
      pp::ScheduleSpec longer = spec;
      longer.micro_batches = steps * spec.micro_batches;
      std::vector<std::vector<pp::Action>> stream;
      for (int r = 0; r < P; ++r) stream.push_back(pp::build_schedule(longer, r));
      return pp::simulate(longer, stream, action_costs).makespan;
    };
    steady_step = makespan_of(3) - makespan_of(2);
  }

  // --- Gradient and parameter traffic of the data-parallel group, per pipeline rank: the
  // reducer's buckets over the rank's layers (one reducer per chunk), each leaving when the
  // last micro-batch's backward has produced all its gradients, one after another on the
  // rank's link; ZeRO-3 gathers each layer before its forward and backward (prefetching the
  // next) and reduce-scatters its gradients.
  Prediction out;
  out.layout = layout;
  const int D_grid = layout.dp;
  double worst_end = 0, worst_compute = 0, worst_exposed = 0, worst_bubble = 0, worst_opt = 0;
  for (int r = 0; r < slots; ++r) {
    const int D = replicas_of(r);
    const Link dp_link = place.group_link(layout.tp, D);
    const double compute_end = flush_free                 ? steady_step
                               : timeline.ends[r].empty() ? 0
                                                          : timeline.ends[r].back();
    double busy = 0;
    for (size_t k = 0; k < lists[r].size(); ++k)
      busy += timeline.ends[r][k] - timeline.starts[r][k];
    double rank_params = 0;
    for (int c = 0; c < V; ++c) rank_params += stage_params[vstage(c, r)];
    double comm_end = compute_end;
    double step_end = compute_end;
    if (layout.strategy == "zero3") {
      // pp = 1. One communication stream beside compute: a layer is gathered before its forward
      // (the next one while it computes: dtrain's prefetch) and again before its backward
      // (dtrain frees full parameters after each use); the last micro-batch's backward
      // reduce-scatters each layer's gradients once they are produced.
      auto gather = [&](size_t i) {
        return ring_half(local_params[i] * bytes.parameter * D, D, dp_link);
      };
      double t = 0, stream = 0;
      std::vector<double> gathered(n_layers);
      for (int m = 0; m < layout.micro_batches; ++m) {
        const bool last = m == layout.micro_batches - 1;
        stream = std::max(stream, t) + gather(0);
        gathered[0] = stream;
        for (size_t i = 0; i < n_layers; ++i) {
          const double start = std::max(t, gathered[i]);
          if (i + 1 < n_layers) {
            stream = std::max(stream, start) + gather(i + 1);
            gathered[i + 1] = stream;
          }
          t = start + times[i].forward;
        }
        stream = std::max(stream, t) + gather(n_layers - 1);
        gathered[n_layers - 1] = stream;
        for (size_t i = n_layers; i-- > 0;) {
          const double start = std::max(t, gathered[i]);
          if (i > 0) {
            stream = std::max(stream, start) + gather(i - 1);
            gathered[i - 1] = stream;
          }
          t = start + times[i].backward;
          if (last)
            stream = std::max(stream, t) + ring_half(local_params[i] * grad_bytes * D, D, dp_link);
        }
      }
      busy = 0;
      for (size_t i = 0; i < n_layers; ++i) {
        busy += layout.micro_batches * (times[i].forward + times[i].backward);
      }
      comm_end = std::max(t, stream);
      step_end = comm_end;
    } else if (layout.strategy != "downpour" && D > 1) {
      double link_free = gather_total[r];  // (0 unless the gathers overlap this step's start)
      for (int c = 0; c < V; ++c) {
        const int s = vstage(c, r);
        // The last backward of this chunk: its start, then layers in reverse order.
        double last_start = 0;
        for (size_t k = 0; k < lists[r].size(); ++k) {
          const pp::Action& a = lists[r][k];
          // The gradients are complete as the chunk's last backward (split: its last W) runs.
          const auto accumulates = split ? pp::Action::Weight : pp::Action::Backward;
          if (a.kind == accumulates && a.chunk == c) last_start = timeline.starts[r][k];
        }
        // Flush-free: the step's last backward on this rank ends the steady step.
        if (flush_free) last_start += steady_step - timeline.ends[r].back();
        std::vector<double> ready(n_layers, 0);
        double t = last_start;
        for (int i = partition.end(s); i-- > partition.first(s);) {
          t += split ? times[i].weight : times[i].backward;
          ready[i] = t;
        }
        for (const auto& bucket : stage_buckets[s]) {
          double bucket_bytes = 0, bucket_ready = 0;
          for (size_t k : bucket) {
            bucket_bytes += local_params[partition.first(s) + k] * grad_bytes;
            bucket_ready = std::max(bucket_ready, ready[partition.first(s) + k]);
          }
          double duration = 0;
          // zero1 and zero2: a reduce-scatter (sequence parallelism's partial LayerNorm
          // gradients are summed over the TP group before, as each is ready: tiny, not timed).
          if (layout.strategy == "zero2" || layout.strategy == "zero1") {
            duration = ring_half(bucket_bytes, D, dp_link);
          } else if (layout.hierarchical_allreduce && D > cluster.per_node() / layout.tp) {
            const int inside = std::max(1, cluster.per_node() / layout.tp);
            duration = 2 * ring_half(bucket_bytes, inside, hw.intra_node) +
                       allreduce(bucket_bytes / inside, D / inside,
                                 place.group_link(layout.tp * inside, D / inside), tree);
          } else {
            duration = allreduce(bucket_bytes, D, dp_link, tree);
          }
          link_free = std::max(link_free, bucket_ready) + duration;
        }
      }
      comm_end = std::max(compute_end, link_free);
      step_end = comm_end;
      if ((layout.strategy == "zero1" || layout.strategy == "zero2") && !overlap_gather) {
        // After the sharded update, every rank gathers the others' updated parameters (bucket
        // by bucket, each its own collective).
        for (int c = 0; c < V; ++c) {
          const int s = vstage(c, r);
          for (const auto& bucket : stage_buckets[s]) {
            double bucket_params = 0;
            for (size_t k : bucket) bucket_params += local_params[partition.first(s) + k];
            step_end += ring_half(bucket_params * bytes.parameter, D, dp_link);
          }
        }
      }
    }
    // The optimizer step: memory-bound over this rank's (share of the) parameters. Adam reads
    // weight, gradient and two moments and writes three; the "-master" layouts also read and
    // write the 16-bit copies.
    const double shard = (layout.strategy == "ddp" || layout.strategy == "downpour") ? 1.0 : D;
    // dtrain's optimizers are LibTorch's, one operator after another per tensor: Adam(W)
    // makes 22 element passes over its fp32 state (decay 2, first moment 2 + 3, second 2 + 3,
    // the denominator's sqrt, division and epsilon 2 + 2 + 2, the update 4), momentum SGD 8,
    // SGD 3. The "-master" layouts are Megatron's and DeepSpeed's fused kernels: one pass
    // reading weight, gradient, master and moments and writing weight, master and moments.
    // Every step also zeroes the gradients (one write) and clips their norm (a read for the
    // norm, a read and a write to scale): 4 more passes over them.
    const bool fused = layout.precision.size() > 7 &&
                       layout.precision.compare(layout.precision.size() - 7, 7, "-master") == 0;
    const double passes = layout.optimizer == "adam" ? 22 : layout.optimizer == "momentum" ? 8 : 3;
    const double state_element = bytes.parameter;  // fp32 (2 for bf16), like the weights
    const double opt_bytes_per = (fused ? 3 * bytes.parameter + bytes.gradient + 2 * bytes.optimizer
                                        : passes * state_element) +
                                 4 * bytes.gradient;
    int rank_layers = 0;
    for (int c = 0; c < V; ++c) {
      const int s = vstage(c, r);
      rank_layers += partition.end(s) - partition.first(s);
    }
    // (Downpour's workers leave the update to the shards.)
    // PipeDream: each update also copies the newest version into a buffer of its own (a read
    // and a write of the weights); async updates after every micro-batch.
    const double updates = layout.pipeline_sync == "async" && P > 1 ? layout.micro_batches : 1;
    const double version_copy = flush_free ? 2 * rank_params * bytes.parameter / byte_rate : 0;
    const double opt_s = layout.strategy == "downpour"
                             ? 0.0
                             : updates * (rank_params / shard * opt_bytes_per / byte_rate +
                                          rank_layers * 4 * overhead + version_copy);
    step_end += opt_s;
    const double exposed = step_end - opt_s - compute_end + gather_exposed;
    if (step_end > worst_end) {
      worst_end = step_end;
      worst_exposed = std::max(0.0, exposed);
      worst_opt = opt_s;
    }
    // The pipeline's bubble as the busiest stage sees it (the one that sets the pace).
    if (busy > worst_compute) {
      worst_compute = busy;
      worst_bubble =
          P > 1 ? 1 - busy / (flush_free ? steady_step : timeline.makespan - gather_exposed) : 0.0;
    }
  }
  out.step_s = worst_end;
  const int D = D_grid;
  if (layout.strategy == "downpour" && D > 1) {
    // Asynchronous workers: each pulls the parameters and pushes its gradients every step
    // (4 bytes each way per parameter) over its node's share of the network; the shards
    // together serve every worker, each on its own node's link.
    double params = 0;
    for (double p : local_params) params += p;
    const Link worker_link{hw.inter_node.latency_s,
                           hw.inter_node.bandwidth_Bps / cluster.per_node()};
    const double exchange = 2 * params * 4 / worker_link.bandwidth_Bps + 2 * worker_link.latency_s;
    const double worker_step = out.step_s + exchange;
    const double server_step =
        D * 2 * params * 4 / (layout.ps_shards * hw.inter_node.bandwidth_Bps);
    worst_exposed = std::max(worker_step, server_step) - out.step_s;
    out.step_s = std::max(worker_step, server_step);
  }
  out.compute_s = worst_compute;
  out.exposed_comm_s = worst_exposed;
  out.optimizer_s = worst_opt;
  out.bubble = worst_bubble;

  // --- Memory of every rank, and of the rank that needs the most.
  out.stage_memory = slot_memory(model, layout, bytes, local_params,
                                 {partition, vstage, replicas_of, slots}, timeline, flush_free);
  for (const Memory& m : out.stage_memory) {
    if (m.total() > out.memory.total()) out.memory = m;
  }
  out.fits = out.memory.total() <= hw.memory_bytes;
  out.samples_per_s = layout.global_batch() / out.step_s;
  out.model_flops_per_step = model.model_flops_per_sample() * layout.global_batch();
  out.mfu = out.model_flops_per_step / out.step_s / (cluster.gpus() * peak * share);
  return out;
}

}  // namespace dtrain::plan
