// The planner's model of one optimizer step, in parts: what a rank computes (layer_times, in
// Planner.cpp), the pipeline that orders it (StepPipeline.cpp), what its data-parallel group
// sends and its optimizer updates (StepTraffic.cpp), and what it keeps in memory
// (StepMemory.cpp). predict (Planner.cpp) composes them. docs/PLAN.md states each rule and its
// source. The strategy's part of each is what it declares (parallel::StepCost): no part
// compares a strategy's or a schedule's name.
#pragma once

#include <string>
#include <vector>

#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/Partition.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {

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
Bytes bytes_of(const Layout& layout);

/// All-reduce of `bytes` over `ranks`. Ring (Patarasuk & Yuan's bound; Gloo's and NCCL's
/// ring): each rank sends what the step records' wire_bytes count (comm::ring_wire_bytes,
/// 2 (n-1)/n of the data) in 2 (n-1) steps. With `tree` (NCCL, which picks per call): the
/// double binary tree's 2 log2(n) steps when they are faster (each rank still sends and
/// receives about twice the data).
double allreduce(double bytes, int ranks, const Link& link, bool tree);
/// Reduce-scatter or all-gather: half a ring all-reduce.
double ring_half(double bytes, int ranks, const Link& link);
/// All-to-all of `bytes` per rank over `ranks` (a mixture of experts' dispatch or combine): each
/// rank sends (n-1)/n of them, to every peer at once.
double all_to_all(double bytes, int ranks, const Link& link);

/// Where a rank of the grid sits: ranks are laid out as dtrain's ProcessGrid does, tensor-
/// parallel fastest, then data-parallel, then pipeline; consecutive ranks fill a node.
struct Placement {
  const Cluster& cluster;
  const Layout& layout;
  int node_of(int pp_index, int dp_index, int tp_index) const;
  /// The link a group whose members are `stride` ranks apart, `size` of them, runs on: inside
  /// a node when they all fit in one; across nodes otherwise, where every rank of a node that
  /// talks across at once shares the node's network bandwidth (NCCL spreads rings over all the
  /// node's NICs), and no faster than the node's own links.
  Link group_link(int stride, int size) const;
};

/// What one rank computes at: its compute dtype's matrix products, memory, the element-wise
/// kernels and one operator's fixed cost (a CPU profile's ranks with their share of the cores).
struct Rates {
  const Hardware& hw;
  std::string dtype;
  double share, byte_rate, elementwise_rate, overhead;
};

struct LayerTime {
  double forward = 0, backward = 0;  // one micro-batch, this TP rank, TP all-reduces included
  double weight = 0;                 // the part of backward forming the weight gradients
  double alltoall = 0;  // the part of forward, and again of backward, exchanging with experts
};

/// What every part of the step reads: the layout's rates and placement, each layer's time on
/// one TP rank, the layers' partition over virtual stages (dtrain's balanced partition by
/// forward + backward time) and the schedule builder's action lists of every slot (a pipeline
/// rank, or a replica of a replicated stage).
struct Step {
  Step(const ModelCost& model, const Cluster& cluster, const Layout& layout);

  const ModelCost& model;
  const Cluster& cluster;
  const Layout& layout;
  const Hardware& hw;
  /// The layout's strategy as the registry declares it (cost: its StepCost).
  const parallel::StrategyInfo& strategy;
  const Bytes bytes;
  /// GPU profiles run NCCL, which picks a ring or a tree per all-reduce; CPU profiles Gloo's ring.
  const bool tree;
  const Rates rates;
  const Placement place;
  /// Per layer: its parameters on one TP rank (of them, its experts' on one expert-parallel
  /// rank), and its times.
  std::vector<double> local_params, local_expert_params;
  std::vector<LayerTime> times;
  int P, V, stages;
  /// PipeDream's replicated stages: a stage's work shared by its replicas.
  bool replicated;
  parallel::pipeline::Partition partition;
  /// Per virtual stage: forward, backward (W included) and W time of a micro-batch; parameters.
  std::vector<double> stage_f, stage_b, stage_w, stage_params;
  /// Per virtual stage: its all-to-alls' share of forward (and again of backward).
  std::vector<double> stage_alltoall;
  parallel::pipeline::ScheduleSpec spec;
  int slots;
  std::vector<std::vector<parallel::pipeline::Action>> lists;
  /// A split backward (zero bubble: W is the weight gradients' products, B the rest).
  bool split;
  /// PipeDream's flush-free steps.
  bool flush_free;
  /// Per virtual stage: the reducer's buckets of its layers (one reducer per chunk), each a list
  /// of indices into the stage's layers in launch order; ZeRO-1/2's shards follow them.
  std::vector<std::vector<std::vector<size_t>>> buckets;

  int vstage(int chunk, int slot) const;
  /// A slot's data-parallel group: dp, or its stage's replicas.
  int replicas_of(int slot) const;
  /// The layers of a slot's chunks.
  int slot_layers(int slot) const;
  double slot_params(int slot) const;
  double slot_expert_params(int slot) const;
  /// What a strategy that shards over the slot's data-parallel group keeps of `params` (of them
  /// `experts`, sharded over the ranks holding the same experts: dp / ep).
  double sharded_share(double params, double experts, int slot) const;
};

/// The pipeline's step (or, with pp = 1, the micro-batches one after another) through the
/// schedule builder's lists and its simulator.
struct Timeline {
  parallel::pipeline::Simulation simulation;
  /// PipeDream's flush-free steps: one step of an endless stream.
  double steady_step = 0;
  /// --overlap-param-gather: per slot, its all-gathers' total, and what their waits added to
  /// the schedule (exposed communication, not the pipeline's bubble).
  std::vector<double> gathered;
  double gather_exposed = 0;
  bool overlaps_gathers = false;
  /// When a slot's computation ends, and how long it computed.
  double compute_end(const Step& step, int slot) const;
  double busy(int slot) const;
};
Timeline simulate_pipeline(const Step& step);

/// What a slot's data-parallel communication adds: when its step ends before the optimizer
/// (its computation's end, or the last collective's), and how long it computed.
struct SlotStep {
  double end = 0;
  double busy = 0;
};
SlotStep data_parallel_step(const Step& step, const Timeline& timeline, int slot);
/// The optimizer's update on a slot (memory-bound over its share of the parameters).
double optimizer_time(const Step& step, int slot);
/// Asynchronous workers' exchange with the parameter-server shards: the step time of the
/// slowest of a worker and the shards, for a worker whose own step takes `worker_s`.
double parameter_server_step(const Step& step, double worker_s);

/// Each slot's memory: its layers' parameters, gradients and optimizer state as the strategy
/// shards them, the activations of its micro-batches in flight (the schedule's peak), the
/// strategy's buffers.
std::vector<Memory> slot_memory(const Step& step, const Timeline& timeline);

}  // namespace dtrain::plan
