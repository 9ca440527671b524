// Pipeline schedules: which forward and backward passes each pipeline rank runs, in order, for
// one optimizer step of M micro-batches. One function builds every schedule (GPipe, 1F1B,
// interleaved 1F1B, the zero-bubble ZB-H1, ZB-H2 and ZB-V whose backward is split into B, the
// input gradient, and W, the weight gradients; DualPipe-V, ZB-V's placement with pairs of one
// micro-batch's forward and another's backward run together); the executor runs any list, deriving
// the sends and receives from it (and where each virtual stage lives from stage_of / rank_of). A
// small event simulator gives a schedule's ideal timeline (bubble, peak activations) and proves
// that the ranks' lists cannot deadlock, for tests and for the benchmark's "formula" column.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::parallel::pipeline {

struct Action {
  /// Backward: the whole backward, or only the input gradient when the schedule splits it;
  /// Weight: the weight gradients of a split backward (after the micro-batch's B).
  enum Kind { Forward, Backward, Weight } kind = Forward;
  int micro_batch = 0;
  /// Which of this rank's model chunks (0 unless interleaved, zb-v or dualpipev); stage_of() says
  /// which virtual stage it is.
  int chunk = 0;
  /// A forward run alongside the backward that follows it in the list (another chunk's, another
  /// micro-batch's; with the W of that backward when one comes right after it): DualPipe-V's
  /// overlapped pair. The executor receives both inputs first, then runs the forward on this
  /// thread and the backward on another, so that one's all-to-alls wait while the other
  /// computes, then sends both results.
  bool overlapped = false;
  bool operator==(const Action& other) const {
    return kind == other.kind && micro_batch == other.micro_batch && chunk == other.chunk &&
           overlapped == other.overlapped;
  }
};
/// "F3" / "B3" / "W3", "F3.1" with a chunk, "F3.1&" for an overlapped forward.
std::string to_string(const Action& action);
/// How many actions of `list` from `i` run as one: 1, or an overlapped pair's 2 (its forward and
/// backward) or 3 (with that backward's W right after it). InputError when an overlapped
/// action is not a forward followed by a backward. The simulator and the executor both ask.
size_t pair_extent(const std::vector<Action>& list, size_t i);

struct ScheduleInfo;

struct ScheduleSpec {
  std::string kind = "1f1b";  ///< the schedule's name (schedule_info)
  int stages = 1;         ///< P, pipeline ranks
  int micro_batches = 1;  ///< M per optimizer step
  int chunks = 1;         ///< V, model chunks per rank (interleaved; zb-v: 2)
  /// PipeDream's replicated stages (one chunk each): stage s on replicas[s] ranks, its
  /// micro-batch m on replica m % replicas[s]; empty: one rank per stage. The ranks ("slots")
  /// are numbered stage by stage: stage s's replica k is slot replicas[0] + ... +
  /// replicas[s - 1] + k.
  std::vector<int> replicas = {};
  /// Ranks running the schedule: P, or the replicas' sum.
  int slots() const;
  /// The stage and replica of `slot`, and the slot of a stage's replica.
  int stage_of_slot(int slot) const;
  int slot_of(int stage, int replica) const;
  /// The schedule `kind` names (InputError for an unknown name); looked up once per spec.
  const ScheduleInfo& info() const;
  /// (info()'s cache: leave it out of a spec's braces.)
  mutable const ScheduleInfo* cached_info = nullptr;
};

/// A pipeline schedule: a builder of each rank's list and what the builder needs. The library's
/// own are GPipe, 1F1B, Megatron's interleaved 1F1B, the zero-bubble ZB-H1, ZB-H2 and ZB-V, and
/// DeepSeek's DualPipe-V (Schedules.cpp: one line each); register_schedule adds one
/// (how_to_add_test.cpp shows it).
struct ScheduleInfo {
  std::string name;     ///< what --schedule names ("1f1b")
  std::string summary;  ///< one line
  /// The ordered actions of pipeline rank `rank` of a checked spec.
  std::function<std::vector<Action>(const ScheduleSpec& spec, int rank)> build;
  /// Every rank's list at once, where the schedule makes them together (the zero-bubble ones
  /// run the whole pipeline to place each rank's W's: per rank, that is P times the work; the
  /// planner builds every rank's list of thousands of layouts). Null: `build`, rank by rank.
  std::function<std::vector<std::vector<Action>>(const ScheduleSpec& spec)> build_all;
  /// Backward split into B (the input gradient) and W (the weight gradients).
  bool splits_backward = false;
  /// Model chunks per rank: this many always (zb-v: 2), or 0: --virtual-stages, which must
  /// then be 1 unless `interleaves`.
  int chunks = 0;
  bool interleaves = false;
  /// Where the chunks live: looping (chunk c of rank r is virtual stage c P + r), or a V (chunk
  /// 1 of rank r is virtual stage 2P - 1 - r: zb-v).
  bool v_shape = false;
  /// Needs M >= P (its warm-up fills the pipe), and M a multiple of P (micro-batches go round
  /// in groups of P: Megatron's interleaving).
  bool fills_pipe = false;
  bool groups_of_stages = false;
  /// Needs M >= 2P (both arms of the V full before the pairs start: DualPipe-V).
  bool fills_v = false;
  /// Its lists hold overlapped pairs (Action::overlapped), which run on two threads: the
  /// layout's groups used inside a chunk's computation need a lane per thread.
  bool overlaps = false;
  /// PipeDream's flush-free syncs (2bw, eager, async) run it.
  bool flush_free = false;
  /// Replicated stages (ScheduleSpec::replicas): the lists of every slot, where the schedule
  /// has its own (1F1B's dealt micro-batches); null, or an empty result: each stage's list
  /// filtered to its replica's micro-batches.
  std::function<std::vector<std::vector<Action>>(const ScheduleSpec& spec)> build_replicated;
};

