// --fault-tolerance: what a rank's failure costs the job (StrategyOptions::of<>()).
#pragma once

#include <string>

namespace dtrain::parallel::ft {

struct FaultToleranceOptions {
  /// "none": a failure stops every rank (the launcher restarts them from the newest checkpoint
  /// with --max-restarts). "replicas": data-parallel replicas outlive a member; the others go
  /// on without it at once (parallel/ft/ReplicaManager.h).
  std::string mode = "none";
  bool replicas() const { return mode == "replicas"; }
};

}  // namespace dtrain::parallel::ft
