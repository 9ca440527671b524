// Schedule construction follows Megatron-LM's schedules.py (warm-up counts and the interleaved
// micro-batch/chunk order); the simulator is a plain list scheduler over the dependency graph.
#include "dtrain/parallel/pipeline/Schedule.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::pipeline {

ScheduleKind schedule_kind_named(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  if (name == "interleaved") return ScheduleKind::Interleaved;
  DTRAIN_THROW(InputError, "unknown pipeline schedule '", name,
               "' (choose gpipe, 1f1b or interleaved)");
}

const char* to_string(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe:
      return "gpipe";
    case ScheduleKind::OneFOneB:
      return "1f1b";
    case ScheduleKind::Interleaved:
      return "interleaved";
  }
  return "?";
}

std::string to_string(const Action& action) {
  return concat(action.kind == Action::Forward ? "F" : "B", action.micro_batch,
                action.chunk > 0 ? concat(".", action.chunk) : std::string());
}

void validate(const ScheduleSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.stages >= 1, "pipeline stages must be >= 1, got ", spec.stages);
  DTRAIN_CHECK_INPUT(spec.micro_batches >= 1, "micro-batches must be >= 1, got ",
                     spec.micro_batches);
  DTRAIN_CHECK_INPUT(spec.chunks >= 1, "virtual stages per rank must be >= 1, got ", spec.chunks);
  DTRAIN_CHECK_INPUT(spec.chunks == 1 || spec.kind == ScheduleKind::Interleaved, "virtual stages (",
                     spec.chunks, ") need the interleaved schedule, not ", to_string(spec.kind));
  DTRAIN_CHECK_INPUT(spec.kind != ScheduleKind::OneFOneB || spec.micro_batches >= spec.stages,
                     "the 1f1b schedule needs at least as many micro-batches as pipeline stages "
                     "(got ",
                     spec.micro_batches, " micro-batches for ", spec.stages,
                     " stages): use more micro-batches or --schedule gpipe");
  DTRAIN_CHECK_INPUT(
      spec.kind != ScheduleKind::Interleaved || spec.micro_batches % spec.stages == 0,
      "the interleaved schedule needs micro-batches (", spec.micro_batches,
      ") to be a multiple of the pipeline stages (", spec.stages, ")");
}

namespace {

// Interleaved: the k-th forward (or backward) of a rank, Megatron's order: micro-batches go
// round in groups of P through every chunk before the next group starts.
Action interleaved_action(const ScheduleSpec& spec, int k, bool forward) {
  const int group = spec.stages * spec.chunks;
  const int chunk_in_order = (k % group) / spec.stages;
  Action a;
  a.kind = forward ? Action::Forward : Action::Backward;
  a.chunk = forward ? chunk_in_order : spec.chunks - 1 - chunk_in_order;
  a.micro_batch = (k / group) * spec.stages + k % spec.stages;
  return a;
}

}  // namespace

std::vector<Action> build_schedule(const ScheduleSpec& spec, int rank) {
  validate(spec);
  DTRAIN_CHECK_INPUT(rank >= 0 && rank < spec.stages, "pipeline rank ", rank, " is outside 0..",
                     spec.stages - 1);
  const int p = spec.stages;
  const int m = spec.micro_batches;
  std::vector<Action> actions;
  switch (spec.kind) {
    case ScheduleKind::GPipe: {
      for (int i = 0; i < m; ++i) actions.push_back({Action::Forward, i, 0});
      for (int i = 0; i < m; ++i) actions.push_back({Action::Backward, i, 0});
      break;
    }
    case ScheduleKind::OneFOneB:
    case ScheduleKind::Interleaved: {
      const bool interleaved = spec.kind == ScheduleKind::Interleaved;
      const int total = m * spec.chunks;
      int warmup = interleaved ? (p - rank - 1) * 2 + (spec.chunks - 1) * p : p - rank - 1;
      if (interleaved && m == p) warmup = total;  // Megatron: one group fills the pipe
      warmup = std::min(warmup, total);
      auto forward = [&](int k) {
        return interleaved ? interleaved_action(spec, k, true) : Action{Action::Forward, k, 0};
      };
      auto backward = [&](int k) {
        return interleaved ? interleaved_action(spec, k, false) : Action{Action::Backward, k, 0};
      };
      for (int k = 0; k < warmup; ++k) actions.push_back(forward(k));
      for (int k = 0; k < total - warmup; ++k) {
        actions.push_back(forward(warmup + k));
        actions.push_back(backward(k));
      }
      for (int k = total - warmup; k < total; ++k) actions.push_back(backward(k));
      break;
    }
  }
  return actions;
}

