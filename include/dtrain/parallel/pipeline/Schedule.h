// Pipeline schedules: which forward and backward passes each pipeline rank runs, in order, for
// one optimizer step of M micro-batches. One function builds every schedule (GPipe, 1F1B,
// interleaved 1F1B); the executor runs any list, deriving the sends and receives from it. A
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
};
/// "gpipe", "1f1b", "interleaved" (InputError naming the choices otherwise).
ScheduleKind schedule_kind_named(const std::string& name);
const char* to_string(ScheduleKind kind);

struct Action {
  enum Kind { Forward, Backward } kind = Forward;
  int micro_batch = 0;
  /// Which of this rank's model chunks (0 unless interleaved). Chunk c of rank r is virtual
  /// stage c * P + r, so consecutive virtual stages sit on consecutive ranks.
  int chunk = 0;
  bool operator==(const Action& other) const {
    return kind == other.kind && micro_batch == other.micro_batch && chunk == other.chunk;
  }
};
std::string to_string(const Action& action);  // "F3" / "B3", "F3.1" with a chunk

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;         ///< P, pipeline ranks
  int micro_batches = 1;  ///< M per optimizer step
  int chunks = 1;         ///< V, model chunks per rank (interleaved only)
};

/// Checks a spec (InputError naming what is wrong): P >= 1, M >= 1, V >= 1; V > 1 only when
/// interleaved; 1F1B needs M >= P (fewer micro-batches cannot fill its warm-up); interleaved
/// needs M to be a multiple of P (Megatron's rule: micro-batches go round in groups of P).
void validate(const ScheduleSpec& spec);

/// The ordered actions of pipeline rank `rank` (validates the spec).
std::vector<Action> build_schedule(const ScheduleSpec& spec, int rank);

/// Virtual stage of `chunk` on `rank` with P ranks, and its rank / chunk.
inline int virtual_stage(int chunk, int rank, int stages) { return chunk * stages + rank; }

/// The ideal timeline of a schedule with fixed costs per action (the same on every stage).
struct Simulation {
  double makespan = 0;             ///< time from the first action's start to the last's end
  std::vector<double> idle_share;  ///< per rank: 1 - busy / makespan
  std::vector<int> peak_live;      ///< per rank: most micro-batches forwarded, not yet backwarded
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
};
/// Simulates every rank's list (dependencies: a forward needs the previous virtual stage's
/// forward of its micro-batch, a backward the next virtual stage's backward, and its own
/// forward). InputError when the lists cannot all finish (a deadlock), naming where each rank
/// is stuck, or when an action is missing or repeated.
Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    double forward_cost = 1.0, double backward_cost = 2.0);

/// The textbook bubble, (P - 1) / (V * M + P - 1): idle share of each rank with equal stages.
/// The same simulation with costs per rank and action, and transfers between ranks.
Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    const ActionCosts& costs);

double bubble_formula(const ScheduleSpec& spec);

}  // namespace dtrain::parallel::pipeline
