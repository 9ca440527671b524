// The pipeline schedules' registry. Adding one: a builder (a function from a spec and a rank to
// that rank's actions) in a file of its own, and one line here (or register_schedule from
// outside the library: tests/how_to_add_test.cpp).
#include <utility>

#include "dtrain/common/Registry.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "parallel/pipeline/ScheduleBuilders.h"

namespace dtrain::parallel::pipeline {

namespace {

ScheduleInfo schedule(std::string name, std::string summary,
                      std::vector<Action> (*build)(const ScheduleSpec&, int)) {
  ScheduleInfo info;
  info.name = std::move(name);
  info.summary = std::move(summary);
  info.build = build;
  return info;
}

/// `info` with its backward split into B and W, every rank's list made at once by `all` (null:
/// rank by rank), in `chunks` fixed chunks per rank (0: one).
ScheduleInfo zero_bubble(ScheduleInfo info,
                         std::vector<std::vector<Action>> (*all)(const ScheduleSpec&) = nullptr,
                         int chunks = 0, bool v_shape = false) {
  info.splits_backward = true;
  if (all != nullptr) info.build_all = all;
  info.fills_pipe = true;
  info.chunks = chunks;
  info.v_shape = v_shape;
  return info;
}

std::vector<ScheduleInfo> built_in() {
  ScheduleInfo one_f_one_b =
      schedule("1f1b", "PipeDream-flush: warm-up forwards, one forward / one backward, cool-down",
               one_f_one_b_schedule);
  one_f_one_b.fills_pipe = true;
  one_f_one_b.flush_free = true;
  one_f_one_b.build_replicated = replicated_one_f_one_b_lists;
  ScheduleInfo interleaved =
      schedule("interleaved", "Megatron's interleaved 1F1B over --virtual-stages chunks per rank",
               interleaved_schedule);
  interleaved.interleaves = true;
  interleaved.fills_pipe = true;
  interleaved.groups_of_stages = true;
  ScheduleInfo dual_pipe_v = zero_bubble(
      schedule("dualpipev",
               "DualPipe-V: zb-v's V with one chunk's forward and the other's backward run "
               "together (a mixture of experts' all-to-alls hidden behind compute)",
               dual_pipe_v_schedule),
      nullptr, 2, true);
  dual_pipe_v.fills_v = true;
  dual_pipe_v.overlaps = true;
  return {
      schedule("gpipe", "all forwards, then all backwards", gpipe_schedule),
      one_f_one_b,
      interleaved,
      zero_bubble(schedule("zb-h1", "zero bubble H1: 1F1B's memory, W's fill the waits",
                           zero_bubble_h1_schedule),
                  zero_bubble_h1_lists),
      zero_bubble(schedule("zb-h2", "zero bubble H2: a longer warm-up, up to 2x 1F1B's memory",
                           zero_bubble_h2_schedule),
                  zero_bubble_h2_lists),
      zero_bubble(
          schedule("zb-v", "zero bubble V: two chunks per rank in a V", zero_bubble_v_schedule),
          nullptr, 2, true),
      dual_pipe_v,
  };
}

Registry<ScheduleInfo>& registry() {
  static Registry<ScheduleInfo> schedules("pipeline schedule", "--schedule", built_in());
  return schedules;
}

}  // namespace

const ScheduleInfo& schedule_info(const std::string& name) { return registry().at(name); }

std::vector<std::string> schedule_names() { return registry().names(); }

void register_schedule(ScheduleInfo info) {
  DTRAIN_CHECK_INPUT(info.build != nullptr, "registering pipeline schedule '", info.name,
                     "': it needs a builder");
  registry().add(std::move(info));
}

bool splits_backward(const std::string& name) { return schedule_info(name).splits_backward; }

int chunks_of(const std::string& kind, int virtual_stages) {
  const ScheduleInfo& info = schedule_info(kind);
  return info.chunks > 0 ? info.chunks : virtual_stages;
}

const ScheduleInfo& ScheduleSpec::info() const {
  if (cached_info == nullptr || cached_info->name != kind) cached_info = &schedule_info(kind);
  return *cached_info;
}

}  // namespace dtrain::parallel::pipeline
