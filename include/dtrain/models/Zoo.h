// The model registry: reference models (an MLP, logistic regression, small CNNs, a ResNet-style
// CNN, torchvision's ResNet-18/50, the decoder as GPT and Llama) built by name, each with its
// capabilities and the training recipe it gets by default. The CLI, federated learning and the
// job's validation ask it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/common/Flags.h"
#include "dtrain/common/Model.h"
#include "dtrain/common/OwnOptions.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/optim/OptimizerSpec.h"

namespace dtrain::models {

struct ModelSpec {
  /// "mlp", "linear" (logistic regression), "cnn", "resnet", "resnet18", "resnet50", "gpt" or
  /// "llama".
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
  /// A registered model's own hyper-parameters (own.of<ItsOptions>()), set by its flags.
  OwnOptions own{};
  /// Build placeholders for the strategy to draw (Model::deferred), where the builder can (the
  /// decoder's); a builder that cannot builds the model whole.
  bool deferred = false;
  /// The group a mixture of experts' experts are split over (ProcessGrid::ep(); null or one
  /// rank: none). Only the decoder has experts: InputError for the others.
  comm::CommunicatorPtr expert_parallel;
  /// The group each sequence is split over (ProcessGrid::cp(); null or one rank: none). Only
  /// the decoder has a sequence: InputError for the others.
  comm::CommunicatorPtr context_parallel;
};

/// Builds the named model with freshly initialized parameters (uses the global torch RNG),
/// its layers split over `tensor_parallel` (ProcessGrid::tp(); only the GPT model has
/// tensor-parallel layers: InputError for the others when the group has more than one rank).
Model make_model(const ModelSpec& spec, const comm::CommunicatorPtr& tensor_parallel = nullptr);

/// How a model trains unless told otherwise: the optimizer, its schedule, the batch per rank
/// and gradient clipping (`dtrain train` applies it to each of these a flag or config key does
/// not set). The image models share the main job's (SGD with momentum, cosine decay); the GPT
/// has configs/fortunes-gpt.toml's (AdamW, clipping).
struct TrainingRecipe {
  optim::OptimizerSpec optimizer;
  optim::LrScheduleSpec schedule;
  int64_t batch_size = 64;
  /// 0 = no clipping.
  double max_grad_norm = 0.0;
};

/// The named model's recipe (InputError naming an unknown model).
TrainingRecipe training_recipe(const std::string& model);

/// How a run lays a model out over its ranks (the flags of `dtrain train`).
struct ModelLayout {
  int tensor_parallel = 1;
  int pipeline_parallel = 1;
  /// --sequence-parallel.
  bool sequence_parallel = false;
  /// --context-parallel.
  int context_parallel = 1;
};

/// A registered model: how it is built, what it can do, how it trains by default.
struct ModelInfo {
  std::string name;
  /// One line for --help.
  std::string summary;
  /// Builds it (its layers over `tensor_parallel` when it has tensor-parallel layers); the
  /// model describes itself as stages (Model::stages) so zero3 and pipelines can cut it.
  std::function<Model(const ModelSpec& spec, const comm::CommunicatorPtr& tensor_parallel)> build;
  /// Has tensor-parallel layers (--tensor-parallel > 1).
  bool tensor_parallel = false;
  /// Predicts tokens (trains on --dataset text), rather than classifying examples.
  bool language_model = false;
  /// Its whole state is its parameters (no buffers such as BatchNorm's statistics): federated
  /// learning, which averages parameters, can train it.
  bool parameters_only = true;
  TrainingRecipe recipe;
  /// A decoder's architecture on the shape flags (--model llama: llama_preset); nullptr: the
  /// GPT's own (GPT-2's).
  std::function<void(GptConfig& config)> decoder_preset;
  /// InputError naming the flags when the model's own sizes (spec) or the layout do not suit it
  /// (a GPT's heads that --tensor-parallel does not divide); checked before any rank starts.
  /// nullptr: any layout its capabilities allow.
  std::function<void(const ModelSpec& spec, const ModelLayout& layout)> check_layout;
  /// Its hyper-parameters' flags, as groups of ModelSpec's fields (models that read the same
  /// fields list the same group: gpt's and llama's decoder shape). `dtrain train`, `dtrain fl`
  /// and `dtrain plan` declare the groups of their models from here.
  std::vector<FlagGroup<ModelSpec>> flags;
};

/// Declares the flag groups of the registered models for which `keep` holds (each group once,
/// in the registry's order), bound to `spec`'s fields.
void declare_model_flags(FlagSet& flags, ModelSpec& spec,
                         const std::function<bool(const ModelInfo&)>& keep);

/// A language model's decoder: spec.gpt with the registry entry's architecture applied (what
/// it builds, what a checkpoint records for `dtrain generate`).
GptConfig decoder_config(const ModelSpec& spec);

/// Every registered model's name, built-in ones first.
std::vector<std::string> model_names();
/// InputError naming the registered models for an unknown name.
const ModelInfo& model_info(const std::string& name);
/// Adds a model (InputError when the name is taken); for code outside the library, before it
/// is used.
void register_model(ModelInfo info);

}  // namespace dtrain::models
