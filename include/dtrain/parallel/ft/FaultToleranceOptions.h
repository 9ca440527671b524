// --fault-tolerance: what a rank's failure costs the job (StrategyOptions::of<>()).
#pragma once

#include <string>

namespace dtrain::parallel::ft {

struct FaultToleranceOptions {
  /// "none": a failure stops every rank (the launcher restarts them from the newest checkpoint
  /// with --max-restarts). "replicas": data-parallel replicas outlive a member; the others go
  /// on without it at once (parallel/ft/ReplicaManager.h).
  std::string mode = "none";
  /// replicas under `dtrain train --nproc`: a failed replica's process is started again up to
  /// this many times; it joins the others at a step's end, its state sent by one of them.
  /// (`dtrain launch` takes --max-replacements itself.)
  int max_replacements = 10;
  /// replicas (--replica-heartbeat-timeout): a member whose heartbeat (every tenth of this, at
  /// most 100 ms) stays silent this long is counted as dead (a hung process, a stopped machine):
  /// shorter finds a hang sooner, too short counts a slow but live replica out.
  double heartbeat_timeout_s = 2.0;
  /// replicas with zero1/zero2 (--replica-shards S): each replica is S data-parallel ranks (x
  /// --tensor-parallel) that shard its optimizer state (and zero2 its gradients) among
  /// themselves, the replicas holding copies of it (hybrid sharding, torchft's HSDP); a rank that
  /// fails takes its replica out. 1: each data-parallel rank is a replica.
  int replica_shards = 1;
  /// replicas with zero1 (--shard-across-replicas): the optimizer state is sharded over all the
  /// replicas (one rank each), and each shard is also kept by the next replica (its buddy,
  /// Gemini's in-memory copy): 2/N of the state per rank. A failed replica's shard is taken over
  /// by its buddy; a replacement takes its shard and its buddy copy from the replicas holding
  /// them. Two neighbours failing before a replacement joins lose a shard: the job stops.
  bool shard_across_replicas = false;
  /// This process replaces a failed replica (set from DTRAIN_FT_REPLACEMENT, which its launcher
  /// sets): setup waits to be admitted and takes the state from a replica that trains.
  bool replacement = false;
  bool replicas() const { return mode == "replicas"; }
};

}  // namespace dtrain::parallel::ft
