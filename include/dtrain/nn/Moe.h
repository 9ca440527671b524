// A mixture-of-experts layer (issue 81), as DeepSeek-V3, Mixtral and Qwen3-MoE build theirs: a
// linear router scores each token against every expert (softmax, or sigmoid as DeepSeek-V3),
// each token goes to its top-k experts, the chosen scores (normalized to sum to one where asked)
// weight the experts' SwiGLU outputs, and optional shared experts see every token.
//
// Routing is dropless by default: tokens are sorted by expert (stable, so each expert sees its
// tokens in token order) and each expert computes its tokens as one product, with no padding.
// With a capacity factor f, an expert takes at most ceil(f x tokens x k / E) of its assignments,
// the first in token order; the rest are dropped (they add nothing) and counted.
//
// Balance: the Switch/GShard auxiliary loss and ST-MoE's router z-loss are computed every forward
// (stats(), differentiable; the caller adds them to its loss with its own coefficients), and
// DeepSeek-V3's auxiliary-loss-free bias shifts only the choice of experts, never their weights:
// update_bias() moves it after a step from the loads the step saw (not in forward: activation
// checkpointing recomputes forward and must route the same tokens the same way).
//
// The experts' weights are stacked ([E, ...]) so that expert parallelism can split them along
// their first dimension. Built inside an nn::InitScope (its parameters are placeholders drawn by
// name, nn/DeferredInit.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::nn {

struct MoeOptions {
  int64_t width = 0;
  /// Each routed expert's SwiGLU hidden width; the shared experts' is shared_experts x this.
  int64_t ffn_width = 0;
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t shared_experts = 0;
  /// "softmax" over the experts (Mixtral, Qwen3-MoE, Switch) or "sigmoid" of each (DeepSeek-V3).
  std::string score = "softmax";
  /// The chosen scores divided by their sum (Mixtral, DeepSeek-V3; Qwen3-MoE's norm_topk_prob).
  bool normalize = true;
  /// 0: dropless. Else each expert's capacity is ceil(capacity_factor x tokens x top_k / experts).
  double capacity_factor = 0.0;
  /// Standard deviation of the router's and experts' initial weights (normal, mean 0).
  double init_std = 0.02;
};

/// What the last forward routed.
struct MoeStats {
  /// Switch/GShard: experts x sum_e f_e x P_e, f_e the share of the assignments that chose e and
  /// P_e the mean over tokens of e's score (normalized per token for sigmoid scores). 1 when
  /// perfectly balanced. Differentiable through P.
  at::Tensor aux_loss;
  /// ST-MoE's router z-loss: the mean over tokens of logsumexp(router logits)^2.
  at::Tensor z_loss;
  /// Assignments per expert, before any was dropped (tokens x top_k in all).
  std::vector<int64_t> load;
  /// Assignments dropped by the capacity (0 when dropless).
  int64_t dropped = 0;
  int64_t tokens = 0;
  /// max / mean of load (1 = balanced).
  double imbalance() const;
};

class MoeImpl : public torch::nn::Module {
 public:
  explicit MoeImpl(MoeOptions options);
  /// [..., width] -> [..., width].
  at::Tensor forward(const at::Tensor& input);
  const MoeStats& stats() const { return stats_; }
  /// DeepSeek-V3's auxiliary-loss-free balancing: bias_e += rate x sign(mean load - load_e), from
  /// `load` (per expert: the last forward's, or a step's summed over micro-batches and ranks).
  void update_bias(const std::vector<int64_t>& load, double rate);

  MoeOptions options;
  at::Tensor router;       ///< [E, width]
  at::Tensor gate, up;     ///< [E, ffn, width]
  at::Tensor down;         ///< [E, width, ffn]
  at::Tensor shared_gate;  ///< [S x ffn, width] (S = shared_experts > 0; else undefined)
  at::Tensor shared_up;    ///< [S x ffn, width]
  at::Tensor shared_down;  ///< [width, S x ffn]
  at::Tensor expert_bias;  ///< [E] buffer: shifts the choice only (0 unless update_bias runs)

 private:
  MoeStats stats_;
};
TORCH_MODULE(Moe);

/// InputError naming the field for options that cannot make the layer.
void validate(const MoeOptions& options);

}  // namespace dtrain::nn
