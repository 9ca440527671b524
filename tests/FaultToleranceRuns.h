// What the fault-tolerance tests share (tests/fault_tolerance*_test.cpp): their float64 data and
// model, a failure reported as the launcher reports it, weights compared, and a run's metrics
// file read.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "SmallModels.h"
#include "dtrain/comm/Communicator.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategy.h"
#include "parallel/ft/ReplicaManager.h"

namespace dtrain::test {

// Rank r's batch at step t: its own `batch` rows of one synthetic float64 data set (16
// features, 4 classes) for `ranks` ranks and `steps` steps.
struct RankRows {
  at::Tensor inputs, targets;
  int ranks = 1;
  int64_t rows = 1;
  RankRows(int steps, int ranks_, int64_t batch, uint64_t seed) : ranks(ranks_), rows(batch) {
    at::Generator generator = at::detail::createCPUGenerator(seed);
    inputs = at::randn({steps * ranks * rows, 16}, generator, at::kDouble);
    targets = at::randint(4, {steps * ranks * rows}, generator, at::kLong);
  }
  data::Batch batch(int step, int rank) const {
    const int64_t begin = (static_cast<int64_t>(step) * ranks + rank) * rows;
    return {inputs.narrow(0, begin, rows), targets.narrow(0, begin, rows)};
  }
};

// One process trained `steps` steps with `spec` on the rows of the ranks present at each step
// (`present(step, rank)`; RankRows' ranks): the oracle of a fault-tolerant run in which some
// replicas' rows are missing for a while. Its loss at each step in `losses` when given.
inline std::vector<at::Tensor> one_process_on_present_rows(
    const RankRows& data, int steps, const optim::OptimizerSpec& spec,
    const std::function<bool(int, int)>& present, std::vector<double>* losses = nullptr);

// The tests' float64 MLP 16-32-4 (`hidden_layers` hidden layers of 32: a pipeline's stages are
// hidden_layers + 1), its initial weights from `seed` (rank threads call it together: the global
// generator is taken under a lock).
inline Model double_mlp(int seed = 5, int hidden_layers = 1) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(seed);
  models::ModelSpec spec = small_mlp(16, 32, 4);
  spec.hidden.assign(hidden_layers, 32);
  Model model = models::make_model(spec);
  model.module->to(at::kDouble);
  return model;
}

inline std::vector<at::Tensor> one_process_on_present_rows(
    const RankRows& data, int steps, const optim::OptimizerSpec& spec,
    const std::function<bool(int, int)>& present, std::vector<double>* losses) {
  Model model = double_mlp();
  auto optimizer = optim::make_optimizer(model.module->parameters(), spec);
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> inputs, targets;
    for (int r = 0; r < data.ranks; ++r) {
      if (!present(step, r)) continue;
      inputs.push_back(data.batch(step, r).inputs);
      targets.push_back(data.batch(step, r).targets);
    }
    optimizer->zero_grad();
    const at::Tensor loss = at::cross_entropy_loss(model(at::cat(inputs)), at::cat(targets));
    loss.backward();
    optimizer->step();
    if (losses) losses->push_back(loss.item<double>());
  }
  std::vector<at::Tensor> weights;
  for (const auto& p : model.module->parameters()) weights.push_back(p.detach().clone());
  return weights;
}

// SGD with momentum (its buffers are part of the state a replacement receives): Adam over a few
// steps turns the last-bit differences of near-zero gradients (TP sums them in another order)
// into 1e-7 (its update is g / (sqrt(v) + eps)), beyond any tight bound.
inline optim::OptimizerSpec momentum_sgd() {
  optim::OptimizerSpec spec;
  spec.lr = 0.1;
  spec.momentum = 0.9;
  return spec;
}

// The model's parameters as the strategy ends with them (materialized), copied.
inline std::vector<at::Tensor> values_of(parallel::Strategy& strategy) {
  strategy.materialize();
  std::vector<at::Tensor> out;
  for (const auto& p : strategy.model().module->parameters()) out.push_back(p.detach().clone());
  return out;
}

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

// The largest difference between `expected` and the weights of any of `ranks` (indexed by rank).
inline double worst_of(const std::vector<std::vector<at::Tensor>>& weights,
                       const std::vector<at::Tensor>& expected, const std::vector<int>& ranks) {
  double worst = 0;
  for (const int r : ranks) worst = std::max(worst, max_difference(weights[r], expected));
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

// A run's metrics in which `replicas` replicas trained up to step `failed`, one fewer from the
// next step, and `replicas` again to the last step, `steps`.
inline void expect_one_replica_out_and_back(const std::string& metrics, int64_t steps,
                                            double replicas, int64_t failed,
                                            const std::string& text) {
  const auto [changes, last] = replica_changes(metrics);
  EXPECT_EQ(last, steps);
  ASSERT_EQ(changes.size(), 3u) << text;
  EXPECT_EQ(changes[0], (std::pair<int64_t, double>{1, replicas}));
  EXPECT_EQ(changes[1], (std::pair<int64_t, double>{failed + 1, replicas - 1}));
  EXPECT_EQ(changes[2].second, replicas);
}

// A launcher's run of 2 replicas of 2 ranks (world ranks 2, 3 the second) in which one of the
// second's ranks failed at step 12: the launcher ended rank 2 with it, the first replica went
// on alone from step 13, the second's two ranks joined again with the first's state at each
// position, and the job ended at `steps` with two replicas. `text`: the launcher's output.
inline void expect_second_replica_replaced(const std::string& text, const std::string& metrics,
                                           int64_t steps) {
  for (const char* line : {"ending rank 2 (pid", "replica group: world rank(s) 2,3 left at step 13",
                           "replica group: world rank(s) 2,3 joined after step",
                           "from world rank 0 in", "from world rank 1 in"}) {
    EXPECT_NE(text.find(line), std::string::npos) << "no '" << line << "' in:\n" << text;
  }
  expect_one_replica_out_and_back(metrics, steps, 2.0, 12, text);
}

}  // namespace dtrain::test
