// `dtrain train --strategy downpour|sandblaster --ps-shards N`: the parameter-server shards run
// in the launching process, on free local ports, configured from the job (Downpour's shards
// apply the updates with --ps-optimizer at --ps-lr and the job's schedule counted in versions;
// Sandblaster's apply none, L-BFGS stepping through vector commands).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/services/ps/ShardServer.h"
#include "dtrain/train/Job.h"

namespace dtrain::services::ps {

struct LocalShards {
  std::vector<std::unique_ptr<ShardServer>> servers;
  /// "HOST:PORT,...": what the ranks take as --ps.
  std::string addresses;
};

/// Starts job.ps_shards shards when the job's strategy trains against a parameter server (none
/// otherwise), records their addresses in the job's PsOptions and sets job.ps_shards to 0 (the
/// ranks connect to them instead of starting more). Prints one line saying what runs where.
LocalShards start_local_shards(train::JobConfig& job);

}  // namespace dtrain::services::ps
