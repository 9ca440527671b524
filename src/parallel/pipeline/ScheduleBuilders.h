// The library's schedule builders (Schedule.cpp), which Schedules.cpp registers: each rank's
// list for a checked spec.
#pragma once

#include <vector>

#include "dtrain/parallel/pipeline/Schedule.h"

namespace dtrain::parallel::pipeline {

std::vector<Action> gpipe_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> one_f_one_b_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> interleaved_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> zero_bubble_h1_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> zero_bubble_h2_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> zero_bubble_v_schedule(const ScheduleSpec& spec, int rank);
std::vector<Action> dual_pipe_v_schedule(const ScheduleSpec& spec, int rank);  // DualPipeV.cpp
/// ZB-H1's and ZB-H2's lists of every rank (they are made together).
std::vector<std::vector<Action>> zero_bubble_h1_lists(const ScheduleSpec& spec);
std::vector<std::vector<Action>> zero_bubble_h2_lists(const ScheduleSpec& spec);
/// Replicated stages under 1F1B: PipeDream's dealt micro-batches where the lists run together
/// (checked on the simulator), else empty.
std::vector<std::vector<Action>> replicated_one_f_one_b_lists(const ScheduleSpec& spec);

}  // namespace dtrain::parallel::pipeline
