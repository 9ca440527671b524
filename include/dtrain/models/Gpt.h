// The decoder-only language model, as Megatron's GPTModel: GPT-2's architecture by default (token
// and learned position embeddings, pre-norm blocks of LayerNorm, causal multi-head
// self-attention, LayerNorm and a GeLU MLP, each with a residual connection, a final LayerNorm
// and an output layer tied to the token embedding or not), and Llama's with its choices
// (RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention, no biases:
// `--model llama`, llama_preset). Described as stages (embedding, each block, head) so ZeRO-3
// and the pipeline run it unchanged. Input: token ids [B, T] (int64, T <= context); output:
// logits [B, T, vocab].
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
  int64_t width = 256;    ///< model width (a multiple of heads unless head_dim is given)
  int64_t context = 128;  ///< longest sequence (position embeddings)
  double dropout = 0.0;
  /// Key/value heads (grouped-query attention: each serves heads / kv_heads query heads;
  /// 0 = heads, plain multi-head attention).
  int64_t kv_heads = 0;
  /// Each attention head's width (0: width / heads). Another width makes the query and
  /// output projections heads x head_dim wide (Qwen3's, Gemma's head_dim).
  int64_t head_dim = 0;
  /// RMSNorm over each head's queries and keys before the rotary embeddings, one weight of
  /// head_dim shared by the heads (Qwen3's q_norm and k_norm).
  bool qk_norm = false;
  /// The MLP's hidden width (0: 4 x width for gelu; for swiglu Llama's 8/3 x width, rounded up
  /// to a multiple of 64).
  int64_t ffn_width = 0;
  /// The architecture: "layernorm" or "rmsnorm"; "learned" position embeddings or "rope"
  /// (rotary, on each head's halves as Hugging Face's Llama); a "gelu" or "swiglu" MLP; biases
  /// in the linear layers and LayerNorms or none.
  std::string norm = "layernorm";
  double norm_eps = 1e-5;
  std::string position = "learned";
  double rope_theta = 10000.0;
  std::string mlp = "gelu";
  bool bias = true;
  /// The output layer reuses the token embedding's weight (GPT-2's weight tying).
  bool tied_embeddings = false;
  /// Activation checkpointing: "none", "sqrt" or a segment count (over the blocks), or
  /// "selective": only attention's core (scores, softmax, dropout, weighted values) is
  /// recomputed, from its queries, keys and values (Korthikanti et al. 2022, Megatron's
  /// --recompute-granularity selective).
  std::string checkpointing = "none";
  /// With a tensor-parallel group: Megatron's sequence parallelism (LayerNorm, dropout and
  /// residual regions split along the sequence, whose length must then be a multiple of the
  /// group; allreduces become reduce-scatter + allgather). A layout choice: not in to_json.
  bool sequence_parallel = false;
  /// With a tensor-parallel group: the column-parallel layers' backward overlaps the input
  /// gradient's allreduce (reduce-scatter with sequence parallelism) with the weight gradient
  /// (Megatron's asynchronous TP communication). A layout choice: not in to_json.
  bool tp_comm_overlap = false;
  /// With a context-parallel group (issue 82): how attention spans the sequence split over it,
  /// "ring" (keys and values passed around the group), "allgather" or "ulysses"
  /// (nn/context/Attention.h); and the split: the zigzag (each rank two mirrored chunks, the
  /// same causal work everywhere) or contiguous chunks. Layout choices: not in to_json.
  std::string cp_method = "ring";
  bool cp_zigzag = true;
  /// Packed sequences (>= 0): the end-of-document token; attention stays inside each document
  /// and positions restart after each end (Megatron's --reset-attention-mask and
  /// --reset-position-ids; nn/context/Attention.h's document_index). -1: a sequence is one
  /// text. A choice of how the data is read: not in to_json.
  int64_t document_end = -1;
  /// Mixture of experts (nn/Moe.h, issue 81): 0 = every block's MLP dense. With E > 0 (SwiGLU
  /// only), block i is an MoE block when i >= moe_first_dense and (i - moe_first_dense) is a
  /// multiple of moe_every (DeepSeek's layout: the first blocks dense).
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;
  int64_t moe_shared_experts = 0;
  int64_t moe_every = 1;
  int64_t moe_first_dense = 0;
  double moe_capacity = 0.0;          ///< 0: dropless
  std::string moe_score = "softmax";  ///< or "sigmoid" (DeepSeek-V3)
  /// The top k's scores divided by their sum (Mixtral, DeepSeek-V3; Qwen3-MoE's
  /// norm_topk_prob), or taken as they are (Qwen1.5-MoE).
  bool moe_normalize = true;
  int64_t moe_ffn_width = 0;          ///< each expert's hidden width (0: the dense MLP's)
  /// Coefficients of the Switch/GShard auxiliary loss and the router z-loss, summed over the MoE
  /// blocks and added to the training loss (Model::loss).
  double moe_aux_loss = 0.01;
  double moe_z_loss = 0.0;
};

