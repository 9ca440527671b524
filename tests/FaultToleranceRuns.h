// What the fault-tolerance tests read from a run's metrics file (tests/fault_tolerance*_test.cpp).
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::test {

// The leader's step records: the step at which each number of replicas present began (from
// the first step), and the last step.
struct ReplicaChanges {
  std::vector<std::pair<int64_t, double>> changes;
  int64_t last = 0;
};

inline ReplicaChanges replica_changes(const std::string& metrics) {
  ReplicaChanges out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.at("event") != "step") continue;
    out.last = record.at("step").get<int64_t>();
    const double replicas = record.at("replicas").get<double>();
    if (out.changes.empty() || out.changes.back().second != replicas) {
      out.changes.push_back({out.last, replicas});
    }
  }
  return out;
}

}  // namespace dtrain::test
