// Pipeline parallelism: schedules (their order, their ideal timeline, deadlock freedom).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>

#include "CliRuns.h"
#include "InputErrors.h"
#include "Oracle.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/Partition.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"
#include "parallel/pipeline/PipelineStrategy.h"

using namespace dtrain;
using namespace dtrain::test;
using namespace dtrain::parallel::pipeline;

namespace {

std::string listing(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + to_string(a);
  return out;
}

std::vector<std::vector<Action>> all_ranks(const ScheduleSpec& spec) {
  std::vector<std::vector<Action>> lists;
  for (int r = 0; r < spec.stages; ++r) lists.push_back(build_schedule(spec, r));
  return lists;
}

}  // namespace

TEST(Schedule, OrdersAreThoseOfThePapers) {
  ScheduleSpec spec{"1f1b", 2, 4, 1};
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(listing(build_schedule(spec, 1)), "F0 B0 F1 B1 F2 B2 F3 B3");
  spec.kind = "gpipe";
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 F2 F3 B0 B1 B2 B3");
  // Megatron's interleaved order, P = 2, V = 2, M = 4: groups of P micro-batches go through
  // chunk 0 then chunk 1; rank 0 warms up with (P - 1) * 2 + (V - 1) * P = 4 forwards.
  spec = {"interleaved", 2, 4, 2};
  EXPECT_EQ(listing(build_schedule(spec, 0)),
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  EXPECT_EQ(listing(build_schedule(spec, 1)),
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
}

// With equal stages every schedule's ideal idle share is the textbook (P-1)/(VM+P-1), none
// deadlocks, and 1F1B keeps at most P - rank micro-batches alive where GPipe keeps all M.
TEST(Schedule, IdealTimelinesMatchTheBubbleFormula) {
  for (const std::string kind : {"gpipe", "1f1b", "interleaved"}) {
    for (int p : {1, 2, 3, 4}) {
      for (int m : {1, 2, 4, 8, 12, 16}) {
        for (int v : {1, 2, 3}) {
          const ScheduleSpec spec{kind, p, m, v};
          if (v > 1 && kind != "interleaved") continue;
          if (kind == "1f1b" && m < p) continue;
          if (kind == "interleaved" && m % p != 0) continue;
          SCOPED_TRACE(dtrain::concat(kind, " P=", p, " M=", m, " V=", v));
          const auto sim = simulate(spec, all_ranks(spec), 1.0, 2.0);
          for (double idle : sim.idle_share) EXPECT_NEAR(idle, bubble_formula(spec), 1e-9);
          for (int r = 0; r < p; ++r) {
            if (kind == "gpipe") {
              EXPECT_EQ(sim.peak_live[r], m);
            }
            if (kind == "1f1b") {
              EXPECT_EQ(sim.peak_live[r], std::min(m, p - r));
            }
          }
        }
      }
    }
  }
}

// Zero bubble (backward split into B and W, each half of 1F1B's backward): ZB-H1 keeps 1F1B's
// F/B order and fills the waits with W's: with T_F = T_B = T_W the step takes 3M + P - 1, the
// lower bound of a flushed step (the last stage cannot start before P - 1 forwards), each rank
// idling P - 1 where 1F1B idles 3(P - 1); it keeps 1F1B's activations (at most P - r
// micro-batches forwarded and not B'd, stage 0's P the peak) with at most r + 1 W's pending on
// rank r. ZB-H2 warms up with 2(P - r) - 1 forwards under the same cap: at most 2P micro-batches
// forwarded and not W'd on any rank (2x 1F1B's P).
TEST(Schedule, ZeroBubbleSchedulesFillTheWaitsWithWeightGradients) {
  ScheduleSpec spec{"zb-h1", 2, 4, 1};
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3");
  EXPECT_EQ(listing(build_schedule(spec, 1)), "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3");
  spec.kind = "zb-h2";
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3");
  EXPECT_EQ(listing(build_schedule(spec, 1)), "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3");
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {p, p + 1, 2 * p, 4 * p}) {
      SCOPED_TRACE(dtrain::concat("P=", p, " M=", m));
      const ScheduleSpec one{"1f1b", p, m, 1};
      const ScheduleSpec h1{"zb-h1", p, m, 1};
      const ScheduleSpec h2{"zb-h2", p, m, 1};
      const auto base = simulate(one, all_ranks(one), 1.0, 2.0);
      const auto zb1 = simulate(h1, all_ranks(h1), 1.0, 2.0);
      const auto zb2 = simulate(h2, all_ranks(h2), 1.0, 2.0);
      EXPECT_DOUBLE_EQ(base.makespan, 3.0 * m + 3.0 * (p - 1));
      EXPECT_DOUBLE_EQ(zb1.makespan, 3.0 * m + (p - 1));
      EXPECT_LE(zb2.makespan, 3.0 * m + p);
      for (int r = 0; r < p; ++r) {
        EXPECT_NEAR(zb1.idle_share[r] * zb1.makespan, p - 1.0, 1e-9);
        EXPECT_NEAR(base.idle_share[r] * base.makespan, 3.0 * (p - 1), 1e-9);
        EXPECT_LE(zb1.peak_live[r], base.peak_live[r]);
        EXPECT_LE(zb1.peak_pending_weights[r], r + 1);
        EXPECT_LE(zb2.peak_live[r], std::min(m, 2 * (p - r) - 1 + 1));
        // Forwarded and not yet W'd, along the list: what a micro-batch holds until its W.
        int held = 0, most = 0;
        for (const auto& a : build_schedule(h2, r)) {
          held += a.kind == Action::Forward ? 1 : a.kind == Action::Weight ? -1 : 0;
          most = std::max(most, held);
        }
        EXPECT_LE(most, 2 * p);
        EXPECT_EQ(base.peak_pending_weights[r], 0);
      }
    }
  }
  EXPECT_TRUE(schedule_info("zb-h1").splits_backward);
  EXPECT_TRUE(schedule_info("zb-h2").splits_backward);
  // Their lists are made together (ScheduleInfo::build_all: one run of the pipeline instead of
  // one per rank, what the planner's search builds for thousands of layouts): every rank's list
  // is the one its rank builds alone.
  for (const char* kind : {"zb-h1", "zb-h2"}) {
    for (const ScheduleSpec& spec : {ScheduleSpec{kind, 4, 8, 1}, ScheduleSpec{kind, 8, 13, 1}}) {
      ASSERT_TRUE(schedule_info(kind).build_all);
      const auto together = build_slot_schedules(spec);
      ASSERT_EQ(together.size(), static_cast<size_t>(spec.stages));
      for (int r = 0; r < spec.stages; ++r) {
        EXPECT_EQ(listing(together[r]), listing(build_schedule(spec, r))) << kind << " rank " << r;
      }
    }
  }
  // A W before its B, or a W in a schedule that does not split backward, is refused.
  auto lists = all_ranks({"zb-h1", 2, 2, 1});
  std::swap(lists[1][1], lists[1].back());  // rank 1: F0 W1 ... B1
  EXPECT_THROW(simulate({"zb-h1", 2, 2, 1}, lists), dtrain::InputError);
  EXPECT_THROW(simulate({"1f1b", 2, 2, 1}, all_ranks({"zb-h1", 2, 2, 1})), dtrain::InputError);
}

