#include "dtrain/common/Trace.h"

#include <chrono>
#include <mutex>

namespace dtrain::trace {

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  int64_t limit = 0;
  int64_t dropped = 0;
  bool enabled = false;
};

namespace {

// Per thread: a rank is a process in real runs, but tests run ranks as threads of one process,
// and each must record only its own spans. Spans are opened on the thread that runs fit(), or on
// a helper that adopts its recorder (Adopt).
thread_local Recorder* g_adopted = nullptr;
thread_local int g_tid = 0;

Recorder& own() {
  thread_local Recorder r;
  return r;
}

Recorder& recorder() { return g_adopted ? *g_adopted : own(); }

thread_local bool g_enabled = false;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

Recorder* current() { return &recorder(); }

Adopt::Adopt(Recorder* recorder, int tid)
    : saved_(g_adopted), saved_tid_(g_tid), saved_enabled_(g_enabled) {
  g_adopted = recorder;
  g_tid = tid;
  std::lock_guard<std::mutex> lock(recorder->mutex);
  g_enabled = recorder->enabled;
}

Adopt::~Adopt() {
  g_adopted = saved_;
  g_tid = saved_tid_;
  g_enabled = saved_enabled_;
}

void start(int64_t max_events) {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.clear();
  r.limit = max_events;
  r.dropped = 0;
  r.enabled = true;
  g_enabled = true;
}

void stop() {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.enabled = false;
  g_enabled = false;
}

bool enabled() { return g_enabled; }

std::vector<Event> events() {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.events;
}

int64_t dropped() {
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.dropped;
}

Span::Span(const char* category, std::string name) : active_(enabled()), category_(category) {
  if (!active_) return;
  name_ = std::move(name);
  start_us_ = now_us();
}

Span::~Span() {
  if (!active_) return;
  const int64_t end = now_us();
  auto& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (static_cast<int64_t>(r.events.size()) >= r.limit) {
    ++r.dropped;
    return;
  }
  r.events.push_back({category_, std::move(name_), start_us_, end - start_us_, g_tid});
}

std::string to_json_events(const std::vector<Event>& events, int rank) {
  std::string out = "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " + std::to_string(rank) +
                    ", \"args\": {\"name\": \"rank " + std::to_string(rank) + "\"}}";
  for (const auto& e : events) {
    out += ",\n{\"ph\": \"X\", \"pid\": " + std::to_string(rank) +
           ", \"tid\": " + std::to_string(e.tid) + ", \"cat\": \"" + escaped(e.category) +
           "\", \"name\": \"" + escaped(e.name) + "\", \"ts\": " + std::to_string(e.start_us) +
           ", \"dur\": " + std::to_string(e.duration_us) + "}";
  }
  return out;
}

std::string trace_file(const std::vector<std::string>& rank_fragments) {
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  for (const auto& fragment : rank_fragments) {
    if (fragment.empty()) continue;
    out += (first ? "" : ",\n") + fragment;
    first = false;
  }
  return out + "\n]}\n";
}

}  // namespace dtrain::trace
