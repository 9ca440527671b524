// The model registry: reference models (an MLP, logistic regression, small CNNs, a ResNet-style
// CNN, the GPT) built by name, each with the training recipe it gets by default.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/models/Gpt.h"
#include "dtrain/models/Model.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/optim/OptimizerSpec.h"

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

/// How a model trains unless told otherwise: the optimizer, its schedule, the batch per rank
/// and gradient clipping (`dtrain train` applies it to each of these a flag or config key does
/// not set). The image models share the main job's (SGD with momentum, cosine decay); the GPT
/// has configs/fortunes-gpt.toml's (AdamW, clipping).
struct TrainingRecipe {
  optim::OptimizerSpec optimizer;
  optim::ScheduleSpec schedule;
  int64_t batch_size = 64;
  /// 0 = no clipping.
  double max_grad_norm = 0.0;
};

/// The named model's recipe (InputError naming an unknown model).
TrainingRecipe training_recipe(const std::string& model);

}  // namespace dtrain::models
