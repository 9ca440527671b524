// The decoder's weights as Hugging Face's transformers names and lays them out (LlamaForCausalLM:
// model.layers.N.self_attn.q_proj.weight, ...; config.json), both ways: a Llama saved by Python
// tools starts a dtrain run, a dtrain run's weights load into transformers. A mixture of experts
// is Mixtral's (MixtralForCausalLM: model.layers.N.block_sparse_moe.gate.weight, the experts one
// by one as experts.J.w1 (gate), w3 (up) and w2 (down), as the Hub's checkpoints and
// transformers' save_pretrained write them; transformers 5's stacked experts.gate_up_proj and
// experts.down_proj are read too). A decoder with per-head query/key norms (qk_norm) is Qwen3's
// (Qwen3ForCausalLM: self_attn.q_norm.weight, k_norm.weight; its head_dim free), and its mixture
// of experts Qwen3-MoE's (Qwen3MoeForCausalLM: mlp.gate.weight, mlp.experts.J.gate_proj, up_proj
// and down_proj, the dense blocks listed in mlp_only_layers).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/models/Gpt.h"
#include "dtrain/nn/SafeTensors.h"

namespace torch::nn {
class Module;
}

namespace dtrain::models {

/// dtrain's parameter names -> the full (unsplit) tensors.
using FullTensors = std::map<std::string, at::Tensor>;

/// The decoder has Llama's architecture (llama_preset's choices).
bool is_llama_architecture(const GptConfig& config);

/// Hugging Face's layout holds the decoder: Llama's architecture, and a mixture of experts (if
/// any) that Mixtral's names hold (every block routed, softmax scores normalized over the top k,
/// no shared experts) or, with qk_norm, Qwen3-MoE's (softmax scores, no shared experts). Else why
/// not, in `why` when given.
bool has_hugging_face_layout(const GptConfig& config, std::string* why = nullptr);

/// A Llama, Mixtral, Qwen3 or Qwen3-MoE config.json (transformers 4.x's rope_theta or 5.x's
/// rope_parameters) as the decoder's sizes; InputError naming the field and `origin` for one
/// dtrain's Llama does not have (another model_type, biases, rope scaling, an activation other
/// than silu, a sliding window shorter than the context, Qwen3-MoE's mlp_only_layers other than
/// dense first blocks and a period).
GptConfig llama_config_from_hf(const std::string& config_json, const std::string& origin);

/// config.json for a decoder in Hugging Face's layout (LlamaForCausalLM, MixtralForCausalLM for
/// a mixture of experts; with qk_norm Qwen3ForCausalLM, Qwen3MoeForCausalLM; InputError for
/// another).
/// `eos_token_id` >= 0: also bos_token_id and eos_token_id (the tokenizer's end-of-text token).
std::string llama_config_to_hf(const GptConfig& config, const std::string& dtype = "float32",
                               int64_t eos_token_id = -1);

/// The full tensors under Hugging Face's names: qkv cut into q_proj, k_proj and v_proj, the
/// SwiGLU fc1 into gate_proj and up_proj, the stacked experts into Mixtral's (Qwen3-MoE's) one by
/// one, lm_head left out when the embedding is tied. InputError for a routing bias that is not zero
/// (--moe-bias-rate's): Mixtral's layout has no place for it, and without it the routing differs.
nn::NamedTensors to_hf_llama(const FullTensors& ours, const GptConfig& config);

/// A model's full tensors under dtrain's names, read from safetensors on demand, a range of
/// rows at a time: a tensor-parallel rank reads its block, a ZeRO-3 rank its shard, not the file.
class WeightSource {
 public:
  /// Reads `count` rows of a file's tensor from `first` (counting the bytes read).
  using Read = std::function<at::Tensor(const std::string& part, int64_t first, int64_t count)>;

  /// dtrain's names as they are in the file (`dtrain ckpt export` of a non-Llama model,
  /// torchvision's ResNets).
  static WeightSource direct(std::shared_ptr<const nn::SafeTensorsSet> weights);
  /// Hugging Face's Llama (or Mixtral) layout for `config`: every tensor the model needs, of the
  /// shape the config gives, none left over (InputError naming the tensor and the problem;
  /// checked from the headers, before anything is read). An expert-parallel rank's rows of the
  /// stacked experts are its experts: it reads only theirs.
  static WeightSource hf_llama(std::shared_ptr<const nn::SafeTensorsSet> weights,
                               const GptConfig& config);
  /// Tensors already in memory (a torchvision state dict in a test).
  static WeightSource in_memory(const FullTensors& tensors);

  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  const std::vector<int64_t>& shape(const std::string& name) const;
  /// Rows [begin, end) of dimension 0 (elements of a 1-D tensor), in the file's dtype.
  at::Tensor rows(const std::string& name, int64_t begin, int64_t end) const;
  /// The whole tensor (a 0-d one too).
  at::Tensor full(const std::string& name) const;
  /// Bytes of tensor data read so far.
  int64_t bytes_read() const { return *bytes_read_; }
  const std::string& origin() const;

 private:
  // The tensor is `parts` in the file, their rows interleaved `block` at a time (part 0's
  // first block, part 1's, ..., part 0's second block); one part: the file's tensor as it is;
  // `compose` set: rows [begin, end) as it makes them (stacked experts).
  struct Entry {
    Entry() = default;
    Entry(std::vector<int64_t> shape_, std::vector<std::string> parts_, int64_t block_ = 1,
          at::Tensor tensor_ = {})
        : shape(std::move(shape_)),
          parts(std::move(parts_)),
          block(block_),
          tensor(std::move(tensor_)) {}
    std::vector<int64_t> shape;
    std::vector<std::string> parts;
    int64_t block = 1;
    at::Tensor tensor;  // in_memory's
    std::function<at::Tensor(const Read& read, int64_t begin, int64_t end)> compose;
  };
  std::shared_ptr<const nn::SafeTensorsSet> weights_;
  std::map<std::string, Entry> entries_;
  std::shared_ptr<int64_t> bytes_read_ = std::make_shared<int64_t>(0);
};

/// And back, from a safetensors set: every tensor dtrain's model needs, each of the shape the
/// config gives, none left over (InputError naming the tensor and the problem).
FullTensors from_hf_llama(const nn::SafeTensorsSet& weights, const GptConfig& config);

/// Sets a module's parameters and buffers from a source, each rank reading the block of each it
/// holds (nn/tensor's splits): InputError naming a tensor missing, misshapen or left over.
/// `origin` starts the messages. Placeholders (nn/DeferredInit.h) are checked, not read: a
/// model built later takes them through weights_source().
void load_weights(torch::nn::Module& module, const WeightSource& source, const std::string& origin);

/// One parameter's local values (its tensor-parallel block) from `source`, for
/// nn::DeferredInit::set_source: the parameters a pipeline rank builds come from the file.
std::function<void(const std::string& name, at::Tensor out)> weights_source(
    const torch::nn::Module& module, WeightSource source, std::string origin);

/// Sets a module's parameters and buffers from full tensors: a tensor-parallel rank takes its
/// block (nn/tensor's splits); every one must be given with its full shape (InputError naming
/// it); extra tensors are refused too.
void load_full_tensors(torch::nn::Module& module, const FullTensors& full,
                       const std::string& origin);

}  // namespace dtrain::models
