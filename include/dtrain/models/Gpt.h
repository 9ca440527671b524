// A GPT-style decoder-only language model: token and learned position embeddings, pre-norm
// blocks (LayerNorm, causal multi-head self-attention, LayerNorm, GeLU MLP, each with a residual
// connection), a final LayerNorm and an output layer (tied to the token embedding or not).
// Described as stages (embedding, each block, head) so ZeRO-3 and the pipeline run it unchanged.
// Input: token ids [B, T] (int64, T <= context); output: logits [B, T, vocab].
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Model.h"

namespace dtrain::models {

struct GptConfig {
  int64_t vocab = 0;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;    ///< model width (a multiple of heads)
  int64_t context = 128;  ///< longest sequence (position embeddings)
  double dropout = 0.0;
  /// The output layer reuses the token embedding's weight (GPT-2's weight tying).
  bool tied_embeddings = false;
  /// Activation checkpointing: "none", "sqrt" or a segment count (over the blocks).
  std::string checkpointing = "none";
  /// With a tensor-parallel group: Megatron's sequence parallelism (LayerNorm, dropout and
  /// residual regions split along the sequence, whose length must then be a multiple of the
  /// group; allreduces become reduce-scatter + allgather). A layout choice: not in to_json.
  bool sequence_parallel = false;
};

/// InputError naming the field for sizes that cannot make a model.
void validate(const GptConfig& config);

/// The model, initialized as GPT-2 (normal(0, 0.02) weights, residual projections scaled by
/// 1/sqrt(2 x layers), zero biases) from the global LibTorch generator. With a
/// `tensor_parallel` group of T > 1 ranks (ProcessGrid::tp()), attention heads, MLP columns
/// and the vocabulary are split over it (nn/tensor/Layers.h): every rank draws the full
/// initialization and keeps its block, so the model equals the serial one built from the same
/// seed; its output is then this rank's block of the logits, and Model::loss / Model::predict
/// are the vocab-parallel cross-entropy and argmax. Dropout draws from the model's own
/// generators (nn/tensor/Random.h), seeded from the global one.
Model make_gpt(const GptConfig& config, comm::CommunicatorPtr tensor_parallel = nullptr);

/// The sizes as JSON (what a checkpoint records), and back (InputError naming a missing or bad
/// field, with `origin`).
std::string to_json(const GptConfig& config);
GptConfig gpt_config_from_json(const std::string& json, const std::string& origin);

/// Parameter count of a config, without building it.
int64_t gpt_parameter_count(const GptConfig& config);

}  // namespace dtrain::models