/// The schedule named `name` (InputError "unknown pipeline schedule" naming the registered
/// ones); the registered names, built-in first; a schedule of your own (InputError when the name
/// is taken or it has no builder).
const ScheduleInfo& schedule_info(const std::string& name);
std::vector<std::string> schedule_names();
void register_schedule(ScheduleInfo info);

/// Whether schedule `name` splits backward into B (input gradient) and W (weight gradients).
bool splits_backward(const std::string& name);

/// Chunks per rank a schedule runs: its own count (zb-v: 2, whatever `virtual_stages` says),
/// else `virtual_stages`.
int chunks_of(const std::string& kind, int virtual_stages);

/// Checks a spec (InputError naming what is wrong): a registered schedule, P >= 1, M >= 1,
/// V >= 1; V its fixed chunks (zb-v: 2), else V > 1 only when it interleaves; M >= P where its
/// warm-up fills the pipe (1F1B, the zero-bubble ones), M a multiple of P where micro-batches go
/// round in groups of P (interleaved: Megatron's rule).
void validate(const ScheduleSpec& spec);

/// The ordered actions of pipeline rank `rank` (validates the spec).
std::vector<Action> build_schedule(const ScheduleSpec& spec, int rank);
/// Replicated stages: the actions of `slot` (ScheduleSpec::slots), its share of its stage's
/// list (the micro-batches m % replicas == its replica) in the stage's order. Deadlock-free: a
/// global order that runs the unreplicated lists runs these subsequences too. Without
/// replicas, build_schedule(spec, slot).
std::vector<Action> build_slot_schedule(const ScheduleSpec& spec, int slot);
/// Every slot's list at once (one deadlock check for all: what the planner simulates).
std::vector<std::vector<Action>> build_slot_schedules(const ScheduleSpec& spec);

/// Where the V x P virtual stages live. Looping placement (every schedule but zb-v): chunk c of
/// rank r is virtual stage c * P + r, consecutive stages on consecutive ranks, the last rank
/// handing on to the first. V shape (zb-v): chunk 0 of rank r is stage r, chunk 1 stage
/// 2P - 1 - r.
int stage_of(const ScheduleSpec& spec, int chunk, int rank);
int rank_of(const ScheduleSpec& spec, int stage);
int chunk_of(const ScheduleSpec& spec, int stage);

/// The ideal timeline of a schedule with fixed costs per action (the same on every stage).
struct Simulation {
  double makespan = 0;             ///< time from the first action's start to the last's end
  std::vector<double> idle_share;  ///< per rank: 1 - busy / makespan
  std::vector<int> peak_live;      ///< per rank: most micro-batches forwarded, not yet backwarded
  /// per rank: most micro-batches whose B ran and whose W has not (0 without a split)
  std::vector<int> peak_pending_weights;
  /// per rank, per action of its list: when it started and ended
  std::vector<std::vector<double>> starts, ends;
  double bubble() const;  ///< mean idle share
};

/// What each action costs when stages differ (the planner's simulation): `duration(rank, a)`,
/// and `transfer(from, to, a)`, the delay before an action's result (an activation, a
/// gradient) is usable on the rank that needs it (empty: none).
struct ActionCosts {
  std::function<double(int rank, const Action& action)> duration;
  std::function<double(int from, int to, const Action& action)> transfer;
  /// Optional: the earliest an action may start on `rank` (what it waits for besides the
  /// schedule: ZeRO's overlapped parameter gathers); null: 0.
  std::function<double(int rank, const Action& action)> release;
};
/// Simulates every rank's list (dependencies: a forward needs the previous virtual stage's
/// forward of its micro-batch, a backward the next virtual stage's backward, and its own
/// forward, a W its own B). InputError when the lists cannot all finish (a deadlock), naming
/// where each rank is stuck, or when an action is missing or repeated. `backward_cost` is the
/// whole backward's; a split one costs half of it in B and half in W. An overlapped pair runs as
/// the executor runs it: it starts once both inputs are in, its actions take their costs one
/// after the other (the compute is not faster for being paired), and both results leave at
/// its end.
Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    double forward_cost = 1.0, double backward_cost = 2.0);

/// The same simulation with costs per rank and action, and transfers between ranks (with
/// replicated stages: per slot, `per_rank` holding spec.slots() lists, a transfer from the
/// slot that ran the micro-batch on the neighbouring stage).
Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    const ActionCosts& costs);

/// The textbook bubble, (P - 1) / (V * M + P - 1): idle share of each rank with equal stages
/// (GPipe, 1F1B, interleaved; the zero-bubble schedules' is smaller: simulate them).
double bubble_formula(const ScheduleSpec& spec);

}  // namespace dtrain::parallel::pipeline