/// Whether block `index` of `config` is a mixture of experts.
bool is_moe_block(const GptConfig& config, int64_t index);

/// InputError naming the field for sizes that cannot make a model.
void validate(const GptConfig& config);

/// InputError naming the flags when `config` cannot be split over `context_parallel` ranks
/// (each holding `tensor_parallel` ranks' heads): a --context that C (2C for the zigzag) does
/// not divide, Ulysses' heads, dropout, balance losses, an unknown --cp-method.
void check_context_parallel(const GptConfig& config, int context_parallel, int tensor_parallel);

/// Llama's choices on `config`'s sizes: RMSNorm, rotary embeddings, SwiGLU, no biases.
void llama_preset(GptConfig& config);

/// The key/value heads, the head width and the MLP width with their defaults resolved.
int64_t kv_heads_of(const GptConfig& config);
int64_t head_dim_of(const GptConfig& config);
int64_t ffn_width_of(const GptConfig& config);
/// Each routed expert's hidden width: --moe-ffn-width, else the dense MLP's.
int64_t expert_ffn_width_of(const GptConfig& config);

/// The model, initialized as GPT-2 (normal(0, 0.02) weights, residual projections scaled by
/// 1/sqrt(2 x layers), zero biases) from the global LibTorch generator. With as many key/value
/// heads as query heads, the query, key and value projections are one layer ("qkv") whose output
/// features are ordered [head, (query, key, value), head dim]; with fewer (grouped-query
/// attention) they are three ("q", "k", "v"). A SwiGLU MLP's first layer ("fc1") interleaves
/// the gate's and the up projection's rows (gate 0, up 0, gate 1, ...), so that contiguous
/// blocks are whole heads and matching pairs. With a `tensor_parallel` group of T > 1 ranks
/// (ProcessGrid::tp()), attention heads (T must divide the query heads, and divide or be a
/// multiple of the key/value heads: then T / KV ranks share each key/value head, their
/// gradients summed by the strategies), MLP columns
/// and the vocabulary are split over it (nn/tensor/Layers.h); its output is then this rank's
/// block of the logits, and Model::loss / Model::predict are the vocab-parallel cross-entropy and
/// argmax. Each parameter's initial values are drawn from a seed taken from the global generator
/// and its name (nn/DeferredInit.h), each rank drawing only its block, so the model equals the
/// serial one built from the same seed. `deferred`: the parameters are placeholders without
/// memory and Model::deferred draws them, for a strategy that keeps only part of each (zero3).
/// Dropout draws from the model's own generators (nn/tensor/Random.h), seeded from the global one.
/// `expert_parallel` (ProcessGrid::ep()): the MoE blocks' experts split over it (nn/Moe.h).
/// `context_parallel` (ProcessGrid::cp()) of C > 1 ranks: every rank takes the whole
/// sequence's token ids [B, T] and keeps its share of the positions (config.cp_zigzag: T a
/// multiple of 2C, else of C), its attention spanning the whole sequence by config.cp_method;
/// the output is the logits of its positions [B, T / C, V], Model::loss takes the whole
/// targets [B, T] (and picks its positions'), Model::predict returns the whole sequence's
/// predictions (gathered from the group).
Model make_gpt(const GptConfig& config, comm::CommunicatorPtr tensor_parallel = nullptr,
               bool deferred = false, comm::CommunicatorPtr expert_parallel = nullptr,
               comm::CommunicatorPtr context_parallel = nullptr);

/// The sizes as JSON (what a checkpoint records), and back (InputError naming a missing or bad
/// field, with `origin`).
std::string to_json(const GptConfig& config);
GptConfig gpt_config_from_json(const std::string& json, const std::string& origin);

/// Parameter count of a config, without building it.
int64_t gpt_parameter_count(const GptConfig& config);
/// The parameters one token uses: all of them, less each MoE block's routed experts beyond its
/// top-k (the figure published as a mixture of experts' "active" parameters).
int64_t gpt_active_parameter_count(const GptConfig& config);

/// Training FLOPs per token of a config at its full context (forward and backward, as
/// Megatron-LM, PaLM and torchtitan count them for MFU): 6 per weight of every matrix multiply
/// (the blocks' projections and the output head; not the embeddings, norms or biases) plus 12
/// x layers x heads x head width x context for attention's two products.
double gpt_training_flops_per_token(const GptConfig& config);

}  // namespace dtrain::models
