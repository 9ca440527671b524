// Schedule construction follows Megatron-LM's schedules.py (warm-up counts and the interleaved
// micro-batch/chunk order) and, for the zero-bubble schedules, the construction of Qi et al.
// (1F1B's order of F and B, W's placed where a rank would wait) run as a list scheduler on unit
// costs, and ZB-V's order as the paper's section 6 gives it (its phases as counts per rank); the
// simulator is a plain list scheduler over the dependency graph.
#include "dtrain/parallel/pipeline/Schedule.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "dtrain/common/Error.h"
#include "parallel/pipeline/ScheduleBuilders.h"

namespace dtrain::parallel::pipeline {

int stage_of(const ScheduleSpec& spec, int chunk, int rank) {
  if (chunk == 1 && spec.info().v_shape) return 2 * spec.stages - 1 - rank;
  return chunk * spec.stages + rank;
}

int rank_of(const ScheduleSpec& spec, int stage) {
  if (stage >= spec.stages && spec.info().v_shape) {
    return 2 * spec.stages - 1 - stage;
  }
  return stage % spec.stages;
}

int chunk_of(const ScheduleSpec& spec, int stage) { return stage / spec.stages; }

std::string to_string(const Action& action) {
  const char* letter = action.kind == Action::Forward    ? "F"
                       : action.kind == Action::Backward ? "B"
                                                         : "W";
  return concat(letter, action.micro_batch,
                action.chunk > 0 ? concat(".", action.chunk) : std::string(),
                action.overlapped ? "&" : "");
}

size_t pair_extent(const std::vector<Action>& list, size_t i) {
  if (!list[i].overlapped) return 1;
  DTRAIN_CHECK_INPUT(list[i].kind == Action::Forward && i + 1 < list.size() &&
                         list[i + 1].kind == Action::Backward,
                     "the overlapped ", to_string(list[i]),
                     " is not a forward followed by a backward");
  const Action& b = list[i + 1];
  const bool with_w = i + 2 < list.size() && list[i + 2].kind == Action::Weight &&
                      list[i + 2].micro_batch == b.micro_batch && list[i + 2].chunk == b.chunk;
  return with_w ? 3 : 2;
}

void validate(const ScheduleSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.stages >= 1, "pipeline stages must be >= 1, got ", spec.stages);
  DTRAIN_CHECK_INPUT(spec.micro_batches >= 1, "micro-batches must be >= 1, got ",
                     spec.micro_batches);
  DTRAIN_CHECK_INPUT(spec.chunks >= 1, "virtual stages per rank must be >= 1, got ", spec.chunks);
  const ScheduleInfo& info = spec.info();
  if (info.chunks > 0) {
    DTRAIN_CHECK_INPUT(spec.chunks == info.chunks, "the ", info.name, " schedule runs ",
                       info.chunks, " chunks per rank, not ", spec.chunks);
  } else {
    DTRAIN_CHECK_INPUT(spec.chunks == 1 || info.interleaves, "virtual stages (", spec.chunks,
                       ") need the interleaved schedule, not ", info.name);
  }
  DTRAIN_CHECK_INPUT(!info.fills_pipe || spec.micro_batches >= spec.stages, "the ", info.name,
                     " schedule needs at least as many micro-batches as pipeline stages (got ",
                     spec.micro_batches, " micro-batches for ", spec.stages,
                     " stages): use more micro-batches or --schedule gpipe");
  DTRAIN_CHECK_INPUT(
      !info.fills_v || spec.micro_batches >= 2 * spec.stages, "the ", info.name,
      " schedule needs at least twice as many micro-batches as pipeline stages (got ",
      spec.micro_batches, " micro-batches for ", spec.stages, " stages)");
  DTRAIN_CHECK_INPUT(!info.groups_of_stages || spec.micro_batches % spec.stages == 0, "the ",
                     info.name, " schedule needs micro-batches (", spec.micro_batches,
                     ") to be a multiple of the pipeline stages (", spec.stages, ")");
  if (spec.replicas.empty()) return;
  DTRAIN_CHECK_INPUT(static_cast<int>(spec.replicas.size()) == spec.stages, "replica counts for ",
                     spec.replicas.size(), " stages, the pipeline has ", spec.stages);
  DTRAIN_CHECK_INPUT(spec.chunks == 1, "replicated stages run one chunk each, not ", spec.chunks);
  for (int s = 0; s < spec.stages; ++s) {
    DTRAIN_CHECK_INPUT(spec.replicas[s] >= 1 && spec.replicas[s] <= spec.micro_batches, "stage ", s,
                       " has ", spec.replicas[s], " replicas for ", spec.micro_batches,
                       " micro-batches (each replica needs one at least)");
  }
}

