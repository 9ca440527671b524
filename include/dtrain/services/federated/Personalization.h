// Personalization: after federated training each client fine-tunes the global model on its own
// training examples (all layers, or only the last few) and keeps the result. On non-IID data a
// client's personalized model usually beats the global one on the client's own test examples;
// personalize() measures both, client by client.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"

namespace dtrain::services::federated {

/// Parameter groups of a model (parameters of one module: "layers.0.weight" and
/// "layers.0.bias" are one group), in the model's order.
std::vector<std::vector<std::string>> parameter_groups(const Model& model);

/// Fine-tunes `model` (set to `global`) on `indices` as `plan` says, training only the last
/// `layers` parameter groups (0 = all); the other parameters keep the global values.
ClientUpdate fine_tune(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                       const std::vector<int64_t>& indices, const LocalTraining& plan,
                       int64_t layers, uint64_t seed);

/// `model`'s accuracy on examples `indices` of `data`.
double accuracy_on(Model& model, const data::TensorDataset& data,
                   const std::vector<int64_t>& indices);

struct PersonalizationReport {
  /// Per client (those with local test examples): accuracy of the global and the fine-tuned
  /// model on its own test examples.
  std::vector<double> global_accuracy, personalized_accuracy;
  double mean_global = 0.0, mean_personalized = 0.0;
};

/// Every client fine-tunes `global` on its training examples and both models are tested on its
/// test examples; `threads` clients at a time.
PersonalizationReport personalize(const models::ModelSpec& spec, const at::Tensor& global,
                                  const data::TensorDataset& train,
                                  const std::vector<ClientIndices>& clients,
                                  const LocalTraining& plan, int64_t layers, int threads,
                                  uint64_t seed);

}  // namespace dtrain::services::federated