// ZB-V: two chunks per rank in a V (rank r holds virtual stages r and 2P - 1 - r: rank 0 the
// first and the last, the turn on rank P - 1). With F, B and W costing the same per chunk, from
// 2P - 1 micro-batches on every rank idles only P - 1 chunk slots, the floor of a flushed step
// (the last rank cannot start before P - 1 forwards): 6M + P - 1 where 1F1B takes
// 6M + 6(P - 1) and ZB-H1 6M + 2(P - 1). Each rank holds at most 2P chunk micro-batches (half a
// stage each) until their W: 1F1B's stage-0 peak of P stage micro-batches.
TEST(Schedule, ZeroBubbleVRunsTwoChunksPerRankInAVWithoutIdling) {
  const ScheduleSpec v{"zb-v", 2, 4, 2};
  EXPECT_EQ(listing(build_schedule(v, 0)),
            "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 B2.1 W2.1 B1 W1 F3.1 B3.1 W3.1 "
            "B2 W2 B3 W3");
  EXPECT_EQ(listing(build_schedule(v, 1)),
            "F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 F3 B1 W1 F3.1 B2.1 W2.1 B2 B3.1 B3 "
            "W2 W3.1 W3");
  for (int p : {1, 2, 3, 4, 8}) {
    const ScheduleSpec placed{"zb-v", p, p, 2};
    for (int r = 0; r < p; ++r) {
      EXPECT_EQ(stage_of(placed, 0, r), r);
      EXPECT_EQ(stage_of(placed, 1, r), 2 * p - 1 - r);
      for (int c : {0, 1}) {
        EXPECT_EQ(rank_of(placed, stage_of(placed, c, r)), r);
        EXPECT_EQ(chunk_of(placed, stage_of(placed, c, r)), c);
      }
    }
    for (int m : {p, 2 * p - 1, 2 * p, 3 * p, 4 * p}) {
      SCOPED_TRACE(dtrain::concat("P=", p, " M=", m));
      const ScheduleSpec zbv{"zb-v", p, m, 2};
      const ScheduleSpec one{"1f1b", p, m, 1};
      const ScheduleSpec h1{"zb-h1", p, m, 1};
      // Per chunk (half a stage): F = B = W = 1.
      const auto sim = simulate(zbv, all_ranks(zbv), 2.0, 4.0);
      EXPECT_DOUBLE_EQ(simulate(one, all_ranks(one), 2.0, 4.0).makespan, 6.0 * m + 6.0 * (p - 1));
      EXPECT_DOUBLE_EQ(simulate(h1, all_ranks(h1), 2.0, 4.0).makespan, 6.0 * m + 2.0 * (p - 1));
      if (m >= 2 * p - 1) {
        EXPECT_DOUBLE_EQ(sim.makespan, 6.0 * m + (p - 1));
      } else {
        EXPECT_LE(sim.makespan, 6.0 * m + 2.0 * (p - 1));  // no worse than ZB-H1
      }
      for (int r = 0; r < p; ++r) {
        EXPECT_LE(sim.peak_live[r], 2 * p);
        int held = 0, most = 0;
        for (const auto& a : build_schedule(zbv, r)) {
          held += a.kind == Action::Forward ? 1 : a.kind == Action::Weight ? -1 : 0;
          most = std::max(most, held);
        }
        EXPECT_LE(most, 2 * p);
      }
    }
  }
  EXPECT_EQ(schedule_info("zb-v").chunks, 2);
  EXPECT_EQ(chunks_of("zb-v", 1), 2);
  EXPECT_EQ(chunks_of("interleaved", 3), 3);
  // The looping placement of the other schedules: chunk c of rank r is stage c * P + r.
  const ScheduleSpec looping{"interleaved", 4, 8, 3};
  EXPECT_EQ(stage_of(looping, 2, 1), 9);
  EXPECT_EQ(rank_of(looping, 9), 1);
  EXPECT_EQ(chunk_of(looping, 9), 2);
}

