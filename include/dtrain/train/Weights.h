// Weights in and out of dtrain in the Python world's format: `dtrain ckpt export --format
// safetensors` (a Llama as Hugging Face's transformers names it, with config.json and the
// tokenizer, a folder from_pretrained loads; any other model under dtrain's own names) and
// `dtrain train --init-from` a safetensors file or folder, at any tensor-parallel layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/models/Zoo.h"

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

/// Sets `model` (built from `spec`; a tensor-parallel rank keeps its blocks of the full tensors)
/// from safetensors weights: Hugging Face's Llama names for a Llama decoder
/// (the config.json beside them, when there, must agree with the model's flags), else dtrain's
/// names. InputError naming the path and the tensor or field at fault.
void init_from_safetensors(Model& model, const models::ModelSpec& spec, const std::string& path);

}  // namespace dtrain::train
