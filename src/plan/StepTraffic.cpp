// The planner's communication and update part: what a slot's data-parallel group sends as its
// strategy declares it (parallel::StepCost::Traffic), the optimizer's update, and the parameter
// server's exchange.
#include <algorithm>
#include <vector>

#include "plan/StepModel.h"

namespace dtrain::plan {

namespace pp = parallel::pipeline;
using Traffic = parallel::StepCost::Traffic;

namespace {

/// Each layer gathered before its forward and again before its backward (pp = 1; dtrain frees
/// full parameters after each use and prefetches the next layer while one computes), on one
/// communication stream beside compute; the last micro-batch's backward reduce-scatters each
/// layer's gradients once they are produced.
SlotStep gather_each_layer(const Step& step, int D, const Link& dp_link) {
  const size_t n = step.model.layers.size();
  auto gather = [&](size_t i) {
    return ring_half(step.local_params[i] * step.bytes.parameter * D, D, dp_link);
  };
  double t = 0, stream = 0;
  std::vector<double> gathered(n);
  for (int m = 0; m < step.layout.micro_batches; ++m) {
    const bool last = m == step.layout.micro_batches - 1;
    stream = std::max(stream, t) + gather(0);
    gathered[0] = stream;
    for (size_t i = 0; i < n; ++i) {
      const double start = std::max(t, gathered[i]);
      if (i + 1 < n) {
        stream = std::max(stream, start) + gather(i + 1);
        gathered[i + 1] = stream;
      }
      t = start + step.times[i].forward;
    }
    stream = std::max(stream, t) + gather(n - 1);
    gathered[n - 1] = stream;
    for (size_t i = n; i-- > 0;) {
      const double start = std::max(t, gathered[i]);
      if (i > 0) {
        stream = std::max(stream, start) + gather(i - 1);
        gathered[i - 1] = stream;
      }
      t = start + step.times[i].backward;
      if (last) {
        stream = std::max(stream, t) +
                 ring_half(step.local_params[i] * step.bytes.gradient * D, D, dp_link);
      }
    }
  }
  SlotStep out;
  for (size_t i = 0; i < n; ++i) {
    out.busy += step.layout.micro_batches * (step.times[i].forward + step.times[i].backward);
  }
  out.end = std::max(t, stream);
  return out;
}

/// How long one bucket of `bytes` of gradients takes: a reduce-scatter into the shards
/// (sequence parallelism's partial LayerNorm gradients are summed over the TP group before, as
/// each is ready: tiny, not timed), or an all-reduce (hierarchical: inside nodes, then across).
double bucket_time(const Step& step, double bytes, int D, const Link& dp_link) {
  if (step.strategy.cost.traffic == Traffic::kReduceScatterGather) {
    return ring_half(bytes, D, dp_link);
  }
  const int per_node = step.cluster.per_node(), tp = step.layout.tp;
  if (step.layout.hierarchical_allreduce && D > per_node / tp) {
    const int inside = std::max(1, per_node / tp);
    return 2 * ring_half(bytes, inside, step.hw.intra_node) +
           allreduce(bytes / inside, D / inside, step.place.group_link(tp * inside, D / inside),
                     step.tree);
  }
  return allreduce(bytes, D, dp_link, step.tree);
}

/// A collective `time(step, bytes, ranks, link)` over the ranks holding the same experts (every
/// ep-th data-parallel rank of D).
template <typename Time>
double expert_time(const Step& step, double bytes, int D, Time time) {
  if (bytes <= 0) return 0;
  const int ep = step.layout.ep, ranks = std::max(1, D / ep);
  return time(step, bytes, ranks, step.place.group_link(step.layout.tp * ep, ranks));
}

/// The reducer's buckets over the slot's layers (one reducer per chunk), each leaving when the
/// last micro-batch's backward has produced all its gradients, one after another on the
/// slot's link (free from `link_free` on). Returns when the last one is done.
double bucket_stream(const Step& step, const Timeline& timeline, int r, int D,
                     const Link& dp_link) {
  const std::vector<pp::Action>& list = step.lists[r];
  double link_free = timeline.gathered[r];  // (0 unless the gathers overlap this step's start)
  for (int c = 0; c < step.V; ++c) {
    const int s = step.vstage(c, r);
    const int first = step.partition.first(s);
    // The last backward of this chunk: its start, then layers in reverse order. The gradients
    // are complete as the chunk's last backward (split: its last W) runs.
    double last_start = 0;
    const auto accumulates = step.split ? pp::Action::Weight : pp::Action::Backward;
    for (size_t k = 0; k < list.size(); ++k) {
      if (list[k].kind == accumulates && list[k].chunk == c) {
        last_start = timeline.simulation.starts[r][k];
      }
    }
    // Flush-free: the step's last backward on this rank ends the steady step.
    if (step.flush_free) last_start += timeline.steady_step - timeline.simulation.ends[r].back();
    std::vector<double> ready(step.model.layers.size(), 0);
    double t = last_start;
    for (int i = step.partition.end(s); i-- > first;) {
      t += step.split ? step.times[i].weight : step.times[i].backward;
      ready[i] = t;
    }
    for (const auto& bucket : step.buckets[s]) {
      double bucket_bytes = 0, expert_bytes = 0, bucket_ready = 0;
      for (size_t k : bucket) {
        bucket_bytes += step.local_params[first + k] * step.bytes.gradient;
        expert_bytes += step.local_expert_params[first + k] * step.bytes.gradient;
        bucket_ready = std::max(bucket_ready, ready[first + k]);
      }
      // (A mixture of experts' experts: over the dp / ep ranks holding the same ones.)
      link_free = std::max(link_free, bucket_ready) +
                  bucket_time(step, bucket_bytes - expert_bytes, D, dp_link) +
                  expert_time(step, expert_bytes, D, bucket_time);
    }
  }
  return link_free;
}

/// After the sharded update, every rank gathers the others' updated parameters (bucket by
/// bucket, each its own collective).
double updated_shard_gathers(const Step& step, int r, int D, const Link& dp_link) {
  double total = 0;
  for (int c = 0; c < step.V; ++c) {
    const int s = step.vstage(c, r);
    for (const auto& bucket : step.buckets[s]) {
      double bucket_params = 0, experts = 0;
      for (size_t k : bucket) {
        bucket_params += step.local_params[step.partition.first(s) + k];
        experts += step.local_expert_params[step.partition.first(s) + k];
      }
      total += ring_half((bucket_params - experts) * step.bytes.parameter, D, dp_link) +
               expert_time(step, experts * step.bytes.parameter, D,
                           [](const Step&, double bytes, int ranks, const Link& link) {
                             return ring_half(bytes, ranks, link);
                           });
    }
  }
  return total;
}

}  // namespace

SlotStep data_parallel_step(const Step& step, const Timeline& timeline, int slot) {
  const int D = step.replicas_of(slot);
  const Link dp_link = step.place.group_link(step.layout.tp, D);
  const parallel::StepCost& cost = step.strategy.cost;
  if (cost.traffic == Traffic::kGatherEachLayer) return gather_each_layer(step, D, dp_link);
  SlotStep out{timeline.compute_end(step, slot), timeline.busy(slot)};
  if (cost.traffic == Traffic::kParameterServer || D <= 1) return out;
  out.end = std::max(out.end, bucket_stream(step, timeline, slot, D, dp_link));
  if (cost.gathers_updated_shards() && !timeline.overlaps_gathers) {
    out.end += updated_shard_gathers(step, slot, D, dp_link);
  }
  return out;
}

double optimizer_time(const Step& step, int slot) {
  // (The parameter server's shards update; its workers do not.)
  if (step.strategy.server_optimizer) return 0;
  const Layout& layout = step.layout;
  const Bytes& bytes = step.bytes;
  // Memory-bound over this rank's (share of the) parameters. dtrain's optimizers are
  // LibTorch's, one operator after another per tensor: Adam(W) makes 22 element passes over
  // its fp32 state (decay 2, first moment 2 + 3, second 2 + 3, the denominator's sqrt, division
  // and epsilon 2 + 2 + 2, the update 4), momentum SGD 8, SGD 3. The "-master" layouts are
  // Megatron's and DeepSpeed's fused kernels: one pass reading weight, gradient, master and
  // moments and writing weight, master and moments. Every step also zeroes the gradients (one
  // write) and clips their norm (a read for the norm, a read and a write to scale): 4 more
  // passes over them.
  const bool shards = step.strategy.cost.shards_optimizer;
  const bool fused = layout.precision.size() > 7 &&
                     layout.precision.compare(layout.precision.size() - 7, 7, "-master") == 0;
  const double passes = layout.optimizer == "adam" ? 22 : layout.optimizer == "momentum" ? 8 : 3;
  const double state_element = bytes.parameter;  // fp32 (2 for bf16), like the weights
  const double per_parameter = (fused ? 3 * bytes.parameter + bytes.gradient + 2 * bytes.optimizer
                                      : passes * state_element) +
                               4 * bytes.gradient;
  const double params = step.slot_params(slot);
  // (Sharded: its part of the dense parameters over dp ranks, of the experts over dp / ep.)
  const double local =
      shards ? step.sharded_share(params, step.slot_expert_params(slot), slot) : params;
  // PipeDream: each update also copies the newest version into a buffer of its own (a read
  // and a write of the weights); async updates after every micro-batch.
  const double updates = layout.pipeline_sync == "async" && step.P > 1 ? layout.micro_batches : 1;
  const double version_copy =
      step.flush_free ? 2 * params * bytes.parameter / step.rates.byte_rate : 0;
  const double on_device =
      updates * (local * per_parameter / step.rates.byte_rate +
                 step.slot_layers(slot) * 4 * step.rates.overhead + version_copy);
  if (layout.offload == "none") return on_device;
  // Offload. On a GPU the step runs on the CPU over host copies: the gradients come over the
  // host link and the parameters go back; on a CPU profile the device is the host. With the
  // state on disk, the node's ranks read and write theirs every step through its one disk,
  // overlapped with the update (the next bucket read, the last written, during a bucket's).
  const Hardware& hw = step.hw;
  const double update = hw.shared_cores
                            ? on_device
                            : local * per_parameter / hw.host_memory_bandwidth_Bps +
                                  local * (bytes.gradient + bytes.parameter) / hw.host_link_Bps;
  if (layout.offload == "host") return update;
  const double state = local * bytes.optimizer * step.cluster.per_node();
  return std::max(update, state / hw.disk_read_Bps + state / hw.disk_write_Bps);
}

double parameter_server_step(const Step& step, double worker_s) {
  // Each worker pulls the parameters and pushes its gradients every step (4 bytes each way per
  // parameter) over its node's share of the network; the shards together serve every worker,
  // each on its own node's link.
  double params = 0;
  for (double p : step.local_params) params += p;
  const Link& network = step.hw.inter_node;
  const Link worker_link{network.latency_s, network.bandwidth_Bps / step.cluster.per_node()};
  const double exchange = 2 * params * 4 / worker_link.bandwidth_Bps + 2 * worker_link.latency_s;
  const double server_s =
      step.layout.dp * 2 * params * 4 / (step.layout.ps_shards * network.bandwidth_Bps);
  return std::max(worker_s + exchange, server_s);
}

}  // namespace dtrain::plan
