// `dtrain plan`: the step time and per-rank memory of a layout on a cluster, predicted by a
// discrete-event simulation built from dtrain's own pieces: the pipeline schedule builder's
// action lists (and its simulator, with per-stage costs and link delays), the reducer's bucket
// rule (which buckets exist and when each can leave), ZeRO's shard sizes and gather/prefetch
// order, tensor parallelism's all-reduces per block, and the memory each strategy keeps.
// docs/PLAN.md explains the model, its assumptions and its validation.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/plan/Hardware.h"
#include "dtrain/plan/ModelCost.h"

namespace dtrain::plan {

struct Cluster {
  Hardware hardware;
  int nodes = 1;
  int gpus_per_node = 0;  ///< 0: the profile's
  int gpus() const { return nodes * per_node(); }
  int per_node() const { return gpus_per_node > 0 ? gpus_per_node : hardware.gpus_per_node; }
};

struct Layout {
  /// "ddp", "zero1", "zero2", "zero3" (data parallelism over DP, each with TP and PP), or
  /// "downpour" (asynchronous workers pushing to and pulling from parameter-server shards).
  std::string strategy = "ddp";
  int dp = 1, pp = 1, tp = 1;
  /// A mixture of experts' experts split over this many data-parallel ranks (dtrain train
  /// --expert-parallel; the experts' gradients reduced over the dp / ep ranks holding the same).
  int ep = 1;
  /// Context parallelism (dtrain train --context-parallel): each sample's sequence split over
  /// this many ranks inside the data-parallel group (ranks = dp x cp x pp x tp; the gradients
  /// reduced over dp x cp, ZeRO's shards over them), attention by `cp_method`: "ring" (keys and
  /// values passed around, each transfer hidden behind a block's computation where it can be),
  /// "allgather" or "ulysses".
  int cp = 1;
  std::string cp_method = "ring";
  int micro_batch_size = 1;       ///< samples per micro-batch on one replica
  int micro_batches = 1;          ///< per optimizer step (gradient accumulation when pp = 1)
  std::string schedule = "1f1b";  ///< "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v"
  int chunks = 1;                 ///< model chunks per pipeline rank (interleaved; zb-v: 2)
  /// "flush", or PipeDream's flush-free steps: "2bw" or "eager" (two weight versions, an
  /// update per step) or "async" (an update per micro-batch, a version per micro-batch in
  /// flight); 1f1b only.
  std::string pipeline_sync = "flush";
  /// PipeDream's layouts (dtrain train --stage-replicas): stage s on stage_replicas[s] ranks,
  /// one data stream (dp 1), each stage's micro-batches dealt to its replicas in turn; single-
  /// chunk flushed schedules, ddp, tp 1. Empty: every stage on dp ranks.
  std::vector<int> stage_replicas;
  std::string precision = "bf16-mixed";  ///< "fp32", "bf16-mixed", "fp16-mixed", "bf16"
  bool checkpointing = false;            ///< activation checkpointing of every layer
  /// Selective recomputation (dtrain train --checkpointing selective): only attention's core
  /// is recomputed in backward; ignored with `checkpointing`.
  bool selective_recompute = false;
  bool sequence_parallel = false;
  std::string optimizer = "adam";  ///< "adam", "sgd", "momentum"
  int64_t bucket_cap_bytes = 25LL * 1024 * 1024;
  bool hierarchical_allreduce = false;  ///< data-parallel buckets: inside nodes, then across
  /// zero1, zero2 (dtrain train --overlap-param-gather): the update's parameter all-gathers,
  /// bucket by bucket, run into the next step, each waited where the first forward needs it.
  bool overlap_param_gather = false;
  /// tp > 1 (dtrain train --tp-comm-overlap): backward's input-gradient all-reduces of the
  /// column-parallel layers run beside their weight-gradient products (not under a split,
  /// zero-bubble backward, whose weight gradients wait for W).
  bool tp_comm_overlap = false;
  int ps_shards = 1;  ///< downpour: parameter-server shards (one per node)
  /// Where the optimizer's state lives (dtrain train --offload): "none" (on the device),
  /// "host" (with fp32 master weights in host memory, the step on the CPU: ZeRO-Offload) or
  /// "disk" (in files read and written every step: ZeRO-Infinity's NVMe tier).
  std::string offload = "none";
  int64_t global_batch() const {
    return static_cast<int64_t>(dp) * micro_batch_size * micro_batches;
  }
  int ranks() const;
  std::string describe() const;  ///< "dp8 pp4 tp8 1f1b m16x1 bf16-mixed ckpt"
  /// The dtrain train flags of this layout's parallelism (strategy, pipeline, schedule,
  /// micro-batches, batch size, checkpointing of each of the model's `layers`; stages balanced
  /// by measured time, as the planner places them).
  std::string train_flags(int layers) const;
  /// The command that trains `model` in this layout on `cluster`: `dtrain train --nproc G` on
  /// one node, `dtrain launch --nnodes N --nproc-per-node G ... -- dtrain train` on several;
  /// the model's flags, the device and backend of the cluster's profile, this layout's flags
  /// with its global batch.
  std::string command(const ModelCost& model, const Cluster& cluster) const;
};

struct Memory {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0;
  /// The peak while the model is built and sharded, before step 1: the rank's shard plus the
  /// largest parameter where the strategy draws only its shard (zero3 without a pipeline),
  /// else every parameter the rank builds (the whole model but for its tensor-parallel
  /// slices), in fp32.
  double setup = 0;
  /// Offloaded: bytes in host memory and on disk (not on the device).
  double host = 0, disk = 0;
  /// On the device during a step.
  double total() const { return parameters + gradients + optimizer + activations + buffers; }
  /// The most the device holds at any time: the step's or the setup's.
  double peak() const { return std::max(total(), setup); }
};

/// The device memory one rank has: the accelerator's, or on a CPU profile (the ranks share a
/// node's memory) the node's over the ranks it runs.
double rank_memory_bytes(const Cluster& cluster);

struct Prediction {
  Layout layout;
  double step_s = 0;          ///< one optimizer step
  double compute_s = 0;       ///< the busiest rank's computation (including TP all-reduces)
  double bubble = 0;          ///< pipeline idle share of the busiest stage
  double exposed_comm_s = 0;  ///< data-parallel / ZeRO / PS communication not hidden
  double optimizer_s = 0;
  Memory memory;                     ///< of the rank that needs the most
  std::vector<Memory> stage_memory;  ///< per pipeline rank (stage 0 first)
  double samples_per_s = 0;
  double model_flops_per_step = 0;
  double mfu = 0;    ///< model flop/s over the GPUs' peak in the compute dtype
  /// The step's memory.total() <= rank_memory_bytes(), and the host memory holds what is
  /// offloaded.
  bool fits = true;
  /// memory.setup <= rank_memory_bytes(): false for most pipelines of a model larger than a
  /// rank, whose ranks build every stage today (issue 80). The search ranks by `fits` (the
  /// layouts the anchors run), `dtrain train --dry-run` refuses a run where either is false.
  bool setup_fits = true;
};

/// The strategies the planner models (each declares its StepCost beside its code), in the
/// registry's order; `synchronous`: only those whose step is the single-process step (not the
/// parameter server's asynchronous workers).
std::vector<std::string> planned_strategies(bool synchronous = false);

/// InputError naming what is wrong: ranks != the cluster's GPUs, a divisibility (layers over
/// pp x chunks, heads or hidden over tp), an unknown strategy, schedule or precision, a
/// schedule the builder refuses (1F1B with fewer micro-batches than stages, ...).
void check_layout(const ModelCost& model, const Cluster& cluster, const Layout& layout);

/// Checks the layout, then simulates one step. Does not refuse a layout that does not fit in
/// memory: `fits` says so (the CLI refuses it).
Prediction predict(const ModelCost& model, const Cluster& cluster, const Layout& layout);

struct SearchOptions {
  int64_t global_batch = 0;  ///< samples per step, fixed
  /// The strategies to try (empty: every synchronous strategy the planner models, as the
  /// registry declares them: ddp, zero1, zero2, zero3).
  std::vector<std::string> strategies;
  /// The pipeline schedules to try with pp > 1 (empty: every registered one).
  std::vector<std::string> schedules;
  std::string precision = "bf16-mixed";
  std::string optimizer = "adam";
  /// Layouts with activation checkpointing of every layer, and for models with attention,
  /// with selective recomputation, beside those without.
  bool allow_checkpointing = true;
  /// Layouts that do not fit, tried again with the optimizer's state in host memory or on
  /// disk where the profile gives the rates to predict them by (dtrain train --offload).
  bool allow_offload = true;
  int max_micro_batch_size = 16;
  /// Pipeline syncs to try with pp > 1 (1f1b, ddp): "flush" always; PipeDream's "2bw", "eager"
  /// or "async" only when asked (they change the training's math: stale gradients).
  std::vector<std::string> pipeline_syncs = {"flush"};
  /// PipeDream's layouts too: a pipeline of 2 to 4 stages replicated unequally over the GPUs
  /// (every split of them that is not even: the even ones are dp x pp), 1f1b with ddp, tp 1;
  /// at most 16 GPUs (the splits grow combinatorially).
  bool replicated_stages = false;
  /// Context-parallel sizes to try beside cp 1 (each that divides the data-parallel ranks and
  /// whose 2 cp divides the sequence), with the ring. Empty: 2, 4, ... up to 16 for sequences of
  /// 8192 tokens and more, none below.
  std::vector<int> context_parallel;
  /// The step options: set, pinned on or off; unset, the search decides: every layout is
  /// simulated with each of them on wherever it applies, and the `refine` fastest again with
  /// every combination of them (each usually takes time away, but not always: it moves the
  /// stages' balance and the pipeline's timing). Sequence parallelism (tp > 1; not with
  /// PipeDream's eager sync), --overlap-param-gather (zero1, zero2), --tp-comm-overlap (tp > 1).
  std::optional<bool> sequence_parallel, overlap_param_gather, tp_comm_overlap;
  size_t refine = 64;
};
struct SearchResult {
  std::vector<Prediction> ranked;  ///< layouts that fit, fastest first
  int considered = 0;              ///< layouts enumerated
  int variants = 0;                ///< step-option variants of the fastest, simulated beside them
  double smallest_memory = 0;  ///< over every layout considered (for "needs at least")
};
/// Every valid layout of the cluster's GPUs at the global batch (DP x PP x TP, micro-batch size,
/// schedule and chunks, recomputation, strategy, the step options), simulated, those that fit
/// ranked by step time.
SearchResult search(const ModelCost& model, const Cluster& cluster, const SearchOptions& options);

}  // namespace dtrain::plan
