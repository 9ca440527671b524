// Stop requests: one process-wide flag a signal handler may set (dtrain/train/Stop.h).
#include "dtrain/train/Stop.h"

#include <signal.h>

#include <time.h>

#include <atomic>
#include <cstdint>

namespace dtrain::train {

namespace {

std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler sets it");

std::atomic<int64_t> g_first_at_ns{0};

int64_t now_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

void on_stop_signal(int signal) {
  int none = 0;
  if (g_stop_signal.compare_exchange_strong(none, signal)) {
    g_first_at_ns.store(now_ns());
    return;
  }
  if (signal == SIGUSR2) return;
  // The same SIGTERM delivered twice at once (GNU timeout sends it to its child and then to
  // the child's process group) is one request; a person's second Ctrl-C is not coalesced.
  if (signal == SIGTERM && none == SIGTERM && now_ns() - g_first_at_ns.load() < 1000000000) return;
  // The second: at once, as the signal would have without dtrain.
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigaction(signal, &action, nullptr);
  raise(signal);
}

}  // namespace

void request_stop(int signal) noexcept {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, signal > 0 ? signal : SIGTERM);
}

int stop_requested() noexcept { return g_stop_signal.load(std::memory_order_relaxed); }

void clear_stop_request() noexcept { g_stop_signal.store(0); }

void stop_on_signals() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // blocking reads and writes go on; the flag is read per step
  sigemptyset(&action.sa_mask);
  for (const int signal : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2}) sigaction(signal, &action, nullptr);
}

}  // namespace dtrain::train
