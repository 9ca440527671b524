#include "launch/Rendezvous.h"

#include <cstdio>
#include <cstdlib>
#include <thread>

namespace dtrain::launch::agent {

// Fixed node count: every node joins the attempt under its --node-rank, or CommError naming
// the missing ones after the timeout.
Membership fixed_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                            int restarts_used) {
  const int node_rank = std::max(0, o.node_rank);
  store.set(attempt_key(attempt, concat("node/", node_rank)), "joined");
  store.add(attempt_key(attempt, "joined"), 1);
  const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
  while (store.add(attempt_key(attempt, "joined"), 0) < o.nnodes) {
    store.add(heartbeat_key(attempt, node_rank), 1);
    check_interrupt("the other nodes");
    if (Clock::now() > deadline) {
      std::string missing;
      for (int n = 0; n < o.nnodes; ++n) {
        if (!store.check(attempt_key(attempt, concat("node/", n)))) {
          missing += concat(missing.empty() ? "" : ", ", n);
        }
      }
      DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt, "): node",
                   missing.find(',') == std::string::npos ? " " : "s ", missing,
                   " did not join within ", o.rendezvous_timeout_seconds, " s (--rdzv-timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {node_rank, o.nnodes, restarts_used};
}

// Elastic, on the host (node 0): once min_nodes have joined, waits the last call for more (or
// until max have), then closes the attempt at the count it has. Joiners numbered >= that count
// wait for the next attempt.
Membership elastic_host_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                                   int restarts_used) {
  store.set(kCurrentKey, std::to_string(attempt));
  const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
  std::optional<Clock::time_point> last_call;
  for (;;) {
    store.add(heartbeat_key(attempt, 0), 1);
    check_interrupt("nodes to join");
    const int joined = static_cast<int>(
        std::min<int64_t>(o.nnodes, 1 + store.add(attempt_key(attempt, "joined"), 0)));
    const auto now = Clock::now();
    if (joined >= o.min_nodes && !last_call) last_call = now + millis(o.last_call_seconds);
    if (joined == o.nnodes || (last_call && now >= *last_call)) {
      store.set(attempt_key(attempt, "closed"), concat(joined, "|", restarts_used));
      return {0, joined, restarts_used};
    }
    if (!last_call && now > deadline) {
      DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt,
                   "): ", joined, " of at least ", o.min_nodes, " nodes joined within ",
                   o.rendezvous_timeout_seconds, " s (--rdzv-timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Elastic, on any other node: joins the host's current attempt; when that attempt closed
// without it (it is running, or full), asks the running job to make room and joins the next.
// Returns nullopt when the job ended before this node got in (its result is in `ended`).
std::optional<Membership> elastic_join_rendezvous(const LaunchOptions& o, comm::Store& store,
                                                  int& attempt, Outcome& ended) {
  if (attempt < 0) attempt = std::atoi(store.get(kCurrentKey).c_str());
  bool said_waiting = false;
  for (;;) {
    const int slot = static_cast<int>(store.add(attempt_key(attempt, "joined"), 1));
    const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
    for (;;) {
      check_interrupt("the rendezvous to close");
      if (store.check(attempt_key(attempt, "closed"))) break;
      if (store.check(kResultKey)) {
        ended = decode(store.get(kResultKey));
        return std::nullopt;
      }
      // A running job (attempt - 1) can take as long as it needs to make room; an open
      // rendezvous must close within the timeout.
      if (!said_waiting && Clock::now() > deadline) {
        DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt,
                     ") did not close within ", o.rendezvous_timeout_seconds,
                     " s (--rdzv-timeout)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const std::string closed = store.get(attempt_key(attempt, "closed"));
    const int nnodes = std::atoi(closed.c_str());
    const int restarts_used = std::atoi(closed.substr(closed.find('|') + 1).c_str());
    if (slot < nnodes) return Membership{slot, nnodes, restarts_used};
    say("the job is running on %d node%s; this node waits to join it "
        "at its next restart%s\n",
        nnodes, nnodes == 1 ? "" : "s",
        nnodes < o.nnodes ? " (asked for now: it runs below --nnodes MAX)" : "");
    said_waiting = true;
    store.add(attempt_key(attempt, "waiting"), 1);
    ++attempt;
  }
}

}  // namespace dtrain::launch::agent
