// The decoder's weights as Hugging Face's transformers names and lays them out (LlamaForCausalLM:
// model.layers.N.self_attn.q_proj.weight, ...; config.json), both ways: a Llama saved by Python
// tools starts a dtrain run, a dtrain run's weights load into transformers.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "dtrain/models/Gpt.h"
#include "dtrain/nn/SafeTensors.h"

namespace torch::nn {
class Module;
}

namespace dtrain::models {

/// dtrain's parameter names -> the full (unsplit) tensors.
using FullTensors = std::map<std::string, at::Tensor>;

/// The decoder has Llama's architecture (llama_preset's choices): Hugging Face's layout applies.
bool is_llama_architecture(const GptConfig& config);

/// A Llama config.json (transformers 4.x's rope_theta or 5.x's rope_parameters) as the decoder's
/// sizes; InputError naming the field and `origin` for one dtrain's Llama does not have (another
/// model_type, biases, rope scaling, an activation other than silu, a head_dim that is not
/// hidden_size / num_attention_heads). `context` overrides max_position_embeddings when > 0.
GptConfig llama_config_from_hf(const std::string& config_json, const std::string& origin);

/// config.json for a Llama-architecture decoder (InputError for a GPT-2-architecture one).
std::string llama_config_to_hf(const GptConfig& config, const std::string& dtype = "float32");

/// The full tensors under Hugging Face's names: qkv cut into q_proj, k_proj and v_proj, the
/// SwiGLU fc1 into gate_proj and up_proj, lm_head left out when the embedding is tied.
nn::NamedTensors to_hf_llama(const FullTensors& ours, const GptConfig& config);

/// And back, from a safetensors set: every tensor dtrain's model needs, each of the shape the
/// config gives, none left over (InputError naming the tensor and the problem).
FullTensors from_hf_llama(const nn::SafeTensorsSet& weights, const GptConfig& config);

/// Sets a module's parameters and buffers from full tensors: a tensor-parallel rank takes its
/// block (nn/tensor's splits); every one must be given with its full shape (InputError naming
/// it); extra tensors are refused too.
void load_full_tensors(torch::nn::Module& module, const FullTensors& full,
                       const std::string& origin);

}  // namespace dtrain::models
