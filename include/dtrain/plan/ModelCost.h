// What `dtrain plan` knows of a model: its layers in order, each with its parameters, the work
// of its forward pass per sample (matrix-product flops, memory-bound bytes, kernels), the
// activations it keeps for backward, and what tensor parallelism does to it. Built for the
// models of the papers the planner is checked against (a GPT-style transformer described by its
// shape, ResNet-50) and for dtrain's own zoo models.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::models {
struct GptConfig;
}

namespace dtrain::plan {

/// One matrix product of a layer's forward, per sample: `rows` x `k` by `k` x `n` (a linear
/// layer applied to `rows` tokens, `k` inputs, `n` outputs), for the profiles that measure
/// rates by shape (Hardware::matmul_table).
struct Gemm {
  double rows = 0, n = 0, k = 0;
  /// What tensor parallelism splits: the outputs (column-parallel: Q, K, V, the MLP's first,
  /// the vocabulary-parallel head), the inner dimension (row-parallel) or nothing.
  enum Split { Whole, Columns, Inner } split = Whole;
  double flops() const { return 2 * rows * n * k; }
};

struct Layer {
  std::string name;
  int64_t parameters = 0;  ///< elements
  /// Per sample, forward: matrix-product flops, and element-wise traffic in activation elements
  /// (each read or written once counts once), and kernels launched.
  double matmul_flops = 0;
  /// The size class of its matrix products (their smaller weight dimension before any TP
  /// split), for profiles that measure rates by size; 0: none.
  double matmul_dim = 0;
  /// Of matmul_flops, the linear layers' products by shape (their flops sum to that part); the
  /// rest (attention's scores and weighted sum, convolutions) runs at the size class's rate.
  std::vector<Gemm> gemms;
  double elementwise_elements = 0;
  double kernels = 0;
  /// Per sample: activation elements kept for backward, and the layer's output (what a pipeline
  /// stage sends, what activation checkpointing keeps).
  double saved_elements = 0;
  double output_elements = 0;
  /// Megatron tensor parallelism: its parameters, matrix products and most activations are
  /// split over the TP group, and its forward all-reduces this many outputs (backward as many).
  bool tensor_parallel = false;
  int tp_allreduces = 0;
  /// Per sample, forward: the matrix-product flops of its column-parallel layers (Q, K, V and
  /// the MLP's first), whose weight-gradient products hide backward's input-gradient
  /// all-reduces under --tp-comm-overlap.
  double column_parallel_flops = 0;
  /// Of its parameters, those every TP rank keeps whole (layer norms, the biases of row-
  /// parallel layers, position embeddings).
  int64_t replicated_parameters = 0;
  /// Of saved_elements, the part tensor parallelism does not split (layer norms, dropout masks,
  /// residuals: Korthikanti et al.'s 10sbh), unless sequence parallelism is on.
  double replicated_saved_elements = 0;
  /// Attention's core (scores, softmax, dropout, weighted values), per sample and split by
  /// tensor parallelism: what it keeps of saved_elements, which selective recomputation drops
  /// (Korthikanti et al.'s 5as/h term), and its forward's matrix-product flops, element-wise
  /// traffic and kernels, which that recomputation runs again in backward. 0: no attention.
  double attention_saved_elements = 0;
  double attention_flops = 0;
  double attention_elements = 0;
  double attention_kernels = 0;
  /// Per sample: of matmul_flops (forward), those the model counts but no kernel computes (a
  /// causal FlashAttention kernel skips the score blocks above the diagonal), and the flops
  /// backward computes beyond twice forward's (FlashAttention computes the scores again).
  double skipped_flops = 0;
  double recomputed_backward_flops = 0;
  /// A transformer block (what a search's deeper interleaving divides evenly).
  bool block = false;
  /// A mixture of experts' block: of `parameters`, the routed experts' (split over the
  /// expert-parallel group, replicated over the tensor-parallel one: dtrain's expert tensor
  /// parallelism of 1), and per sample, forward, the elements each of its two all-to-alls
  /// (dispatch and combine) moves: tokens x top-k x hidden. 0: none.
  int64_t expert_parameters = 0;
  double alltoall_elements = 0;
  /// Attention, per sample: its keys and values (what context parallelism's ring passes
  /// around, or its all-gather gathers), its queries, keys, values and output (what Ulysses'
  /// all-to-alls move), and the flops its core computes (the causal blocks a kernel runs; a
  /// ring step's share of it hides that step's transfer). 0: no attention.
  double kv_elements = 0, qkvo_elements = 0, core_flops = 0;
  /// Set by the planner for a layout with context parallelism (the per-sample figures are then
  /// a rank's share of the sequence): the context group's ranks and method.
  int context_ranks = 1;
  std::string context_method;
};

struct ModelCost {
  std::string name;
  /// The dtrain train flags that build this model ("--model gpt --layers 24 ..."); empty where
  /// dtrain has no such model.
  std::string train_flags;
  std::vector<Layer> layers;
  int64_t tokens_per_sample = 1;  ///< sequence length (1 for images)
  int heads = 0;                  ///< attention heads (TP must divide them); 0 = no constraint
  /// Key/value heads (TP must divide them or be a multiple of them); 0 = heads.
  int kv_heads = 0;
  /// A model dtrain builds (train_flags) whose output projection is the token embedding
  /// (--tied-embeddings): layouts are checked for it as dtrain train checks them (zero3 refuses
  /// it). Models of published runs only are not.
  bool tied_embeddings = false;
  /// A mixture of experts' routed experts per MoE block (--expert-parallel must divide them);
  /// 0: dense.
  int experts = 0;
  int64_t parameters() const;
  /// The flops one sample costs in forward and backward (3x forward's matrix products), the
  /// work MFU is counted against.
  double model_flops_per_sample() const;
};

struct TransformerShape {
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int sequence = 0;
  int vocabulary = 0;
  int ffn = 0;          ///< 0: 4 x hidden
  bool tied = true;     ///< output projection tied to the token embedding (Megatron, GPT-2)
  bool dropout = true;  ///< dropout after embeddings, attention and each residual branch
  /// Attention's scale, causal mask and softmax in one kernel (Megatron's fused softmax), or
  /// written out as three (dtrain's GPT on LibTorch 1.13: scale, masked_fill, softmax).
  bool fused_softmax = true;
  /// Attention's core in one FlashAttention kernel (flash=1): no score tensor is written or
  /// kept, the causal blocks above the diagonal are skipped and backward computes the scores
  /// again. dtrain's GPT on LibTorch 2.x without attention dropout (scaled_dot_product_attention)
  /// and Megatron-Core with Transformer Engine run it.
  bool flash = false;
  /// Today's decoders (Llama's choices): key/value heads for grouped-query attention (0: heads),
  /// a SwiGLU MLP (gate and up projections of width ffn, then down), rotary positions (no
  /// position embedding), RMSNorm, and linear layers and norms without biases.
  int kv_heads = 0;
  bool swiglu = false;
  bool rope = false;
  bool rmsnorm = false;
  bool bias = true;
  /// Each head's width (0: hidden / heads): attention's query and output projections are heads x
  /// head_dim wide; and RMSNorm over each head's queries and keys (Qwen3's --head-dim, --qk-norm).
  int head_dim = 0;
  bool qk_norm = false;
  /// A mixture of experts (dtrain's --moe-* flags): `experts` routed SwiGLU experts of width
  /// `expert_ffn` (0: ffn) in block i when i >= moe_first_dense and (i - moe_first_dense) is a
  /// multiple of moe_every, each token to `top_k` of them, and `shared_experts` seeing every
  /// token; a linear router. 0 experts: dense.
  int experts = 0;
  int top_k = 1;
  int expert_ffn = 0;
  int shared_experts = 0;
  int moe_every = 1;
  int moe_first_dense = 0;
};
/// A GPT-style decoder (Megatron's): token and position embeddings, `layers` pre-norm blocks
/// (attention with Q/K/V and output projections, a GELU MLP), a final norm and the output
/// projection tied to the embedding.
ModelCost transformer(const TransformerShape& shape, const std::string& name = "transformer");

/// A built-in model by name ("resnet50", "gpt" dtrain's fortunes GPT, the papers' transformers
/// "megatron-1t", ...) or a described transformer: "transformer:layers=24,hidden=1024,heads=16,
/// seq=1024,vocab=51200[,ffn=4096,tied=0,dropout=0,fused=0,flash=1]" (dtrain's own GPT is
/// "transformer:...,tied=0,dropout=0,fused=0" on LibTorch 1.13, "...,tied=0,dropout=0,flash=1"
/// on 2.x, unless --tied-embeddings / --dropout). InputError
/// naming the text and the known names otherwise.
ModelCost model_named(const std::string& text);

/// The shape of dtrain's decoder as dtrain train builds it from its model flags (--model gpt or
/// llama: layers, width, heads, kv-heads, ffn-width, context, dropout, tied embeddings, and
/// llama's RMSNorm, rotary positions, SwiGLU and no biases) for a tokenizer of `vocabulary`
/// tokens; `flash`: attention in one fused kernel (LibTorch 2.x, GPUs). The model's
/// train_flags are those flags.
ModelCost decoder(const models::GptConfig& config, const std::string& model, int64_t vocabulary,
                  bool flash);
std::vector<std::string> known_models();

}  // namespace dtrain::plan
