#include "launch/Agent.h"

#include <cstdio>
#include <cstdlib>

namespace dtrain::launch::agent {

volatile sig_atomic_t g_forward_signal = 0;
volatile sig_atomic_t g_signal_count = 0;
std::string g_name = "dtrain launch";

void say(const char* format, ...) {
  std::fprintf(stderr, "%s: ", g_name.c_str());
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
}

std::string encode(const Outcome& o) {
  const char* kind = !o.failed       ? "success"
                     : o.stopped     ? "stopped"
                     : o.interrupted ? "interrupt"
                     : o.resize      ? "resize"
                                     : "failure";
  return concat(o.code, "|", kind, "|", o.description);
}
Outcome decode(const std::string& value) {
  Outcome o;
  o.failed = true;
  const auto first = value.find('|');
  const auto second = value.find('|', first + 1);
  if (first == std::string::npos || second == std::string::npos) {
    o.code = 1;
    o.description = value;
    return o;
  }
  o.code = std::atoi(value.substr(0, first).c_str());
  const std::string kind = value.substr(first + 1, second - first - 1);
  o.failed = kind != "success";
  o.stopped = kind == "stopped";
  o.interrupted = kind == "interrupt" || o.stopped;
  o.resize = kind == "resize";
  o.description = value.substr(second + 1);
  return o;
}

void check_interrupt(const char* waiting_for) {
  if (g_forward_signal != 0) {
    DTRAIN_THROW(CommError, "interrupted by signal ", g_forward_signal, " while waiting for ",
                 waiting_for);
  }
}

}  // namespace dtrain::launch::agent