// DualPipe-V: ZB-V's placement with a steady state of pairs, one chunk's forward (marked &) and
// the other chunk's backward of another micro-batch, which the executor runs together. Its
// lists equal PyTorch 2.x's ScheduleDualPipeV's (tests/data/dualpipev_oracle.py; that part
// skipped without .venv-torch); they run without deadlock as the executor runs pairs (both
// inputs first, both results at the pair's end); every rank pairs 2(M - 2P + r + 1) + P - r - 1
// forwards (one fewer on the last rank); and M < 2P is refused by name.
TEST(Schedule, DualPipeVPairsOneChunksForwardWithTheOthersBackward) {
  const std::string python = peer_python();
  const std::string oracle = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/dualpipev_oracle.py";
  const bool have_torch =
      std::system((python + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0;
  std::vector<std::pair<int, int>> specs;
  std::string arguments;
  for (int p : {1, 2, 3, 4}) {
    for (int m : {2 * p, 2 * p + 1, 3 * p, 4 * p + 1}) {
      specs.emplace_back(p, m);
      arguments += concat(" ", p, ":", m);
    }
  }
  std::string expected;  // PyTorch's lists, every spec's in order
  if (have_torch) {
    const test::cli::Output out = test::cli::run(concat(python, " ", oracle, arguments));
    ASSERT_EQ(out.code, 0) << out.text;
    expected = out.text;
  }
  std::string mine;
  for (const auto& [p, m] : specs) {
    {
      SCOPED_TRACE(concat("P=", p, " M=", m));
      const ScheduleSpec spec{"dualpipev", p, m, 2};
      const auto lists = all_ranks(spec);
      for (const auto& list : lists) mine += listing(list) + "\n";
      const Simulation sim = simulate(spec, lists, 2.0, 4.0);  // F = B = W = 1 per chunk
      EXPECT_GE(sim.makespan, 6.0 * m);
      for (int r = 0; r < p; ++r) {
        int pairs = 0;
        for (size_t i = 0; i < lists[r].size(); ++i) {
          const Action& a = lists[r][i];
          if (!a.overlapped) continue;
          ++pairs;
          ASSERT_EQ(a.kind, Action::Forward);
          const Action& b = lists[r][i + 1];
          EXPECT_EQ(b.kind, Action::Backward);
          EXPECT_NE(b.chunk, a.chunk);
        }
        EXPECT_EQ(pairs, 2 * (m - 2 * p + r + 1) + p - r - 1 - (r == p - 1 ? 1 : 0)) << r;
      }
    }
  }
  if (have_torch) {
    EXPECT_EQ(mine, expected);
  }
  // Paired, the two actions start once both inputs are in and their results leave at the
  // pair's end: a backward paired with its own micro-batch's forward never starts.
  const ScheduleSpec one{"dualpipev", 1, 2, 2};
  const std::vector<Action> own = {
      {Action::Forward, 0, 0},  {Action::Forward, 0, 1, true}, {Action::Backward, 0, 1},
      {Action::Weight, 0, 1},   {Action::Forward, 1, 0},       {Action::Forward, 1, 1},
      {Action::Backward, 1, 1}, {Action::Weight, 1, 1},        {Action::Backward, 0, 0},
      {Action::Weight, 0, 0},   {Action::Backward, 1, 0},      {Action::Weight, 1, 0}};
  EXPECT_NE(error_of([&] { simulate(one, {own}); }).find("deadlocks"), std::string::npos);
  std::vector<Action> unpaired = own;
  unpaired[1].overlapped = false;
  EXPECT_NO_THROW(simulate(one, {unpaired}));
  EXPECT_NE(error_of([&] {
              build_schedule({"dualpipev", 3, 5, 2}, 0);
            }).find("dualpipev schedule needs at least twice as many micro-batches"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              std::vector<std::vector<Action>> lists = all_ranks({"dualpipev", 1, 2, 2});
              lists[0][0].overlapped = true;  // F0 followed by a forward
              simulate({"dualpipev", 1, 2, 2}, lists);
            }).find("is not a forward followed by a backward"),
            std::string::npos);
}

// PipeDream's replicated stages: every slot's list runs (simulated) for each schedule, replica
// split and M from the largest replica count up, each slot running exactly its micro-batches
// (m % replicas); 1F1B's replicas run 1F1B over their own micro-batches, warmed up to keep the
// ranks downstream busy (PipeDream's 1F1B-RR), not the stage's order filtered.
TEST(Schedule, ReplicatedStagesRunTheirShareWithoutDeadlock) {
  for (const std::string kind : {"gpipe", "1f1b", "zb-h1", "zb-h2"}) {
    for (const std::vector<int>& replicas : std::vector<std::vector<int>>{
             {2, 1}, {1, 2}, {3, 1}, {1, 3}, {1, 2, 1}, {2, 1, 2}, {1, 1, 3}, {3, 2, 1}}) {
      for (int m : {3, 4, 6, 8}) {
        const int stages = static_cast<int>(replicas.size());
        if (m < stages || m < *std::max_element(replicas.begin(), replicas.end())) continue;
        ScheduleSpec spec{kind, stages, m, 1, replicas};
        SCOPED_TRACE(concat(kind, " replicas ", replicas[0], ",", replicas[1], " M=", m));
        std::vector<std::vector<Action>> lists;
        for (int slot = 0; slot < spec.slots(); ++slot) {
          lists.push_back(build_slot_schedule(spec, slot));
          const int stage = spec.stage_of_slot(slot);
          for (const auto& a : lists.back()) {
            EXPECT_EQ(a.micro_batch % replicas[stage], slot - spec.slot_of(stage, 0));
          }
        }
        EXPECT_NO_THROW(simulate(spec, lists));
      }
    }
  }
  const ScheduleSpec spec{"1f1b", 2, 6, 1, {2, 1}};
  EXPECT_EQ(listing(build_slot_schedule(spec, 0)), "F0 F2 B0 F4 B2 B4");
  EXPECT_EQ(listing(build_slot_schedule(spec, 1)), "F1 F3 B1 F5 B3 B5");
  EXPECT_EQ(listing(build_slot_schedule(spec, 2)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // A stage twice as costly on two replicas keeps pace with the single one after it.
  ActionCosts costs;
  costs.duration = [&](int slot, const Action& a) {
    const double unit = spec.stage_of_slot(slot) == 0 ? 2.0 : 1.0;
    return a.kind == Action::Forward ? unit : 2 * unit;
  };
  std::vector<std::vector<Action>> lists;
  for (int slot = 0; slot < 3; ++slot) lists.push_back(build_slot_schedule(spec, slot));
  // Unreplicated, the costly stage alone takes 6 x 6 = 36; here each replica's 3 x 6, a first
  // round trip and the last backward's wait: 24. The stage's order filtered waits a round trip
  // per micro-batch: 30.
  std::vector<std::vector<Action>> filtered;
  for (int slot = 0; slot < 3; ++slot) {
    const int stage = spec.stage_of_slot(slot);
    filtered.push_back({});
    for (const auto& a : build_schedule({"1f1b", 2, 6, 1}, stage)) {
      if (a.micro_batch % spec.replicas[stage] == slot - spec.slot_of(stage, 0)) {
        filtered.back().push_back(a);
      }
    }
  }
  EXPECT_DOUBLE_EQ(simulate(spec, lists, costs).makespan, 24.0);
  EXPECT_DOUBLE_EQ(simulate(spec, filtered, costs).makespan, 30.0);
  EXPECT_THROW((build_slot_schedule({"1f1b", 2, 2, 1, {3, 1}}, 0)), InputError);
  EXPECT_THROW((build_slot_schedule({"interleaved", 2, 4, 2, {2, 1}}, 0)), InputError);
}

TEST(Schedule, ADeadlockOrAMissingActionIsNamed) {
  const ScheduleSpec spec{"1f1b", 2, 2, 1};
  auto lists = all_ranks(spec);
  std::swap(lists[1][0], lists[1][1]);  // rank 1 runs B0 before F0
  try {
    simulate(spec, lists);
    ADD_FAILURE() << "no deadlock found";
  } catch (const dtrain::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("deadlocks: rank 0 at B0; rank 1 at B0"),
              std::string::npos)
        << e.what();
  }
  lists = all_ranks(spec);
  lists[0].pop_back();
  EXPECT_THROW(simulate(spec, lists), dtrain::InputError);
  lists = all_ranks(spec);
  lists[0].back() = lists[0].front();
  EXPECT_THROW(simulate(spec, lists), dtrain::InputError);
}

TEST(Schedule, BadSpecsAreNamed) {
  auto message = [](const ScheduleSpec& spec) {
    try {
      build_schedule(spec, 0);
    } catch (const dtrain::InputError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({"1f1b", 4, 2, 1}).find("at least as many micro-batches"), std::string::npos);
  EXPECT_NE(message({"zb-h1", 4, 2, 1}).find("zb-h1 schedule needs at least"), std::string::npos);
  EXPECT_NE(message({"zb-h2", 2, 4, 2}).find("need the interleaved schedule"), std::string::npos);
  EXPECT_NE(message({"zb-v", 2, 4, 1}).find("zb-v schedule runs 2 chunks"), std::string::npos);
  EXPECT_NE(message({"zb-v", 4, 3, 2}).find("zb-v schedule needs at least"), std::string::npos);
  EXPECT_NE(message({"interleaved", 2, 3, 2}).find("multiple of the pipeline"), std::string::npos);
  EXPECT_NE(message({"gpipe", 2, 4, 2}).find("need the interleaved schedule"), std::string::npos);
  EXPECT_NE(message({"gpipe", 0, 4, 1}).find("stages must be >= 1"), std::string::npos);
  EXPECT_THROW(schedule_info("zigzag"), dtrain::InputError);
  EXPECT_THROW(build_schedule({"gpipe", 2, 4, 1}, 2), dtrain::InputError);
}

// PipeDream's partition: a stage replicated r times carries r times the work.
TEST(Partition, AReplicatedStageTakesItsShare) {
  const std::vector<double> costs{1, 1, 1, 1, 1, 1};
  EXPECT_EQ(balanced_partition(costs, 2).begin, (std::vector<int>{0, 3, 6}));
  EXPECT_EQ(balanced_partition(costs, 2, {2, 1}).begin, (std::vector<int>{0, 4, 6}));
  EXPECT_EQ(balanced_partition(costs, 2, {1, 5}).begin, (std::vector<int>{0, 1, 6}));
  EXPECT_EQ(balanced_partition({1, 1, 1, 1, 1}, 3, {1, 3, 1}).begin,
            (std::vector<int>{0, 1, 4, 5}));
}

TEST(Partition, BalancesParametersContiguously) {
  const auto p = balanced_partition({4, 0, 4, 0, 4, 0, 4, 0}, 2);
  EXPECT_EQ(p.begin, (std::vector<int>{0, 3, 8}));  // 8 + 8, ties keep the earliest cut
  EXPECT_EQ(balanced_partition({1, 1, 1, 9}, 2).begin, (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(balanced_partition({2, 2, 2, 2, 2, 2}, 3).begin, (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(partition_from_counts("1,3", 4, 2).begin, (std::vector<int>{0, 1, 4}));
  EXPECT_THROW(balanced_partition({1, 1}, 3), InputError);
  EXPECT_THROW(partition_from_counts("1,2", 4, 2), InputError);
  EXPECT_THROW(partition_from_counts("1,x", 4, 2), InputError);
  EXPECT_THROW(partition_from_counts("1,3", 4, 3), InputError);
}

namespace {

models::ModelSpec deep_mlp() {
  models::ModelSpec spec;
  spec.name = "mlp";
  spec.input_shape = {1, 5, 5};
  spec.classes = 3;
  spec.hidden = {12, 10, 8};
  return spec;
}

struct PipelineRun {
  int pp = 2;
  int dp = 1;
  int micro = 4;
  std::string schedule = "1f1b";
  double clip = 0;
  int dropped_rank = -1;  // its loss is multiplied by zero
  int chunks = 1;         // virtual stages per rank (interleaved)
  std::string data_parallel = "ddp";
  std::string precision = "fp32";
  std::string loss_scaling = "auto";
  double loss_scale_init = 65536;
  std::string transport = "auto";  // "comm": Gloo only, no shared memory
  std::string grad_compression = "none";
  std::vector<std::map<std::string, double>>* metrics = nullptr;  // each rank's last step's
  std::string sync = "flush";                                     // --pipeline-sync
  std::string weight_prediction = "none";                         // --weight-prediction
  // 2bw, async: each rank's forwards and backwards with the weight version each computed on.
  std::vector<std::vector<std::pair<Action, int64_t>>>* versions = nullptr;
  // Non-empty: stage s on stage_replicas[s] ranks (pp and dp are then unused).
  std::vector<int> stage_replicas = {};
  bool overlap_param_gather = false;  // zero1: --overlap-param-gather
  int64_t bucket_cap_bytes = 25LL << 20;
};

// Trains f on pp x dp rank threads and returns every parameter by name (from DP replica 0).
std::map<std::string, at::Tensor> train_pipeline(const Fixture& f, int steps,
                                                 const PipelineRun& run) {
  int world = run.pp * run.dp;
  if (!run.stage_replicas.empty()) {
    world = 0;
    for (int r : run.stage_replicas) world += r;
  }
  std::vector<Model> replicas;
  for (int r = 0; r < world; ++r) {
    replicas.push_back(make_model_as(f.spec, f.dtype));
    restore(replicas.back(), f.initial);
  }
  std::map<std::string, at::Tensor> result;
  std::mutex mutex;
  run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        auto grid = run.stage_replicas.empty()
                        ? std::make_shared<comm::ProcessGrid>(comm, 1, run.pp)
                        : std::make_shared<comm::ProcessGrid>(comm, 1, run.stage_replicas);
        parallel::StrategyOptions options;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().schedule = run.schedule;
        options.max_grad_norm = run.clip;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().virtual_stages = run.chunks;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().data_parallel = run.data_parallel;
        options.precision = run.precision;
        options.loss_scaling = run.loss_scaling;
        options.loss_scale_init = run.loss_scale_init;
        options.grad_compression = run.grad_compression;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().transport = run.transport;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().sync = run.sync;
        options.of<dtrain::parallel::pipeline::PipelineOptions>().weight_prediction =
            run.weight_prediction;
        options.of<dtrain::parallel::zero::ZeroOverlapOptions>().param_gather =
            run.overlap_param_gather;
        options.bucket_cap_bytes = run.bucket_cap_bytes;
        options.first_bucket_cap_bytes = std::min<int64_t>(run.bucket_cap_bytes, 1 << 20);
        PipelineStrategy strategy(options);
        strategy.setup(replicas[comm->rank()], optim::optimizer_factory(f.optimizer), grid);
        if (run.versions) {
          auto* mine = &(*run.versions)[comm->rank()];
          strategy.set_version_observer(
              [mine](const Action& a, int64_t version) { mine->emplace_back(a, version); });
        }
        const int dp_rank = grid->coordinates().dp;
        const int shares = grid->data_parallel_size();
        auto order = data::DistributedSampler(f.dataset.size(), shares, grid->data_parallel_rank(),
                                              {true, 5, true})
                         .indices();
        const int64_t local = f.global_batch / shares;
        const int64_t each = local / run.micro;
        parallel::LossFn loss = parallel::cross_entropy;
        if (comm->rank() == run.dropped_rank) loss = drop_rank_gradient(run.dropped_rank, comm);
        for (int step = 0; step < steps; ++step) {
          std::vector<data::Batch> micro_batches;
          for (int m = 0; m < run.micro; ++m) {
            const int64_t begin = step * local + m * each;
            micro_batches.push_back(f.dataset.get(
                std::vector<int64_t>(order.begin() + begin, order.begin() + begin + each)));
          }
          auto step_result = strategy.train_step(micro_batches, loss);
          if (step + 1 == steps) strategy.finish_training(step_result);  // as the Trainer does
          if (run.metrics) {
            std::lock_guard<std::mutex> lock(mutex);
            (*run.metrics)[comm->rank()] = step_result.metrics;
          }
        }
        strategy.model();  // (waits for zero1's gathers still running)
        if (dp_rank != 0) return;
        std::lock_guard<std::mutex> lock(mutex);
        for (size_t i = 0; i < strategy.local_parameters().size(); ++i) {
          result[strategy.local_parameter_names()[i]] =
              strategy.local_parameters()[i].detach().clone();
        }
      },
      std::chrono::seconds(60));
  return result;
}

double max_difference(const Fixture& f, const std::vector<at::Tensor>& expected,
                      const std::map<std::string, at::Tensor>& got) {
  const auto names = parameters_of(make_model_as(f.spec, f.dtype)).second;
  EXPECT_EQ(got.size(), names.size()) << "a parameter was not trained by any stage";
  double worst = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto it = got.find(names[i]);
    if (it == got.end()) return INFINITY;
    worst = std::max(worst, (expected[i] - it->second).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

// The oracle, in float64: P = 2 and 4 stages, M = 1, 4, 8 micro-batches, both schedules, with
// and without data parallelism (2 x 2), with global-norm clipping; and a lost gradient shows.
TEST(Pipeline, TrainsToTheWeightsOfSingleProcessTraining) {
  at::set_num_threads(1);
  const int steps = 4;
  auto f = make_fixture(deep_mlp(), adam(), steps);
  const auto expected = train_single(f, steps);
  ASSERT_GT(max_abs_diff(expected, f.initial), 1e-3) << "training did not move the weights";
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    for (int pp : {2, 4}) {
      for (int micro : {1, 4, 8}) {
        if (schedule == "1f1b" && micro < pp) continue;
        SCOPED_TRACE(concat(schedule, " P=", pp, " M=", micro));
        PipelineRun run;
        run.pp = pp;
        run.micro = micro;
        run.schedule = schedule;
        EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
      }
    }
    SCOPED_TRACE(concat(schedule, " 2 x 2"));
    PipelineRun run{2, 2, 4, schedule};
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  // Zero bubble: B and W split (the MLP's linear layers defer their weight gradients to W).
  // zb-v at P = 2 runs the MLP's 4 stages as 2 x 2 chunks (rank 0 the first and the last), from
  // M = P (the construction's idle slots) up; its P = 4 is the next test's.
  // dualpipev: zb-v's V from M = 2P, its pairs on two threads.
  for (const std::string schedule : {"zb-h1", "zb-h2", "zb-v", "dualpipev"}) {
    for (int pp : {2, 4}) {
      for (int micro : {2, 4, 8}) {
        const bool v = schedule == "zb-v" || schedule == "dualpipev";
        if (micro < pp || (micro == 2 && !v) || (v && pp == 4) ||
            (schedule == "dualpipev" && micro < 2 * pp)) {
          continue;
        }
        SCOPED_TRACE(concat(schedule, " P=", pp, " M=", micro));
        std::vector<std::map<std::string, double>> metrics(pp);
        PipelineRun run;
        run.pp = pp;
        run.micro = micro;
        run.schedule = schedule;
        run.metrics = &metrics;
        EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
        for (const auto& m : metrics) {
          EXPECT_GT(m.at("peak_deferred_mb"), 0.0) << "no weight gradient was deferred to W";
          EXPECT_GE(m.at("peak_pending_weight_grads"), 1.0);
        }
      }
    }
    for (const std::string data_parallel : {"ddp", "zero1"}) {
      SCOPED_TRACE(concat(schedule, " 2 x 2 ", data_parallel));
      PipelineRun run{2, 2, 4, schedule};
      run.data_parallel = data_parallel;
      EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
    }
    SCOPED_TRACE(concat(schedule, " 2 x 2 over the communicator"));
    PipelineRun run{2, 2, 4, schedule};
    run.transport = "comm";
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  // Interleaved: 2 chunks per rank (4 virtual stages, the last rank handing back to the first).
  for (int micro : {2, 4, 8}) {
    SCOPED_TRACE(concat("interleaved P=2 V=2 M=", micro));
    PipelineRun run;
    run.micro = micro;
    run.schedule = "interleaved";
    run.chunks = 2;
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  // The same through the communicator alone (no shared memory between the stages).
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved"}) {
    SCOPED_TRACE(concat(schedule, " 2 x 2 over the communicator"));
    PipelineRun run{2, 2, 4, schedule};
    run.chunks = schedule == "interleaved" ? 2 : 1;
    run.transport = "comm";
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  // zero1 over each stage's DP group: optimizer state sharded, same weights.
  for (const std::string schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(concat(schedule, " 2 x 2 zero1"));
    PipelineRun run{2, 2, 4, schedule};
    run.chunks = schedule == "interleaved" ? 2 : 1;
    run.data_parallel = "zero1";
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
    // Small buckets, their gathers left running into the next step's forwards, which wait for
    // each bucket where its stage begins (--overlap-param-gather).
    run.overlap_param_gather = true;
    run.bucket_cap_bytes = 512;
    std::vector<std::map<std::string, double>> metrics(4);
    run.metrics = &metrics;
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
    for (const auto& m : metrics) EXPECT_GE(m.at("param_gather_wait_ms"), 0.0);
    // zero1 reduce-scatters each chunk's gradients (Megatron's distributed optimizer): global-norm
    // clipping then sums its shards' squares over the DP group too, as ddp's whole gradients do.
    PipelineRun clipped{2, 2, 4, schedule};
    clipped.chunks = run.chunks;
    clipped.clip = 0.05;
    const auto ddp = train_pipeline(f, steps, clipped);
    clipped.data_parallel = "zero1";
    const auto zero1 = train_pipeline(f, steps, clipped);
    double worst = 0;
    for (const auto& [name, value] : ddp) {
      worst = std::max(worst, (value - zero1.at(name)).abs().max().item<double>());
    }
    EXPECT_LE(worst, kTightBound) << "clipped";
    EXPECT_GT(max_difference(f, expected, ddp), 1e-6) << "clipping did not clip";
  }
  // PowerSGD at full rank over each stage's DP group (every matrix compressed): exact; rank 1
  // is not (the compression is applied).
  for (const std::string spec : {"powersgd:100000:0:0", "powersgd:1"}) {
    SCOPED_TRACE(concat("1f1b 2 x 2 ", spec));
    PipelineRun run{2, 2, 4, "1f1b"};
    run.grad_compression = spec;
    const double diff = max_difference(f, expected, train_pipeline(f, steps, run));
    if (spec == "powersgd:1") {
      EXPECT_GT(diff, 1e-4);
    } else {
      EXPECT_LE(diff, kTightBound);
    }
  }
}

// PipeDream's layouts: stages replicated unequally (2,1 / 1,2 / 1,2,1 / 2,2), each replica taking
// its stage's micro-batches in turn (3 of them: 2 and 1), under the flushed single-chunk
// schedules, with clipping and over the communicator alone: the single-process weights; a
// replica's lost gradient shows.
TEST(Pipeline, ReplicatedStagesTrainToTheSingleProcessWeights) {
  at::set_num_threads(1);
  const int steps = 3;
  auto f = make_fixture(deep_mlp(), adam(), steps, 24);  // M = 3 and 4 divide it
  const auto expected = train_single(f, steps);
  for (const std::vector<int>& replicas : std::vector<std::vector<int>>{{2, 1}, {1, 2}}) {
    for (const std::string schedule : {"gpipe", "1f1b", "zb-h1", "zb-h2"}) {
      for (int micro : {3, 4}) {
        SCOPED_TRACE(concat(schedule, " replicas ", replicas[0], ",", replicas[1], " M=", micro));
        PipelineRun run;
        run.stage_replicas = replicas;
        run.micro = micro;
        run.schedule = schedule;
        EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
      }
    }
  }
  for (const std::vector<int>& replicas : std::vector<std::vector<int>>{{1, 2, 1}, {2, 2}}) {
    SCOPED_TRACE(concat("1f1b over ", replicas.size(), " stages, 4 ranks"));
    PipelineRun run;
    run.stage_replicas = replicas;
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  {
    SCOPED_TRACE("clipped, over the communicator");
    PipelineRun run;
    run.stage_replicas = {2, 1};
    run.transport = "comm";
    run.clip = 0.05;
    PipelineRun unreplicated;
    unreplicated.clip = 0.05;
    const auto clipped = train_pipeline(f, steps, unreplicated);
    ASSERT_GT(max_difference(f, expected, clipped), 1e-4) << "the clip did not bind";
    double worst = 0;
    for (const auto& [name, value] : train_pipeline(f, steps, run)) {
      worst = std::max(worst, (value - clipped.at(name)).abs().max().item<double>());
    }
    EXPECT_LE(worst, kTightBound);
  }
  {
    SCOPED_TRACE("the second replica of the last stage loses its gradient");
    PipelineRun run;
    run.stage_replicas = {1, 2};
    run.dropped_rank = 2;
    EXPECT_GT(max_difference(f, expected, train_pipeline(f, steps, run)), 1e-4);
  }
}

// ZB-V on 4 ranks (8 virtual stages, a V: rank r runs stages r and 7 - r), with M below and at
// 2P: the weights of single-process training, each rank holding at most 2P chunk
// micro-batches.
TEST(Pipeline, ZeroBubbleVOnFourRanksTrainsToTheSingleProcessWeights) {
  at::set_num_threads(1);
  const int steps = 3;
  models::ModelSpec deeper = deep_mlp();
  deeper.hidden = {12, 10, 8, 8, 8, 8, 8};  // 8 stages
  auto f = make_fixture(deeper, adam(), steps);
  const auto expected = train_single(f, steps);
  for (int micro : {4, 8}) {
    SCOPED_TRACE(concat("zb-v P=4 M=", micro));
    std::vector<std::map<std::string, double>> metrics(4);
    PipelineRun run{4, 1, micro, "zb-v"};
    run.metrics = &metrics;
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
    for (const auto& m : metrics) {
      EXPECT_LE(m.at("peak_live_micro_batches"), 8.0);
      EXPECT_GT(m.at("peak_deferred_mb"), 0.0);
    }
  }
}

// PipeDream-2BW: no flush between steps, two weight versions per stage; the weights are those
// of its update rule written out in one process, W(t + 1) = W(t) - step(gradient of batch t at
// W(t - 1)) with W(-1) = W(0), at P = 2 and 4, M = P and 2P, with and without ddp replicas, and
// differ from synchronous training.
namespace {

// The rule in one process, each step's gradient summed over `micro` equal micro-batches (the
// pipeline's: a model with batch norm normalizes each micro-batch on its own). `predict`
// (--weight-prediction extrapolate): batch t >= 2 computes on 2 W(t - 1) - W(t - 2) instead.
std::vector<at::Tensor> train_2bw_rule(const Fixture& f, int steps, int micro = 1,
                                       bool predict = false) {
  Model current = make_model_as(f.spec, f.dtype), previous = make_model_as(f.spec, f.dtype);
  restore(current, f.initial);
  restore(previous, f.initial);
  std::vector<at::Tensor> before = f.initial;  // W(t - 1) at step t
  auto optimizer = optim::make_optimizer(current.module->parameters(), f.optimizer);
  auto order = data::DistributedSampler(f.dataset.size(), 1, 0, {true, 5, true}).indices();
  for (int step = 0; step < steps; ++step) {
    auto batch = f.dataset.get(std::vector<int64_t>(order.begin() + step * f.global_batch,
                                                    order.begin() + (step + 1) * f.global_batch));
    previous.module->zero_grad();
    for (int m = 0; m < micro; ++m) {
      const int64_t each = f.global_batch / micro;
      (parallel::cross_entropy(previous(batch.inputs.narrow(0, m * each, each)),
                               batch.targets.narrow(0, m * each, each)) /
       micro)
          .backward();
    }
    const auto now = snapshot(current);
    auto to = current.module->parameters();
    auto from = previous.module->parameters();
    for (size_t k = 0; k < to.size(); ++k) to[k].mutable_grad() = from[k].grad().clone();
    optimizer->step();
    if (!predict || step == 0) {
      restore(previous, now);
    } else {
      std::vector<at::Tensor> guess;
      for (size_t k = 0; k < now.size(); ++k) guess.push_back(now[k] * 2 - before[k]);
      restore(previous, guess);
    }
    before = now;
  }
  return snapshot(current);
}

}  // namespace

TEST(Pipeline, PipeDream2BWIsItsUpdateRuleWrittenOut) {
  at::set_num_threads(1);
  const int steps = 5;
  auto f = make_fixture(deep_mlp(), adam(), steps);
  const auto expected = train_2bw_rule(f, steps);
  ASSERT_GT(max_abs_diff(expected, train_single(f, steps)), 1e-4)
      << "the stale rule should differ from synchronous training";
  for (int pp : {2, 4}) {
    for (int micro : {pp, 2 * pp}) {
      for (int dp : {1, 2}) {
        if (pp * dp > 4) continue;
        SCOPED_TRACE(concat("2bw P=", pp, " M=", micro, " DP=", dp));
        std::vector<std::map<std::string, double>> metrics(pp * dp);
        PipelineRun run{pp, dp, micro, "1f1b"};
        run.sync = "2bw";
        run.metrics = &metrics;
        EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
        for (int r = 0; r < pp * dp; ++r) {
          EXPECT_EQ(metrics[r].at("weight_versions"), 2.0) << r;
          // finish_training ran what was in flight; no stage held more than 1F1B's P.
          EXPECT_EQ(metrics[r].at("in_flight_micro_batches"), 0.0) << "after finish, rank " << r;
          EXPECT_LE(metrics[r].at("peak_live_micro_batches"), pp) << r;
        }
      }
    }
  }
  {  // --weight-prediction extrapolate: its rule written out, and not 2bw's.
    const auto predicted = train_2bw_rule(f, steps, 1, true);
    ASSERT_GT(max_abs_diff(expected, predicted), 1e-6) << "the prediction should change the rule";
    for (int pp : {2, 4}) {
      SCOPED_TRACE(concat("2bw extrapolated P=", pp));
      std::vector<std::map<std::string, double>> metrics(pp);
      PipelineRun run{pp, 1, 2 * pp, "1f1b"};
      run.sync = "2bw";
      run.weight_prediction = "extrapolate";
      run.metrics = &metrics;
      EXPECT_LE(max_difference(f, predicted, train_pipeline(f, steps, run)), kTightBound);
      for (int r = 0; r < pp; ++r) EXPECT_LE(metrics[r].at("weight_versions"), 4.0) << r;
    }
  }
  {  // Through the communicator alone (Gloo sends beside the loss broadcast in flight).
    SCOPED_TRACE("2bw 2 x 2 over the communicator");
    PipelineRun run{2, 2, 4, "1f1b"};
    run.sync = "2bw";
    run.transport = "comm";
    EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  }
  // A CNN over 3 stages: the middle stage's convolutions read their weights again in backward
  // (for the input's gradient), so its in-flight micro-batches must find their own version
  // there (the MLP's linear layers saved a view of the buffer they read).
  models::ModelSpec cnn;
  cnn.name = "cnn";
  cnn.input_shape = {1, 8, 8};
  cnn.classes = 3;
  auto images = make_fixture(cnn, adam(), steps);
  PipelineRun run{3, 1, 6, "1f1b"};
  run.sync = "2bw";
  EXPECT_LE(
      max_difference(images, train_2bw_rule(images, steps, 6), train_pipeline(images, steps, run)),
      kTightBound)
      << "cnn, P=3";
}

namespace {

// The parameters of each of `stages` pipeline stages, the model's stages cut as the strategy
// cuts them (by parameter count).
std::vector<std::vector<at::Tensor>> parameters_by_stage(const Model& model, int stages) {
  std::vector<double> counts;
  for (const auto& stage : model.stages) {
    double n = 0;
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) n += static_cast<double>(p.numel());
    }
    counts.push_back(n);
  }
  const Partition cut = balanced_partition(counts, stages);
  std::vector<std::vector<at::Tensor>> params(stages);
  for (int s = 0; s < stages; ++s) {
    for (int i = cut.first(s); i < cut.end(s); ++i) {
      for (const auto& module : model.stages[i].modules) {
        for (const auto& p : module->parameters()) params[s].push_back(p);
      }
    }
  }
  return params;
}

// PipeDream's asynchronous rule in one process: stage s (of P, model stages cut as the strategy
// cuts them) computes micro-batch k, forward and backward, on its own version
// W_s(max(0, k - (P - s - 1))) (1F1B without a flush: its k-th forward comes after k - w
// backwards), and after micro-batch k, W_s(k + 1) = W_s(k) - step(its gradient); the loss of a
// micro-batch is its share of the step's (divided by M).
std::vector<at::Tensor> train_async_rule(const Fixture& f, int steps, int stages, int micro) {
  Model model = make_model_as(f.spec, f.dtype);
  restore(model, f.initial);
  std::vector<std::vector<at::Tensor>> params = parameters_by_stage(model, stages);
  auto values = [](const std::vector<at::Tensor>& ps) {
    std::vector<at::Tensor> out;
    for (const auto& p : ps) out.push_back(p.detach().clone());
    return out;
  };
  auto load = [](std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& from) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(from[i]);
  };
  std::vector<std::vector<std::vector<at::Tensor>>> history(stages);  // [stage][version]
  for (int s = 0; s < stages; ++s) history[s].push_back(values(params[s]));
  auto optimizer = optim::make_optimizer(model.module->parameters(), f.optimizer);
  auto order = data::DistributedSampler(f.dataset.size(), 1, 0, {true, 5, true}).indices();
  const int64_t each = f.global_batch / micro;
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < micro; ++i) {
      const int64_t k = static_cast<int64_t>(step) * micro + i;
      const int64_t begin = step * f.global_batch + i * each;
      auto batch =
          f.dataset.get(std::vector<int64_t>(order.begin() + begin, order.begin() + begin + each));
      for (int s = 0; s < stages; ++s) {
        load(params[s], history[s][std::max<int64_t>(0, k - (stages - s - 1))]);
      }
      optimizer->zero_grad();
      (parallel::cross_entropy(model(batch.inputs), batch.targets) / micro).backward();
      for (int s = 0; s < stages; ++s) load(params[s], history[s].back());
      optimizer->step();
      for (int s = 0; s < stages; ++s) history[s].push_back(values(params[s]));
    }
  }
  return snapshot(model);
}

}  // namespace

// PipeDream (asynchronous, weight stashing): every backward computes on the version its
// forward used (read from the strategy), the k-th forward of rank r on the newest version,
// max(0, k - (P - r - 1)) updates old; and the weights are those of the rule written out, at
// P = 2 and 4 and with ddp replicas.
TEST(Pipeline, PipeDreamAsyncStashesEachMicroBatchsWeights) {
  at::set_num_threads(1);
  const int steps = 3;
  auto f = make_fixture(deep_mlp(), adam(), steps);
  for (int pp : {2, 4}) {
    for (int dp : {1, 2}) {
      if (pp * dp > 4) continue;
      const int micro = 4;
      SCOPED_TRACE(concat("async P=", pp, " DP=", dp));
      std::vector<std::vector<std::pair<Action, int64_t>>> versions(pp * dp);
      std::vector<std::map<std::string, double>> metrics(pp * dp);
      PipelineRun run{pp, dp, micro, "1f1b"};
      run.sync = "async";
      run.versions = &versions;
      run.metrics = &metrics;
      EXPECT_LE(
          max_difference(f, train_async_rule(f, steps, pp, micro), train_pipeline(f, steps, run)),
          kTightBound);
      int stashed = 0;
      for (int rank = 0; rank < pp * dp; ++rank) {
        std::vector<int64_t> forwards;
        size_t backwards = 0;
        for (const auto& [action, version] : versions[rank]) {
          if (action.kind == Action::Forward) {
            forwards.push_back(version);
          } else {
            ASSERT_LT(backwards, forwards.size());
            EXPECT_EQ(version, forwards[backwards])
                << "rank " << rank << "'s backward " << backwards;
            ++backwards;
          }
        }
        EXPECT_EQ(backwards, forwards.size());
        // Which stage this rank is: its forwards' staleness says (the first stage the most).
        const int64_t lag = static_cast<int64_t>(forwards.size()) - 1 - forwards.back();
        ASSERT_GE(lag, 0);
        ASSERT_LT(lag, pp);
        for (size_t k = 0; k < forwards.size(); ++k) {
          EXPECT_EQ(forwards[k], std::max<int64_t>(0, static_cast<int64_t>(k) - lag)) << k;
        }
        stashed = std::max<int>(stashed, static_cast<int>(metrics[rank].at("weight_versions")));
      }
      EXPECT_GE(stashed, 2) << "no rank ever held a stashed version";
      EXPECT_LE(stashed, pp + 1);
    }
  }
}

namespace {

// --pipeline-sync eager's rule in one process: every micro-batch of step t computes on W(t);
// stage s (of P, cut as the strategy cuts them) takes W_s(t + 1) = W_s(t) - step(the gradients
// of step t's first M - w micro-batches + those of step t - 1's last w), w = P - 1 - s: the
// late micro-batches' gradients, backwarded after its update, join the next one. The last
// step's late gradients are never applied.
std::vector<at::Tensor> train_eager_rule(const Fixture& f, int steps, int stages, int micro) {
  Model model = make_model_as(f.spec, f.dtype);
  restore(model, f.initial);
  std::vector<at::Tensor> params;
  std::vector<int> late;  // each parameter's stage's w
  const auto by_stage = parameters_by_stage(model, stages);
  for (int s = 0; s < stages; ++s) {
    for (const auto& p : by_stage[s]) {
      params.push_back(p);
      late.push_back(stages - 1 - s);
    }
  }
  std::vector<at::Tensor> pending, head, tail;
  for (const auto& p : params) pending.push_back(at::zeros_like(p));
  auto optimizer = optim::make_optimizer(model.module->parameters(), f.optimizer);
  auto order = data::DistributedSampler(f.dataset.size(), 1, 0, {true, 5, true}).indices();
  const int64_t each = f.global_batch / micro;
  for (int step = 0; step < steps; ++step) {
    head.clear();
    tail.clear();
    for (const auto& p : params) {
      head.push_back(at::zeros_like(p));
      tail.push_back(at::zeros_like(p));
    }
    for (int i = 0; i < micro; ++i) {
      const int64_t begin = step * f.global_batch + i * each;
      auto batch =
          f.dataset.get(std::vector<int64_t>(order.begin() + begin, order.begin() + begin + each));
      optimizer->zero_grad();
      (parallel::cross_entropy(model(batch.inputs), batch.targets) / micro).backward();
      for (size_t k = 0; k < params.size(); ++k) {
        (i < micro - late[k] ? head : tail)[k].add_(params[k].grad());
      }
    }
    for (size_t k = 0; k < params.size(); ++k) params[k].mutable_grad() = head[k] + pending[k];
    optimizer->step();
    pending = tail;
  }
  return snapshot(model);
}

}  // namespace

// --pipeline-sync eager: the weights are those of its rule written out, at P = 2 and 4, M = P
// and 2P, with and without ddp replicas; they differ from both synchronous training and 2bw,
// and no stage holds more than two versions.
TEST(Pipeline, PipeDreamEagerIsItsUpdateRuleWrittenOut) {
  at::set_num_threads(1);
  const int steps = 5;
  auto f = make_fixture(deep_mlp(), adam(), steps);
  for (int pp : {2, 4}) {
    for (int micro : {pp, 2 * pp}) {
      const auto expected = train_eager_rule(f, steps, pp, micro);
      ASSERT_GT(max_abs_diff(expected, train_single(f, steps)), 1e-6)
          << "the late gradients should change the course";
      ASSERT_GT(max_abs_diff(expected, train_2bw_rule(f, steps, micro)), 1e-4);
      for (int dp : {1, 2}) {
        if (pp * dp > 4) continue;
        SCOPED_TRACE(concat("eager P=", pp, " M=", micro, " DP=", dp));
        std::vector<std::map<std::string, double>> metrics(pp * dp);
        PipelineRun run{pp, dp, micro, "1f1b"};
        run.sync = "eager";
        run.metrics = &metrics;
        EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
        for (int r = 0; r < pp * dp; ++r) {
          EXPECT_LE(metrics[r].at("weight_versions"), 2.0) << r;
          EXPECT_EQ(metrics[r].at("in_flight_micro_batches"), 0.0) << "after finish, rank " << r;
        }
      }
    }
  }
}

// bf16-mixed: activations cross stages as bf16 and the pipeline computes what single-process
// mixed-precision training does (float32 weights; a looser bound). A loss scale so large that
// gradients overflow is skipped by every stage and replica alike.
TEST(Pipeline, Bf16MixedMatchesSingleProcessAndLossScalingSkipsTogether) {
  at::set_num_threads(1);
  const int steps = 3;
  auto f = make_fixture(deep_mlp(), adam(), steps, 32, at::kFloat);
  parallel::StrategyOptions mixed;
  mixed.precision = "bf16-mixed";
  // The same micro-batches as the 2 x 2 pipeline's (bf16 rounds each micro-batch's gradient).
  const auto expected = train_distributed(
      f, 2, steps, [&] { return parallel::make_strategy("ddp", mixed); }, 4);
  const auto fp32 = train_single(f, steps);
  PipelineRun run{2, 2, 4, "1f1b"};
  run.precision = "bf16-mixed";
  const double difference = max_difference(f, expected, train_pipeline(f, steps, run));
  EXPECT_LE(difference, 1e-5);
  // Zero bubble under autocast: the linear layers' weight gradients come from B (a cast stands
  // between them and the fp32 weights), the result is the same.
  PipelineRun zero_bubble{2, 2, 4, "zb-h1"};
  zero_bubble.precision = "bf16-mixed";
  EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, zero_bubble)), 1e-5);
  // The bound separates: fp32 training is much further from bf16-mixed than that.
  EXPECT_GT(max_abs_diff(expected, fp32), 100 * std::max(difference, 1e-7));

  // A scale that overflows float32 (the scaled loss is inf): every rank skips the step, no
  // stage's weights move, and all halve their scale.
  std::vector<std::map<std::string, double>> metrics(4);
  PipelineRun overflow{2, 2, 4, "gpipe"};
  overflow.precision = "bf16-mixed";
  overflow.loss_scaling = "dynamic";
  overflow.loss_scale_init = 1e39;
  overflow.metrics = &metrics;
  EXPECT_EQ(max_difference(f, f.initial, train_pipeline(f, 1, overflow)), 0.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(metrics[r]["step_skipped"], 1.0) << "rank " << r;
    EXPECT_EQ(metrics[r]["loss_scale"], 5e38) << "rank " << r;
  }
}

// Global-norm clipping across stages and replicas, activation checkpointing inside stages; the
// oracle notices one rank's loss (hence its micro-batches' gradients) left out.
TEST(Pipeline, ClipsByTheGlobalNormChecksActivationsAndNoticesALostGradient) {
  at::set_num_threads(1);
  const int steps = 3;
  optim::OptimizerSpec sgd;
  sgd.name = "sgd";
  sgd.lr = 0.5;
  auto f = make_fixture(deep_mlp(), sgd, steps);
  // Single-process training with the same clipping.
  Model single = make_model_as(f.spec, f.dtype);
  restore(single, f.initial);
  auto optimizer = optim::make_optimizer(single.module->parameters(), f.optimizer);
  auto order = data::DistributedSampler(f.dataset.size(), 1, 0, {true, 5, true}).indices();
  double clipped_below = 0;
  for (int step = 0; step < steps; ++step) {
    auto batch = f.dataset.get(std::vector<int64_t>(order.begin() + step * f.global_batch,
                                                    order.begin() + (step + 1) * f.global_batch));
    optimizer->zero_grad();
    parallel::cross_entropy(single(batch.inputs), batch.targets).backward();
    clipped_below = torch::nn::utils::clip_grad_norm_(single.module->parameters(), 0.05);
    optimizer->step();
  }
  ASSERT_GT(clipped_below, 0.05) << "the bound does not clip";
  const auto expected = snapshot(single);
  PipelineRun run{2, 2, 4, "1f1b", 0.05};
  EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, run)), kTightBound);
  PipelineRun zero_bubble{2, 2, 4, "zb-h1", 0.05};  // clipped after the last W
  EXPECT_LE(max_difference(f, expected, train_pipeline(f, steps, zero_bubble)), kTightBound);

  auto checkpointed = f;
  checkpointed.spec.checkpointing = "2";
  run.clip = 0;
  const auto plain = train_single(f, steps);
  EXPECT_LE(max_difference(checkpointed, plain, train_pipeline(checkpointed, steps, run)),
            kTightBound);
  // Recomputed stages under zero bubble: the recomputation computes their weight gradients in
  // B (nothing is deferred from inside a checkpoint), the result is the same.
  zero_bubble.clip = 0;
  EXPECT_LE(max_difference(checkpointed, plain, train_pipeline(checkpointed, steps, zero_bubble)),
            kTightBound);

  run.dropped_rank = 3;  // the last stage of replica 1
  EXPECT_GT(max_difference(f, plain, train_pipeline(f, steps, run)), 1e6 * kTightBound);
}