int ScheduleSpec::slots() const {
  int total = 0;
  for (int r : replicas) total += r;
  return replicas.empty() ? stages : total;
}

int ScheduleSpec::stage_of_slot(int slot) const {
  if (replicas.empty()) return slot;
  int s = 0;
  while (s + 1 < stages && slot >= replicas[s]) slot -= replicas[s++];
  return s;
}

int ScheduleSpec::slot_of(int stage, int replica) const {
  if (replicas.empty()) return stage;
  int slot = replica;
  for (int s = 0; s < stage; ++s) slot += replicas[s];
  return slot;
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

// 1F1B's forwards and backwards of one rank, `warmup` forwards first.
std::vector<Action> one_f_one_b(int m, int warmup) {
  warmup = std::min(warmup, m);
  std::vector<Action> actions;
  for (int k = 0; k < warmup; ++k) actions.push_back({Action::Forward, k, 0});
  for (int k = 0; k < m - warmup; ++k) {
    actions.push_back({Action::Forward, warmup + k, 0});
    actions.push_back({Action::Backward, k, 0});
  }
  for (int k = m - warmup; k < m; ++k) actions.push_back({Action::Backward, k, 0});
  return actions;
}

// Zero bubble: every rank keeps its F/B order (1F1B's, with H1's or H2's warm-up) and places
// its W's (in micro-batch order) in the time it would otherwise wait for a neighbour, or when
// more than its cap of them are pending. The ranks are run together on unit costs, each rank's
// next action taken at the earliest time it can start.
std::vector<std::vector<Action>> zero_bubble(const ScheduleSpec& spec, bool h1) {
  const int p = spec.stages, m = spec.micro_batches;
  std::vector<std::vector<Action>> order(p), lists(p);
  std::vector<int> cap(p);
  for (int r = 0; r < p; ++r) {
    order[r] = one_f_one_b(m, h1 ? p - r - 1 : 2 * (p - r) - 1);
    cap[r] = r;
  }
  // End time of (kind, micro-batch, rank); -1 = not yet run.
  std::vector<double> end(3 * static_cast<size_t>(m) * p, -1.0);
  auto at = [&](int kind, int micro_batch, int rank) -> double& {
    return end[(static_cast<size_t>(kind) * m + micro_batch) * p + rank];
  };
  std::vector<double> free_at(p, 0.0);
  std::vector<size_t> next(p, 0);
  std::vector<int> backwards(p, 0), weights(p, 0);
  for (size_t left = 3 * static_cast<size_t>(m) * p; left > 0; --left) {
    int best = -1;
    double best_start = 0;
    Action best_action;
    for (int r = 0; r < p; ++r) {
      const int pending = backwards[r] - weights[r];
      const Action weight{Action::Weight, weights[r], 0};
      bool found = false;
      Action a;
      double start = free_at[r];
      if (next[r] < order[r].size()) {
        a = order[r][next[r]];
        double ready = 0;
        if (a.kind == Action::Forward) {
          ready = r == 0 ? 0.0 : at(Action::Forward, a.micro_batch, r - 1);
        } else {
          ready = r == p - 1 ? at(Action::Forward, a.micro_batch, r)
                             : at(Action::Backward, a.micro_batch, r + 1);
        }
        if (ready >= 0 && pending <= cap[r]) {
          found = true;
          if (ready > free_at[r] && pending > 0) {
            a = weight;  // fill the wait
          } else {
            start = std::max(ready, free_at[r]);
          }
        } else if (pending > 0) {
          found = true;
          a = weight;
        }
      } else if (pending > 0) {
        found = true;
        a = weight;
      }
      if (found && (best < 0 || start < best_start)) {
        best = r;
        best_start = start;
        best_action = a;
      }
    }
    DTRAIN_CHECK(best >= 0, "the ", spec.kind, " construction stalled");
    const double finish = best_start + 1.0;
    at(best_action.kind, best_action.micro_batch, best) = finish;
    free_at[best] = finish;
    lists[best].push_back(best_action);
    if (best_action.kind == Action::Weight) {
      ++weights[best];
    } else {
      ++next[best];
      if (best_action.kind == Action::Backward) ++backwards[best];
    }
  }
  return lists;
}

// ZB-V on rank r, the phases of Qi et al.'s figure (counts per rank, unit costs in mind): chunk
// 0's forwards fill the V's descent (2(P - r) - 1 of them), r pairs of chunk 1 and chunk 0
// forwards, P - r rounds of chunk 1's F, B and W at the bottom of the V, then rounds of F, B, W
// on chunk 0 and on chunk 1 until every forward ran, and the backwards and W's left. Built for
// at least 2P - 1 micro-batches (the warm-up's), those beyond M then dropped, which keeps the
// order free of deadlock (a micro-batch's actions go together) and leaves idle slots in their
// place.
std::vector<Action> zero_bubble_v(const ScheduleSpec& spec, int rank) {
  const int p = spec.stages;
  const int n = std::max(spec.micro_batches, 2 * p - 1);
  int forwards[2] = {0, 0}, backwards[2] = {0, 0}, weights[2] = {0, 0};
  std::vector<Action> actions;
  auto add = [&](Action::Kind kind, int chunk) {
    int& counter = kind == Action::Forward    ? forwards[chunk]
                   : kind == Action::Backward ? backwards[chunk]
                                              : weights[chunk];
    if (counter < spec.micro_batches) actions.push_back({kind, counter, chunk});
    ++counter;
  };
  for (int k = 0; k < 2 * (p - rank) - 1; ++k) add(Action::Forward, 0);
  for (int k = 0; k < rank; ++k) {
    add(Action::Forward, 1);
    add(Action::Forward, 0);
  }
  for (int k = 0; k < p - rank; ++k) {
    add(Action::Forward, 1);
    add(Action::Backward, 1);
    add(Action::Weight, 1);
  }
  while (forwards[1] < forwards[0] || forwards[0] < n) {
    if (forwards[0] < n) add(Action::Forward, 0);
    add(Action::Backward, 0);
    add(Action::Weight, 0);
    add(Action::Forward, 1);
    add(Action::Backward, 1);
    add(Action::Weight, 1);
  }
  for (int k = 0; k < rank; ++k) {
    add(Action::Backward, 0);
    add(Action::Backward, 1);
  }
  for (int k = 0; k < p - rank; ++k) {
    add(Action::Backward, 0);
    add(Action::Weight, 0);
  }
  while (weights[1] < backwards[1]) add(Action::Weight, 1);
  while (weights[0] < backwards[0]) add(Action::Weight, 0);
  DTRAIN_CHECK(forwards[0] == n && backwards[0] == n && weights[0] == n && forwards[1] == n &&
                   backwards[1] == n && weights[1] == n,
               "the zb-v construction is incomplete on rank ", rank);
  return actions;
}

// The looping 1F1B of one rank: P - r - 1 warm-up forwards, or interleaved (Megatron's
// schedules.py) over the rank's chunks.
std::vector<Action> looping_one_f_one_b(const ScheduleSpec& spec, int rank, bool interleaved) {
  const int p = spec.stages, m = spec.micro_batches;
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
  std::vector<Action> actions;
  for (int k = 0; k < warmup; ++k) actions.push_back(forward(k));
  for (int k = 0; k < total - warmup; ++k) {
    actions.push_back(forward(warmup + k));
    actions.push_back(backward(k));
  }
  for (int k = total - warmup; k < total; ++k) actions.push_back(backward(k));
  return actions;
}

}  // namespace

