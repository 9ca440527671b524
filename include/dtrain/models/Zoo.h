// Reference models: an MLP, a small CNN and a ResNet-style CNN, built by name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/models/Gpt.h"
#include "dtrain/models/Model.h"

namespace dtrain::models {

struct ModelSpec {
  /// "mlp", "linear" (logistic regression), "cnn", "resnet" or "gpt".
  std::string name = "cnn";
  /// One example's shape, e.g. {1, 28, 28}.
  std::vector<int64_t> input_shape{1, 28, 28};
  int64_t classes = 10;
  /// MLP hidden widths.
  std::vector<int64_t> hidden{256, 256};
  /// Activation checkpointing: "none", "sqrt" (round(sqrt(layers)) segments) or a segment count.
  std::string checkpointing = "none";
  /// The GPT model's sizes (its vocabulary from the data; checkpointing from above).
  GptConfig gpt;
};

/// Builds the named model with freshly initialized parameters (uses the global torch RNG),
/// its layers split over `tensor_parallel` (ProcessGrid::tp(); only the GPT model has
/// tensor-parallel layers: InputError for the others when the group has more than one rank).
Model make_model(const ModelSpec& spec, const comm::CommunicatorPtr& tensor_parallel = nullptr);

/// Names make_model accepts.
std::vector<std::string> model_names();

}  // namespace dtrain::models