// --pipeline-balance time measures the stages: a stage with no parameters but most of the
// compute gets a rank to itself, where balancing by parameters would pair it with a layer.
TEST(Pipeline, BalanceByTimeFollowsMeasuredCostNotParameters) {
  at::set_num_threads(1);
  run_ranks(
      2,
      [](const comm::CommunicatorPtr& comm) {
        auto grid = std::make_shared<comm::ProcessGrid>(comm, 1, 2);
        auto make = [] {
          torch::manual_seed(1);
          torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::Linear(64, 64),
                                    torch::nn::Linear(64, 64), torch::nn::Linear(64, 4));
          Model model = sequential_model(net);
          const at::Tensor mixing = torch::randn({64, 64}) / 8;
          Stage heavy;  // no parameters, many matmuls
          heavy.name = "heavy";
          heavy.forward = [mixing](const at::Tensor& x) {
            at::Tensor y = x;
            for (int i = 0; i < 300; ++i) y = torch::tanh(y.matmul(mixing));
            return y;
          };
          model.stages.insert(model.stages.begin(), heavy);
          auto forward = model.forward;
          model.forward = [heavy, forward](const at::Tensor& x) {
            return forward(heavy.forward(x));
          };
          return model;
        };
        const data::Batch example{torch::randn({32, 64}), torch::zeros({32}, at::kLong)};
        for (const std::string balance : {"params", "time"}) {
          parallel::StrategyOptions options;
          options.of<dtrain::parallel::pipeline::PipelineOptions>().balance = balance;
          options.of<dtrain::parallel::pipeline::PipelineOptions>().schedule = "gpipe";
          PipelineStrategy strategy(options);
          strategy.prepare(example);
          strategy.setup(make(), optim::optimizer_factory(adam()), grid);
          EXPECT_EQ(strategy.partition().end(0), balance == "time" ? 1 : 3) << balance;
          EXPECT_NE(strategy.layout().find(balance == "time" ? "measured time" : "parameters"),
                    std::string::npos)
              << strategy.layout();
          // It trains either way.
          std::vector<data::Batch> micro_batches{example};
          EXPECT_TRUE(
              std::isfinite(strategy.train_step(micro_batches, parallel::cross_entropy).loss));
        }
      },
      std::chrono::seconds(60));
}