std::vector<Action> gpipe_schedule(const ScheduleSpec& spec, int) {
  std::vector<Action> actions;
  for (int i = 0; i < spec.micro_batches; ++i) actions.push_back({Action::Forward, i, 0});
  for (int i = 0; i < spec.micro_batches; ++i) actions.push_back({Action::Backward, i, 0});
  return actions;
}

std::vector<Action> one_f_one_b_schedule(const ScheduleSpec& spec, int rank) {
  return looping_one_f_one_b(spec, rank, false);
}

std::vector<Action> interleaved_schedule(const ScheduleSpec& spec, int rank) {
  return looping_one_f_one_b(spec, rank, true);
}

std::vector<Action> zero_bubble_h1_schedule(const ScheduleSpec& spec, int rank) {
  return zero_bubble(spec, true)[rank];
}

std::vector<Action> zero_bubble_h2_schedule(const ScheduleSpec& spec, int rank) {
  return zero_bubble(spec, false)[rank];
}

std::vector<std::vector<Action>> zero_bubble_h1_lists(const ScheduleSpec& spec) {
  return zero_bubble(spec, true);
}

std::vector<std::vector<Action>> zero_bubble_h2_lists(const ScheduleSpec& spec) {
  return zero_bubble(spec, false);
}

std::vector<Action> zero_bubble_v_schedule(const ScheduleSpec& spec, int rank) {
  return zero_bubble_v(spec, rank);
}

