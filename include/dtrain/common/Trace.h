// Timeline traces (Chrome / Perfetto "trace event" JSON): spans such as forward, backward, recv,
// allreduce and the optimizer step, recorded per thread (the thread that trains: a rank's main
// thread, or a rank thread in tests) while tracing is on. A Span costs one check of a
// thread-local flag when tracing is off. The Trainer starts tracing for `--trace FILE`, gathers
// every rank's spans at the end and writes one file with a track per rank;
// scripts/plot-timeline draws it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::trace {

struct Event {
  std::string category;  // "forward", "backward", "recv", "sync", "optimizer", "step", ...
  std::string name;      // shown on the span, e.g. "F3"
  int64_t start_us = 0;  // wall clock (system_clock), so ranks on other hosts line up
  int64_t duration_us = 0;
  int tid = 0;  // the rank's track: 0 its training thread, 1 a helper (DualPipe-V's backward)
};

/// Starts recording this thread's spans (clearing earlier ones); at most `max_events` are kept
/// (later ones are counted as dropped).
void start(int64_t max_events = 2000000);
void stop();
bool enabled();
/// The recorded events, and how many did not fit.
std::vector<Event> events();
int64_t dropped();

/// A thread's recording, for a helper thread to add its spans to (current(): this thread's).
struct Recorder;
Recorder* current();
/// While alive, this thread's spans go to `recorder` on track `tid` (recorded when the thread
/// that owns it records): a helper thread's work shows on its rank's timeline.
class Adopt {
 public:
  Adopt(Recorder* recorder, int tid);
  ~Adopt();
  Adopt(const Adopt&) = delete;
  Adopt& operator=(const Adopt&) = delete;

 private:
  Recorder* saved_;
  int saved_tid_;
  bool saved_enabled_;
};

/// Records [construction, destruction) as one event when tracing is on.
class Span {
 public:
  Span(const char* category, std::string name);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool active_;
  const char* category_;
  std::string name_;
  int64_t start_us_ = 0;
};

/// Encodes events as JSON objects of the trace-event format ("ph": "X"), one per line, with
/// pid = `rank`, comma-separated; and a whole trace file from such per-rank fragments.
std::string to_json_events(const std::vector<Event>& events, int rank);
std::string trace_file(const std::vector<std::string>& rank_fragments);

}  // namespace dtrain::trace
