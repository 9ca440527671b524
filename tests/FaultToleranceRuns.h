// What the fault-tolerance tests share (tests/fault_tolerance*_test.cpp): a failure reported as
// the launcher reports it, weights compared, and a run's metrics file read.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "parallel/ft/ReplicaManager.h"

namespace dtrain::test {

// World rank `rank`'s death, written where its launcher writes it.
inline void report_death(comm::KeyValue& store, int rank) {
  store.set(parallel::ft::dead_key(rank), "1");
  store.add(parallel::ft::kDeathsKey, 1);
}

// Waits until `key` is set (a test's signal between its rank threads).
inline void wait_for_key(comm::KeyValue& store, const std::string& key) {
  while (!store.read(key)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Waits until `ranks` replacement ranks announced themselves (so the step the members make next
// admits them).
inline void wait_for_joins(comm::KeyValue& store, int64_t ranks) {
  while (store.add(parallel::ft::kJoinsKey, 0) < ranks) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The largest element-wise difference between two lists of weights.
inline double max_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

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
