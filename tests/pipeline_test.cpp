// Pipeline parallelism: schedules (their order, their ideal timeline, deadlock freedom).
#include <gtest/gtest.h>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/pipeline/Schedule.h"

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
  ScheduleSpec spec{ScheduleKind::OneFOneB, 2, 4, 1};
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(listing(build_schedule(spec, 1)), "F0 B0 F1 B1 F2 B2 F3 B3");
  spec.kind = ScheduleKind::GPipe;
  EXPECT_EQ(listing(build_schedule(spec, 0)), "F0 F1 F2 F3 B0 B1 B2 B3");
  // Megatron's interleaved order, P = 2, V = 2, M = 4: groups of P micro-batches go through
  // chunk 0 then chunk 1; rank 0 warms up with (P - 1) * 2 + (V - 1) * P = 4 forwards.
  spec = {ScheduleKind::Interleaved, 2, 4, 2};
  EXPECT_EQ(listing(build_schedule(spec, 0)),
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  EXPECT_EQ(listing(build_schedule(spec, 1)),
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
}

// With equal stages every schedule's ideal idle share is the textbook (P-1)/(VM+P-1), none
// deadlocks, and 1F1B keeps at most P - rank micro-batches alive where GPipe keeps all M.
TEST(Schedule, IdealTimelinesMatchTheBubbleFormula) {
  for (const auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved}) {
    for (int p : {1, 2, 3, 4}) {
      for (int m : {1, 2, 4, 8, 12, 16}) {
        for (int v : {1, 2, 3}) {
          const ScheduleSpec spec{kind, p, m, v};
          if (v > 1 && kind != ScheduleKind::Interleaved) continue;
          if (kind == ScheduleKind::OneFOneB && m < p) continue;
          if (kind == ScheduleKind::Interleaved && m % p != 0) continue;
          SCOPED_TRACE(dtrain::concat(to_string(kind), " P=", p, " M=", m, " V=", v));
          const auto sim = simulate(spec, all_ranks(spec), 1.0, 2.0);
          for (double idle : sim.idle_share) EXPECT_NEAR(idle, bubble_formula(spec), 1e-9);
          for (int r = 0; r < p; ++r) {
            if (kind == ScheduleKind::GPipe) EXPECT_EQ(sim.peak_live[r], m);
            if (kind == ScheduleKind::OneFOneB) EXPECT_EQ(sim.peak_live[r], std::min(m, p - r));
          }
        }
      }
    }
  }
}

TEST(Schedule, ADeadlockOrAMissingActionIsNamed) {
  const ScheduleSpec spec{ScheduleKind::OneFOneB, 2, 2, 1};
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
  EXPECT_NE(message({ScheduleKind::OneFOneB, 4, 2, 1}).find("at least as many micro-batches"),
            std::string::npos);
  EXPECT_NE(message({ScheduleKind::Interleaved, 2, 3, 2}).find("multiple of the pipeline"),
            std::string::npos);
  EXPECT_NE(message({ScheduleKind::GPipe, 2, 4, 2}).find("need the interleaved schedule"),
            std::string::npos);
  EXPECT_NE(message({ScheduleKind::GPipe, 0, 4, 1}).find("stages must be >= 1"),
            std::string::npos);
  EXPECT_THROW(schedule_kind_named("zigzag"), dtrain::InputError);
  EXPECT_THROW(build_schedule({ScheduleKind::GPipe, 2, 4, 1}, 2), dtrain::InputError);
}
