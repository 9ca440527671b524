// The hardware profiles of configs/hardware as the planner's clusters, for its tests.
#pragma once

#include <string>
#include <vector>

#include "dtrain/plan/Planner.h"

namespace dtrain::plan::test {

inline std::vector<std::string> profiles() { return {DTRAIN_SOURCE_DIR "/configs/hardware"}; }

/// `nodes` of `profile`'s machine (`per_node` GPUs each; 0: the profile's).
inline Cluster cluster_of(const std::string& profile, int nodes, int per_node = 0) {
  Cluster cluster;
  cluster.hardware = load_hardware(profile, profiles());
  cluster.nodes = nodes;
  cluster.gpus_per_node = per_node;
  return cluster;
}

}  // namespace dtrain::plan::test