double Simulation::bubble() const {
  if (idle_share.empty()) return 0;
  return std::accumulate(idle_share.begin(), idle_share.end(), 0.0) / idle_share.size();
}

Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    double forward_cost, double backward_cost) {
  // Costs are per chunk: a rank's V chunks together cost what one stage costs.
  const double f_cost = forward_cost / spec.chunks;
  const double b_cost = backward_cost / spec.chunks;
  ActionCosts costs;
  costs.duration = [=](int, const Action& a) {
    return a.kind == Action::Forward ? f_cost : b_cost;
  };
  return simulate(spec, per_rank, costs);
}

Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    const ActionCosts& costs) {
  validate(spec);
  const int p = spec.stages;
  const int v = spec.chunks;
  const int last_stage = p * v - 1;
  DTRAIN_CHECK_INPUT(static_cast<int>(per_rank.size()) == p, "a schedule for ", p, " ranks has ",
                     per_rank.size(), " lists");
  // Every (kind, micro-batch, virtual stage) exactly once, on its rank.
  const int m = spec.micro_batches;
  auto key = [&](int kind, int micro_batch, int vstage) {
    return (static_cast<size_t>(kind) * m + micro_batch) * p * v + vstage;
  };
  std::vector<double> finished(2 * static_cast<size_t>(m) * p * v, -1.0);  // end times
  for (int r = 0; r < p; ++r) {
    std::vector<char> seen(2 * static_cast<size_t>(m) * v, 0);
    for (const auto& a : per_rank[r]) {
      DTRAIN_CHECK_INPUT(a.micro_batch >= 0 && a.micro_batch < m && a.chunk >= 0 && a.chunk < v,
                         "rank ", r, "'s action ", to_string(a), " is out of range");
      char& times = seen[(static_cast<size_t>(a.kind) * m + a.micro_batch) * v + a.chunk];
      DTRAIN_CHECK_INPUT(times == 0, "rank ", r, " runs ", to_string(a), " twice");
      times = 1;
    }
    DTRAIN_CHECK_INPUT(static_cast<int>(per_rank[r].size()) == 2 * m * v, "rank ", r, " runs ",
                       per_rank[r].size(), " actions, not ", 2 * m * v);
  }
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0), busy(p, 0.0);
  std::vector<int> live(p, 0);
  Simulation result;
  result.peak_live.assign(p, 0);
  result.starts.resize(p);
  result.ends.resize(p);
  size_t remaining = 0;
  for (const auto& list : per_rank) remaining += list.size();
  while (remaining > 0) {
    // Start, among the ranks whose next action is ready, the one that can start earliest.
    int best = -1;
    double best_start = 0;
    for (int r = 0; r < p; ++r) {
      if (next[r] >= per_rank[r].size()) continue;
      const Action& a = per_rank[r][next[r]];
      const int stage = virtual_stage(a.chunk, r, p);
      double ready = free_at[r];
      bool ok = true;
      auto needs = [&](int kind, int vstage) {
        const double done = finished[key(kind, a.micro_batch, vstage)];
        if (done < 0) {
          ok = false;
        } else {
          const int from = vstage % p;
          const double delay = from != r && costs.transfer ? costs.transfer(from, r, a) : 0.0;
          ready = std::max(ready, done + delay);
        }
      };
      if (a.kind == Action::Forward) {
        if (stage > 0) needs(Action::Forward, stage - 1);
      } else {
        needs(Action::Forward, stage);
        if (stage < last_stage) needs(Action::Backward, stage + 1);
      }
      if (ok && (best < 0 || ready < best_start)) {
        best = r;
        best_start = ready;
      }
    }
    if (best < 0) {
      std::string where;
      for (int r = 0; r < p; ++r) {
        where += concat(r ? "; " : "", "rank ", r, " at ",
                        next[r] < per_rank[r].size() ? to_string(per_rank[r][next[r]]) : "end");
      }
      DTRAIN_THROW(InputError, "the ", to_string(spec.kind), " schedule deadlocks: ", where);
    }
    const Action& a = per_rank[best][next[best]];
    const double cost = costs.duration(best, a);
    const double end = best_start + cost;
    result.starts[best].push_back(best_start);
    result.ends[best].push_back(end);
    finished[key(a.kind, a.micro_batch, virtual_stage(a.chunk, best, p))] = end;
    free_at[best] = end;
    busy[best] += cost;
    live[best] += a.kind == Action::Forward ? 1 : -1;
    result.peak_live[best] = std::max(result.peak_live[best], live[best]);
    result.makespan = std::max(result.makespan, end);
    ++next[best];
    --remaining;
  }
  for (int r = 0; r < p; ++r) result.idle_share.push_back(1.0 - busy[r] / result.makespan);
  return result;
}

double bubble_formula(const ScheduleSpec& spec) {
  const double p = spec.stages;
  return (p - 1) / (static_cast<double>(spec.chunks) * spec.micro_batches + p - 1);
}

}  // namespace dtrain::parallel::pipeline