TEST(Pipeline, BadLayoutsAreNamedBeforeAnyWork) {
  auto message = [](const std::function<void()>& body) {
    try {
      body();
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    auto grid = std::make_shared<comm::ProcessGrid>(comm, 1, 2);
    Model one_stage = sequential_model(torch::nn::Sequential(torch::nn::Linear(25, 3)));
    PipelineStrategy strategy({});
    EXPECT_NE(message([&] {
                strategy.setup(one_stage, optim::optimizer_factory(adam()), grid);
              }).find("the model has 1 stage, fewer than the 2 pipeline stages"),
              std::string::npos);
    Model opaque(models::make_model(deep_mlp()).module, [](const at::Tensor& x) { return x; });
    EXPECT_NE(message([&] {
                PipelineStrategy(parallel::StrategyOptions{})
                    .setup(opaque, optim::optimizer_factory(adam()), grid);
              }).find("needs a model described as stages"),
              std::string::npos);
    parallel::StrategyOptions options;
    options.of<dtrain::parallel::pipeline::PipelineOptions>().schedule = "zigzag";
    EXPECT_NE(message([&] { PipelineStrategy{options}; }).find("unknown pipeline schedule"),
              std::string::npos);
    parallel::StrategyOptions transport;
    transport.of<dtrain::parallel::pipeline::PipelineOptions>().transport = "pigeon";
    EXPECT_NE(message([&] {
                PipelineStrategy{transport};
              }).find("unknown --pipeline-transport 'pigeon' (expected auto or comm)"),
              std::string::npos);
  });
}