std::vector<Action> build_schedule(const ScheduleSpec& spec, int rank) {
  validate(spec);
  DTRAIN_CHECK_INPUT(rank >= 0 && rank < spec.stages, "pipeline rank ", rank, " is outside 0..",
                     spec.stages - 1);
  return spec.info().build(spec, rank);
}

double Simulation::bubble() const {
  if (idle_share.empty()) return 0;
  return std::accumulate(idle_share.begin(), idle_share.end(), 0.0) / idle_share.size();
}

Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    double forward_cost, double backward_cost) {
  // Costs are per chunk: a rank's V chunks together cost what one stage costs.
  const double f_cost = forward_cost / spec.chunks;
  const double b_cost = backward_cost / spec.chunks / (spec.info().splits_backward ? 2 : 1);
  ActionCosts costs;
  costs.duration = [=](int, const Action& a) {
    return a.kind == Action::Forward ? f_cost : b_cost;
  };
  return simulate(spec, per_rank, costs);
}

Simulation simulate(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& per_rank,
                    const ActionCosts& costs) {
  validate(spec);
  const int stages = spec.stages;
  const int p = spec.slots();  // ranks (slots with replicated stages)
  const int v = spec.chunks;
  const int last_stage = stages * v - 1;
  const bool replicated = !spec.replicas.empty();
  DTRAIN_CHECK_INPUT(static_cast<int>(per_rank.size()) == p, "a schedule for ", p, " ranks has ",
                     per_rank.size(), " lists");
  // Where a (virtual stage, micro-batch) runs, and which virtual stage a rank's chunk is.
  auto slot_running = [&](int vstage, int micro_batch) {
    return replicated ? spec.slot_of(vstage, micro_batch % spec.replicas[vstage])
                      : rank_of(spec, vstage);
  };
  auto vstage_of = [&](int chunk, int slot) {
    return replicated ? spec.stage_of_slot(slot) : stage_of(spec, chunk, slot);
  };
  // Every (kind, micro-batch, virtual stage) exactly once, on its rank.
  const int m = spec.micro_batches;
  const bool split = spec.info().splits_backward;
  const int kinds = split ? 3 : 2;
  auto key = [&](int kind, int micro_batch, int vstage) {
    return (static_cast<size_t>(kind) * m + micro_batch) * stages * v + vstage;
  };
  std::vector<double> finished(3 * static_cast<size_t>(m) * stages * v, -1.0);  // end times
  for (int r = 0; r < p; ++r) {
    std::vector<char> seen(3 * static_cast<size_t>(m) * v, 0);
    for (const auto& a : per_rank[r]) {
      DTRAIN_CHECK_INPUT(a.micro_batch >= 0 && a.micro_batch < m && a.chunk >= 0 && a.chunk < v &&
                             (split || a.kind != Action::Weight),
                         "rank ", r, "'s action ", to_string(a), " is out of range");
      char& times = seen[(static_cast<size_t>(a.kind) * m + a.micro_batch) * v + a.chunk];
      DTRAIN_CHECK_INPUT(times == 0, "rank ", r, " runs ", to_string(a), " twice");
      DTRAIN_CHECK_INPUT(slot_running(vstage_of(a.chunk, r), a.micro_batch) == r, "rank ", r,
                         " runs ", to_string(a), ", another replica's micro-batch");
      times = 1;
    }
    int mine = m;  // micro-batches on this rank: k, k + R, ... below M for replica k of R
    if (replicated) {
      const int stage = spec.stage_of_slot(r), count = spec.replicas[stage];
      mine = (m - (r - spec.slot_of(stage, 0)) + count - 1) / count;
    }
    DTRAIN_CHECK_INPUT(static_cast<int>(per_rank[r].size()) == kinds * mine * v, "rank ", r,
                       " runs ", per_rank[r].size(), " actions, not ", kinds * mine * v);
  }
  std::vector<size_t> next(p, 0);
  std::vector<double> free_at(p, 0.0), busy(p, 0.0);
  std::vector<int> live(p, 0), pending(p, 0);
  Simulation result;
  result.peak_live.assign(p, 0);
  result.peak_pending_weights.assign(p, 0);
  result.starts.resize(p);
  result.ends.resize(p);
  size_t remaining = 0;
  for (const auto& list : per_rank) remaining += list.size();
  while (remaining > 0) {
    // Start, among the ranks whose next action (or pair) is ready, the one that can start
    // earliest.
    int best = -1;
    double best_start = 0;
    for (int r = 0; r < p; ++r) {
      if (next[r] >= per_rank[r].size()) continue;
      double ready = free_at[r];
      bool ok = true;
      const size_t group = pair_extent(per_rank[r], next[r]);
      // (A pair's W needs the pair's own B: nothing outside the pair.)
      for (size_t g = 0; g < std::min<size_t>(group, 2); ++g) {
        const Action& a = per_rank[r][next[r] + g];
        const int stage = vstage_of(a.chunk, r);
        if (costs.release) ready = std::max(ready, costs.release(r, a));
        auto needs = [&](int kind, int vstage) {
          const double done = finished[key(kind, a.micro_batch, vstage)];
          if (done < 0) {
            ok = false;
          } else {
            const int from = slot_running(vstage, a.micro_batch);
            const double delay = from != r && costs.transfer ? costs.transfer(from, r, a) : 0.0;
            ready = std::max(ready, done + delay);
          }
        };
        if (a.kind == Action::Forward) {
          if (stage > 0) needs(Action::Forward, stage - 1);
        } else if (a.kind == Action::Backward) {
          needs(Action::Forward, stage);
          if (stage < last_stage) needs(Action::Backward, stage + 1);
        } else {
          needs(Action::Backward, stage);
        }
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
      DTRAIN_THROW(InputError, "the ", spec.kind, " schedule deadlocks: ", where);
    }
    const size_t group = pair_extent(per_rank[best], next[best]);
    double end = best_start;
    for (size_t g = 0; g < group; ++g) {
      const Action& a = per_rank[best][next[best] + g];
      const double cost = costs.duration(best, a);
      result.starts[best].push_back(end);
      end += cost;
      result.ends[best].push_back(end);
      busy[best] += cost;
      if (a.kind == Action::Weight) {
        --pending[best];
      } else {
        live[best] += a.kind == Action::Forward ? 1 : -1;
        if (split && a.kind == Action::Backward) ++pending[best];
      }
      result.peak_live[best] = std::max(result.peak_live[best], live[best]);
      result.peak_pending_weights[best] =
          std::max(result.peak_pending_weights[best], pending[best]);
    }
    // A pair's results leave together, at its end.
    for (size_t g = 0; g < group; ++g) {
      const Action& a = per_rank[best][next[best] + g];
      finished[key(a.kind, a.micro_batch, vstage_of(a.chunk, best))] = end;
    }
    free_at[best] = end;
    result.makespan = std::max(result.makespan, end);
    next[best] += group;
    remaining -= group;
  }
  for (int r = 0; r < p; ++r) result.idle_share.push_back(1.0 - busy[r] / result.makespan);
  return result;
}

namespace {

// Replicated stages: each slot's share of its stage's list, in the stage's order (safe: a global
// order that runs the unreplicated lists runs these subsequences too).
std::vector<Action> filtered_slot_schedule(const ScheduleSpec& spec, int slot) {
  const int stage = spec.stage_of_slot(slot);
  const int replicas = spec.replicas[stage];
  const int replica = slot - spec.slot_of(stage, 0);
  std::vector<Action> actions = build_schedule(spec, stage);
  actions.erase(
      std::remove_if(actions.begin(), actions.end(),
                     [&](const Action& a) { return a.micro_batch % replicas != replica; }),
      actions.end());
  return actions;
}

// Replicated 1F1B (PipeDream's 1F1B-RR): each replica runs 1F1B over its own micro-batches,
// warming up with as many as keep the ranks downstream busy, ceil(W / R) - 1 for R replicas
// and W ranks from its stage to the last (1F1B's P - s - 1 without replicas). The filtered
// stage order would let a replica start its next forward only once the previous backward is
// back: no overlap within a replica.
std::vector<Action> replicated_one_f_one_b(const ScheduleSpec& spec, int slot) {
  const int stage = spec.stage_of_slot(slot);
  const int replicas = spec.replicas[stage];
  const int replica = slot - spec.slot_of(stage, 0);
  const int downstream = spec.slots() - spec.slot_of(stage, 0);
  const int mine = (spec.micro_batches - replica + replicas - 1) / replicas;
  std::vector<Action> actions = one_f_one_b(mine, (downstream + replicas - 1) / replicas - 1);
  for (auto& a : actions) a.micro_batch = replica + a.micro_batch * replicas;
  return actions;
}

}  // namespace

std::vector<std::vector<Action>> replicated_one_f_one_b_lists(const ScheduleSpec& spec) {
  // Replicated 1F1B where the ranks' lists run to the end together (the simulator on unit
  // costs); empty otherwise (the filtered stage order then).
  std::vector<std::vector<Action>> lists;
  for (int r = 0; r < spec.slots(); ++r) lists.push_back(replicated_one_f_one_b(spec, r));
  try {
    simulate(spec, lists);
    return lists;
  } catch (const InputError&) {
    return {};
  }
}

std::vector<std::vector<Action>> build_slot_schedules(const ScheduleSpec& spec) {
  std::vector<std::vector<Action>> lists;
  if (spec.replicas.empty()) {
    if (spec.info().build_all) {
      validate(spec);
      return spec.info().build_all(spec);
    }
    for (int r = 0; r < spec.stages; ++r) lists.push_back(build_schedule(spec, r));
    return lists;
  }
  validate(spec);
  if (spec.info().build_replicated) {
    lists = spec.info().build_replicated(spec);
    if (!lists.empty()) return lists;
  }
  for (int r = 0; r < spec.slots(); ++r) lists.push_back(filtered_slot_schedule(spec, r));
  return lists;
}

std::vector<Action> build_slot_schedule(const ScheduleSpec& spec, int slot) {
  if (spec.replicas.empty()) return build_schedule(spec, slot);
  return build_slot_schedules(spec).at(slot);
}

double bubble_formula(const ScheduleSpec& spec) {
  const double p = spec.stages;
  return (p - 1) / (static_cast<double>(spec.chunks) * spec.micro_batches + p - 1);
}

}  // namespace dtrain::parallel::pipeline
