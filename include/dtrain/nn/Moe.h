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
// The experts' weights are stacked ([E, ...]). Expert parallelism splits them along their first
// dimension over a group of P ranks (GShard, DeepSeek-V3, torchtitan): rank p holds experts
// [p E/P, (p + 1) E/P). Each rank routes its own tokens, sends each assignment's row to the rank
// of its expert by an all-to-all with variable splits, computes its experts on the rows it
// received (an expert's rows from every rank, in rank order), and the results come back by the
// reverse all-to-all to be weighted and summed at their tokens. A capacity then bounds what each
// rank sends to an expert (from its own tokens, as Megatron-Core drops). Built inside an
// nn::InitScope (its parameters are placeholders drawn by name, nn/DeferredInit.h), so a rank
// draws only its experts and they equal one process's.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/nn/tensor/Split.h"

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
  /// Coefficients of the balance losses in the training loss (stats().aux_loss, z_loss): the
  /// model's loss adds them, or the layer's own backward (losses_in_backward).
  double aux_loss = 0.0, z_loss = 0.0;
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

/// Max / mean of per-expert loads (1 = balanced; 1 when none).
double load_imbalance(const std::vector<int64_t>& load);

/// What the training forwards routed since the last MoeImpl::take_step_counts(): loads and drops
/// summed over them (a step's micro-batches), and the sum of their auxiliary losses' values.
struct MoeStepCounts {
  std::vector<int64_t> load;
  int64_t dropped = 0;
  int64_t tokens = 0;
  int64_t forwards = 0;
  double aux_loss = 0.0;
};

class MoeImpl : public torch::nn::Module, public tensor::TensorParallelModule {
 public:
  /// `expert_parallel`: the group the experts are split over (null or one rank: all here).
  explicit MoeImpl(MoeOptions options, comm::CommunicatorPtr expert_parallel = nullptr);
  /// [..., width] -> [..., width].
  at::Tensor forward(const at::Tensor& input);
  const MoeStats& stats() const { return stats_; }
  /// The counts of the forwards run with autograd on since the last call (a step's micro-batches;
  /// not evaluation, nor whole-block checkpointing's first forward, which runs again), and zero
  /// them.
  MoeStepCounts take_step_counts();
  /// DeepSeek-V3's auxiliary-loss-free balancing: bias_e += rate x sign(mean load - load_e), from
  /// `load` (per expert: the last forward's, or a step's summed over micro-batches and ranks).
  void update_bias(const std::vector<int64_t>& load, double rate);
  /// Balance losses without the loss (Megatron-Core's MoEAuxLossAutoScaler): with `scale` > 0,
  /// each training forward's aux_loss x stats().aux_loss + z_loss x stats().z_loss gets the
  /// gradient `scale` (the loss's factor: 1 / micro-batches, times a loss scale) from the backward
  /// of the layer's output, and the model's loss leaves it out. A pipeline needs this: its loss
  /// lives on the last stage, the layers on every stage. 0: off (the default).
  void set_losses_in_backward(double scale) { backward_scale_ = scale; }
  bool losses_in_backward() const { return backward_scale_ > 0; }
  /// The sum of the balance losses' values so taken since the last call (unscaled), and zeroes it.
  double take_losses_in_backward();
  /// The ranks holding the other parts of the same sequences (context parallelism; null or one
  /// rank: none): the auxiliary loss's f_e then counts their assignments too (an allreduce of E
  /// counts a forward), so that the mean over the group of each rank's loss is the whole
  /// sequences' (P_e, and the z-loss, are means over equal parts).
  void set_sequence_group(comm::CommunicatorPtr group) { sequence_group_ = std::move(group); }
  /// The experts this rank holds: [first_expert(), first_expert() + local_experts()).
  int64_t local_experts() const { return options.experts / expert_ranks_; }
  int64_t first_expert() const { return local_experts() * expert_rank_; }
  const comm::CommunicatorPtr& expert_parallel() const { return expert_parallel_; }
  /// With expert parallelism: gate, up and down are blocks of dim 0 (marked `expert`).
  tensor::ParameterSplits local_splits() const override;

  MoeOptions options;
  at::Tensor router;       ///< [E, width]
  at::Tensor gate, up;     ///< [E, ffn, width] (this rank's experts: E / P of them)
  at::Tensor down;         ///< [E, width, ffn]
  at::Tensor shared_gate;  ///< [S x ffn, width] (S = shared_experts > 0; else undefined)
  at::Tensor shared_up;    ///< [S x ffn, width]
  at::Tensor shared_down;  ///< [width, S x ffn]
  at::Tensor expert_bias;  ///< [E] buffer: shifts the choice only (0 unless update_bias runs)

 private:
  /// The rows sent to each expert (sorted by expert, taken[e] for expert e) through it, on its
  /// rank (an all-to-all there and back with expert parallelism): the results in their order.
  at::Tensor compute_experts(const at::Tensor& sent, const std::vector<int64_t>& taken);

  MoeStats stats_;
  MoeStepCounts step_;
  double backward_scale_ = 0.0, taken_in_backward_ = 0.0;
  comm::CommunicatorPtr expert_parallel_;
  comm::CommunicatorPtr sequence_group_;
  int expert_ranks_ = 1;
  int expert_rank_ = 0;
};
TORCH_MODULE(Moe);

/// InputError naming the field for options that cannot make the layer (over `expert_ranks`).
void validate(const MoeOptions& options, int expert_ranks = 1);

}  // namespace dtrain::nn
