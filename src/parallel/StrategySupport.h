// Pieces every data-parallel strategy builds the same way from StrategyOptions: the Reducer's
// options, the loss scaler, and the loss scaler's checkpoint file.
#pragma once

#include <memory>
#include <string>

#include "dtrain/nn/tensor/Split.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "dtrain/precision/LossScaler.h"
#include "dtrain/precision/Precision.h"

namespace dtrain::parallel {

/// Bucket caps, wire dtype ("none", "fp16", "bf16": InputError otherwise) and unused-parameter
/// policy from `options`.
parallel::ddp::ReducerOptions reducer_options_from(const StrategyOptions& options);

/// The dynamic loss scaler `options` ask for with `precision` (null when none): "dynamic", or
/// "auto" under fp16-mixed. InputError for an unknown loss_scaling, and for one asked with
/// bf16-master.
std::unique_ptr<precision::LossScaler> make_loss_scaler(const StrategyOptions& options,
                                                        precision::Precision precision);

/// bf16-master (precision::has_master_weights): fp32 copies of `parameters` (the master weights'
/// starting values), then `module` cast to the precision's parameter dtype (module->to keeps
/// each parameter's tensor, so `parameters` follow). Empty, and nothing cast, otherwise.
std::vector<at::Tensor> keep_master_weights(torch::nn::Module& module,
                                            const std::vector<at::Tensor>& parameters,
                                            precision::Precision precision);
/// A tensor whose .grad is `grad` (a Reducer's fp32 gradient slot): `master` when defined, else
/// a second view of the gradient (its parameter's shape at no cost).
at::Tensor gradient_holder(const at::Tensor& master, const at::Tensor& grad);
/// Copies each of `from` (master weights) into `to` (the model's parameters), rounding.
void copy_weights(const std::vector<at::Tensor>& from, const std::vector<at::Tensor>& to);
/// Bytes of one gradient element of `parameter` under `precision` (fp32 with master weights).
int64_t gradient_element_size(const at::Tensor& parameter, precision::Precision precision);

/// Scales the gradients of `holders` so their global L2 norm is at most `max_norm`, the squared
/// norm summed over each group of `sum_over` in turn (groups of ranks holding disjoint parts of
/// the gradients: ZeRO's DP shards, pipeline stages, tensor-parallel blocks). `counted[i]`
/// false leaves holder i out of this rank's sum (a parameter replicated across a
/// tensor-parallel group is counted by one of its ranks); empty = all counted. Collective;
/// returns the norm before clipping.
double clip_by_global_norm(const std::vector<at::Tensor>& holders,
                           const std::vector<comm::CommunicatorPtr>& sum_over, double max_norm,
                           const std::vector<bool>& counted = {});

/// What a data-parallel or pipeline strategy needs to know of tensor parallelism: which
/// parameters are blocks of larger tensors, and this rank's place in the TP group.
struct TensorParallelLayout {
  nn::tensor::ParameterSplits splits;
  /// Replicated parameters whose gradients are partial sums over the TP group.
  std::vector<std::string> partial;
  comm::CommunicatorPtr group;
  int rank = 0;
  int size = 1;
  /// Sums the gradients of the `partial` ones among `parameters` (named by `names`) over the
  /// TP group, and those of blocks several ranks hold over their holders, in one allreduce.
  /// Collective over the group (every TP rank has the same such parameters).
  void sum_partial_gradients(const std::vector<at::Tensor>& parameters,
                             const std::vector<std::string>& names) const;
  /// Checkpoint pieces this rank writes: blocks marked (a block several ranks hold by the first
  /// of them); replicated parameters at TP rank 0 only.
  std::vector<PieceRef> for_writing(std::vector<PieceRef> pieces) const;
  /// Checkpoint pieces this rank reads (blocks marked).
  std::vector<PieceRef> for_reading(std::vector<PieceRef> pieces) const;
  /// Whether some split parameter's block is held by several ranks.
  bool has_shared_blocks() const;
  /// Whether this rank counts each named parameter in a global norm.
  std::vector<bool> counted(const std::vector<std::string>& names) const;
  /// Whether each named parameter is one of the `partial` ones (ReducerOptions::partial).
  std::vector<bool> partial_flags(const std::vector<std::string>& names) const;
  /// Whether each named parameter is a block of experts (expert parallelism: a block no other
  /// rank of its expert group holds).
  std::vector<bool> expert_flags(const std::vector<std::string>& names) const;
  /// Expert parallelism's checkpoint files, one per rank of the first expert group: of `pieces`,
  /// what expert rank `ep_rank` writes (everything at the first, only the experts' blocks at
  /// the others: the dense parameters once).
  std::vector<PieceRef> for_expert_rank(std::vector<PieceRef> pieces, int ep_rank) const;
};

/// Expert parallelism: each expert's gradient here is the sum over its expert group's tokens of
/// each rank's mean loss, and the step's is the mean over every data-parallel rank: `experts`'
/// gradients (zero where none) summed over `edp` (the ranks holding the same experts), divided
/// by `data_parallel`. Collective over edp.
void reduce_expert_gradients(const std::vector<at::Tensor>& experts,
                             const comm::CommunicatorPtr& edp, int data_parallel);

/// The layout of `module` on `grid`. InputError when the grid has a TP group of several ranks
/// but the model has no tensor-parallel layers (it was not built over grid.tp()).
TensorParallelLayout tensor_parallel_layout(const torch::nn::Module& module,
                                            const comm::ProcessGrid& grid);

/// The scaler's state in a checkpoint directory: written by the caller's chosen rank; read if
/// present (InputError naming the file when it is not a scaler state).
void save_loss_scaler(const precision::LossScaler& scaler, const std::string& directory);
void load_loss_scaler(precision::LossScaler& scaler, const std::string& directory);

}  // namespace dtrain::parallel
