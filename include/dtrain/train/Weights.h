// Weights in and out of dtrain in the Python world's format: `dtrain ckpt export --format
// safetensors` (a Llama as Hugging Face's transformers names it, with config.json and the
// tokenizer, a folder from_pretrained loads; any other model under dtrain's own names) and
// `dtrain train --init-from` a safetensors file or folder, at any tensor-parallel layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/StateShards.h"

namespace dtrain::train {

/// Writes the checkpoint's full model (any strategy, world size, layout) to the folder `output`:
/// a Llama-architecture decoder as model.safetensors under Hugging Face's names, config.json
/// and, when the checkpoint keeps a BPE tokenizer, tokenizer.json; any other model under
/// dtrain's parameter and buffer names. Shards above `max_shard_bytes` (with
/// model.safetensors.index.json). Returns the files written.
std::vector<std::string> export_safetensors(const std::string& checkpoint,
                                            const std::string& output,
                                            int64_t max_shard_bytes = 5LL << 30);

/// A .safetensors file, or a folder holding model.safetensors or model.safetensors.index.json.
bool is_safetensors(const std::string& path);

/// The safetensors weights at `path` for the model built from `spec`, read on demand: Hugging
/// Face's Llama names for a Llama decoder (the config.json beside them, when there, must agree
/// with the model's flags), else dtrain's names. InputError naming the path and the tensor or
/// field at fault.
models::WeightSource open_weights(const models::ModelSpec& spec, const std::string& path);

/// Sets `model` (built from `spec`; a tensor-parallel rank reads its blocks of the full tensors)
/// from the safetensors weights at `path` (open_weights).
void init_from_safetensors(Model& model, const models::ModelSpec& spec, const std::string& path);

/// InputError naming `origin` and the first parameter or buffer of `module` that holds NaN or
/// Inf (how many values, the first one's index), unless every value is finite: weights that
/// would make training diverge steps later are refused where they are loaded
/// (--allow-non-finite-weights loads them anyway).
void check_finite_weights(torch::nn::Module& module, const std::string& origin);
/// The same over a ZeRO-3 rank's shards (their runs of elements: the index is the parameter's).
void check_finite_weights(const std::vector<parallel::PieceRef>& pieces, const std::string& origin);

/// Sets a ZeRO-3 rank's shards (Strategy::parameter_pieces(): runs of elements of `module`'s
/// parameters, whose storage is freed) and `module`'s buffers from `source`, reading only the
/// rows each run lies in: nothing of the full model is read, built or gathered on any rank.
/// Every parameter is checked by name and shape first (InputError naming `origin` and it).
void load_weight_pieces(const std::vector<parallel::PieceRef>& pieces, torch::nn::Module& module,
                        const models::WeightSource& source, const std::string& origin);

}  // namespace dtrain::train
