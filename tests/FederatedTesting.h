// What the federated tests share: float64 data and models small enough for exact
// comparisons, and the bound those comparisons hold to.
#pragma once

#include <torch/torch.h>

#include <numeric>
#include <string>
#include <vector>

#include "SmallModels.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"
#include "dtrain/services/federated/simulation/Simulation.h"

namespace dtrain::services::federated::testing {

constexpr double kTightBound = 1e-12;

// 10 classes of `per_class` examples each, labels in a shuffled order.
inline at::Tensor balanced_labels(int64_t per_class) {
  at::Tensor labels = at::arange(10, at::kLong).repeat_interleave(per_class);
  return labels.index_select(0, at::randperm(labels.numel(), at::detail::createCPUGenerator(5)));
}

inline double mean_classes(const at::Tensor& labels, const std::vector<ClientIndices>& parts) {
  double sum = 0;
  for (const auto& p : parts) {
    std::vector<int64_t> all = p.train;
    all.insert(all.end(), p.test.begin(), p.test.end());
    sum += static_cast<double>(classes_among(labels, all));
  }
  return sum / static_cast<double>(parts.size());
}

inline models::ModelSpec mlp_spec() { return test::small_mlp(12, 16, 4); }

// A quiet, deterministic simulation of `algorithm`: one client thread (the updates summed in
// one order), every client each round, no local test split, evaluated only at the end.
inline SimulationOptions one_thread_run(const std::string& algorithm) {
  SimulationOptions o;
  o.round.aggregator.algorithm = algorithm;
  o.threads = 1;
  o.progress = false;
  o.local_test_fraction = 0.0;
  o.fraction = 1.0;
  o.eval_every = 1000;
  return o;
}

inline data::TensorDataset synthetic64(int64_t n, uint64_t seed) {
  const auto d = data::make_synthetic(n, {12}, 4, seed);
  return data::TensorDataset(d.raw_inputs().to(at::kDouble), d.targets());
}

inline Model model64(uint64_t seed) {
  torch::manual_seed(seed);
  Model model = models::make_model(mlp_spec());
  model.module->to(at::kDouble);
  return model;
}

// Full-batch gradient descent on examples `indices` from `start`, `steps` steps.
inline at::Tensor gradient_descent(const data::TensorDataset& data,
                                   const std::vector<int64_t>& indices, const at::Tensor& start,
                                   double lr, int steps) {
  Model model = model64(0);
  load_flat_parameters(model, start);
  auto params = model.module->parameters();
  const data::Batch b = data.get(indices);
  for (int s = 0; s < steps; ++s) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    parallel::cross_entropy(model(b.inputs), b.targets).backward();
    torch::NoGradGuard no_grad;
    for (auto& p : params) p.add_(p.grad(), -lr);
  }
  return flatten_parameters(model);
}

inline std::vector<int64_t> range(int64_t begin, int64_t end) {
  std::vector<int64_t> out(end - begin);
  std::iota(out.begin(), out.end(), begin);
  return out;
}

}  // namespace dtrain::services::federated::testing
