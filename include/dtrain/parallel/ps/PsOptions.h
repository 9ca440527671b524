// The parameter-server strategies' own options (StrategyOptions::of<...>()): how a worker
// reaches the shards (Downpour and Sandblaster), and each strategy's knobs. Their flags are
// declared beside the strategies (src/parallel/ps/PsStrategies.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::parallel::ps {

/// The shards and how to reach them.
struct PsOptions {
  /// "host:port" of every shard, in shard order (--ps).
  std::vector<std::string> addresses{};
  /// Deadline of every parameter-server RPC.
  int64_t rpc_timeout_ms = 30000;
  /// How long an unreachable shard (restarting?) is retried before it is an error.
  int64_t retry_ms = 60000;
  /// The shards' token ("" = none) and TLS (trusting tls_ca, "" = system roots).
  std::string auth_token{};
  bool tls = false;
  std::string tls_ca{};
};

/// Downpour SGD: fetch fresh parameters every n_fetch steps and push the gradients accumulated
/// over n_push steps (DistBelief's names), both in the background beside compute.
struct DownpourOptions {
  int n_fetch = 1;
  int n_push = 1;
  /// A worker whose parameters are more than this many server versions behind the newest it
  /// knows of (its own unapplied pushes included) waits for a fresh pull (-1 = no cap).
  int64_t max_staleness = -1;
};

/// Sandblaster L-BFGS.
struct SandblasterOptions {
  /// Work units per evaluation of the loss (0 = 10 per worker).
  int64_t work_units = 0;
  /// Backup copies of the units still running near an evaluation's end.
  bool backup_tasks = true;
  /// L-BFGS history pairs.
  int history = 10;
  /// "tapered" (the last units smaller, so an evaluation ends on small ones) or "uniform".
  std::string unit_sizing = "tapered";
};

}  // namespace dtrain::parallel::ps
