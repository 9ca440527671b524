// Pipeline schedules: which forward and backward passes each pipeline rank runs, in order, for
// one optimizer step of M micro-batches. One function builds every schedule (GPipe, 1F1B,
// interleaved 1F1B, the zero-bubble ZB-H1, ZB-H2 and ZB-V whose backward is split into B, the
// input gradient, and W, the weight gradients); the executor runs any list, deriving the sends
// and receives from it (and where each virtual stage lives from stage_of / rank_of). A
// small event simulator gives a schedule's ideal timeline (bubble, peak activations) and proves
// that the ranks' lists cannot deadlock, for tests and for the benchmark's "formula" column.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::parallel::pipeline {

enum class ScheduleKind {
  GPipe,        ///< all forwards, then all backwards
  OneFOneB,     ///< PipeDream-flush: warm-up forwards, one forward / one backward, cool-down
  Interleaved,  ///< Megatron's interleaved 1F1B over V model chunks per rank
  /// Zero bubble (Qi et al., ICLR'24), backward split into B and W: 1F1B's forwards and B's,
  /// each rank's W's deferred to fill the time it would wait, at most `rank` of them pending
  /// as it starts a forward or a B (one more just after a B)
  /// (rank r holds P - r micro-batches' activations under 1F1B, stage 0 the most, so the peak
  /// stays 1F1B's): each rank idles (P - 1)(T_F + T_B - T_W) of the step instead of 1F1B's
  /// (P - 1)(T_F + T_B + T_W), a third of it when the three cost the same.
  ZeroBubbleH1,
  /// ZB-H2: 2 (P - r) - 1 forwards of warm-up and the same cap on pending W's (forwarded and
  /// not W'd micro-batches up to 2P on any rank: memory up to 2x 1F1B's). Its last bubble
  /// (the last stage's (P - 1) T_F before its first forward) goes only when a step overlaps
  /// the next, which dtrain's synchronous optimizer step does not: equal stages give H1's time.
  ZeroBubbleH2,
  /// ZB-V: two chunks per rank placed in a V (rank r holds virtual stages r and 2P - 1 - r, so
  /// rank 0 runs the first and the last, and the turn from P - 1 to P stays on rank P - 1),
  /// the order of Qi et al.'s ZB-V (section 6): chunk 0's forwards warm up, each rank then runs
  /// F, B and W of both chunks in turn. With T_F = T_B = T_W per chunk every rank idles only
  /// at the step's two ends, and each holds at most 2P chunk micro-batches of activations: P
  /// whole-stage micro-batches, rank 0's 1F1B peak, now on every rank.
  ZeroBubbleV,
};
/// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v" (InputError naming the choices
/// otherwise).
ScheduleKind schedule_kind_named(const std::string& name);
const char* to_string(ScheduleKind kind);

/// Whether the schedule splits backward into B (input gradient) and W (weight gradients).
bool splits_backward(ScheduleKind kind);

struct Action {
  /// Backward: the whole backward, or only the input gradient when the schedule splits it;
  /// Weight: the weight gradients of a split backward (after the micro-batch's B).
  enum Kind { Forward, Backward, Weight } kind = Forward;
  int micro_batch = 0;
  /// Which of this rank's model chunks (0 unless interleaved or zb-v); stage_of() says which
  /// virtual stage it is.
  int chunk = 0;
  bool operator==(const Action& other) const {
    return kind == other.kind && micro_batch == other.micro_batch && chunk == other.chunk;
  }
};
std::string to_string(const Action& action);  // "F3" / "B3" / "W3", "F3.1" with a chunk

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::OneFOneB;
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
};

/// Chunks per rank a schedule runs: 2 for zb-v (whatever `virtual_stages` says), else
/// `virtual_stages`.
int chunks_of(ScheduleKind kind, int virtual_stages);

/// Checks a spec (InputError naming what is wrong): P >= 1, M >= 1, V >= 1; V > 1 only when
/// interleaved, V = 2 for zb-v; 1F1B needs M >= P (fewer micro-batches cannot fill its
/// warm-up); interleaved needs M to be a multiple of P (Megatron's rule: micro-batches go round
/// in groups of P); the zero-bubble schedules too need M >= P (zb-v fills its pipe from 2P - 1).
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
/// whole backward's; a split one costs half of it in B and half in W.
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
