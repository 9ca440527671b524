// What the launchers of one job share, beside the store they meet in: how an attempt ended
// (Outcome, as published in the store), the keys of their protocol, who takes part in an
// attempt (Membership), and the signal a launcher forwards to its ranks.
#pragma once

#include <signal.h>

#include <chrono>
#include <cstdarg>
#include <string>

#include "dtrain/common/Error.h"

namespace dtrain::launch::agent {

using Clock = std::chrono::steady_clock;

// How an attempt ended.
struct Outcome {
  bool failed = false;
  int code = 0;              // the exit code the launcher returns
  std::string description;   // "node 1 rank 1 (pid 4242) exited with code 3"
  bool interrupted = false;  // the user stopped the job: no restart
  bool stopped = false;      // ... and its ranks stopped on request, their work saved
  bool resize = false;       // elastic: a node is waiting to join; restart at the new size
};

// Keys of the launchers' protocol in the store (the ranks' keys carry "attempt-N/").
inline std::string attempt_key(int attempt, const std::string& name) {
  return concat("dtrain-agent/", attempt, "/", name);
}
inline std::string heartbeat_key(int attempt, int node) {
  return attempt_key(attempt, concat("heartbeat/", node));
}
// A key of the ranks' own (what they reach as `key` through their store prefix "attempt-N/",
// which c10d's PrefixStore joins with a "/").
inline std::string rank_key(int attempt, const std::string& key) {
  return concat("attempt-", attempt, "//", key);
}
// The attempt the host is at; the job's result once it is over ("code|kind|text").
inline const std::string kCurrentKey = "dtrain-agent/current";
inline const std::string kResultKey = "dtrain-agent/result";

// "code|kind|text" <-> Outcome.
std::string encode(const Outcome& o);
Outcome decode(const std::string& value);

// Who takes part in an attempt, as its rendezvous decided.
struct Membership {
  int node_rank = 0;
  int nnodes = 1;
  int restarts_used = 0;  // failures restarted from before this attempt (the same on every node)
};

inline std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
}

// How long a local rank's failure waits before it is published as the job's: long enough for
// another node's failure (the root cause, when ours is a broken connection) to arrive first, or
// for its heartbeat to fall silent.
constexpr std::chrono::milliseconds kSettle{1500};

/// The first signal (SIGINT, SIGTERM, SIGUSR1) the launcher caught (0: none): its ranks are
/// asked to stop; and how many it caught (a second one stops them at once).
extern volatile sig_atomic_t g_forward_signal;
extern volatile sig_atomic_t g_signal_count;

/// What the launcher's lines on stderr begin with: "dtrain launch", or "dtrain train" for the
/// ranks `dtrain train --nproc` starts (LaunchOptions::name).
extern std::string g_name;
/// One line (or more) on stderr, after "NAME: " (printf's format).
[[gnu::format(printf, 1, 2)]] void say(const char* format, ...);

/// CommError naming what was being waited for once a signal was caught.
void check_interrupt(const char* waiting_for);

}  // namespace dtrain::launch::agent
