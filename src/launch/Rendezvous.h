// How the launchers of one job agree on an attempt's nodes: a fixed count (every node under
// its --node-rank), or elastic (the host closes the attempt once enough nodes joined and the
// last call passed; a node arriving later waits for the next attempt, asking the job to make
// room).
#pragma once

#include <optional>

#include "dtrain/comm/Store.h"
#include "dtrain/launch/Launcher.h"
#include "launch/Agent.h"

namespace dtrain::launch::agent {

// Fixed node count: every node joins the attempt under its --node-rank, or CommError naming
// the missing ones after the timeout.
Membership fixed_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                            int restarts_used);

// Elastic, on the host (node 0): once min_nodes have joined, waits the last call for more (or
// until max have), then closes the attempt at the count it has. Joiners numbered >= that count
// wait for the next attempt.
Membership elastic_host_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                                   int restarts_used);

// Elastic, on any other node: joins the host's current attempt; when that attempt closed
// without it (it is running, or full), asks the running job to make room and joins the next.
// Returns nullopt when the job ended before this node got in (its result is in `ended`).
std::optional<Membership> elastic_join_rendezvous(const LaunchOptions& o, comm::Store& store,
                                                  int& attempt, Outcome& ended);

}  // namespace dtrain::launch::agent
