// Megatron-LM's tensor-parallel layers, over one communicator (the ProcessGrid's TP group; null
// or one rank = the plain layer). A column-parallel linear keeps a contiguous block of the
// output features (rows of the weight), a row-parallel linear a block of the input features
// (columns), a vocab-parallel embedding a block of the vocabulary. Paired, as in a transformer's
// MLP (column -> GeLU -> row) or attention (QKV by heads -> row), they cost one allreduce in
// forward and one in backward. Every rank draws the full weight from the global generator and
// keeps its block, so a model built from these layers equals the serial one with the same seed;
// inside an nn::InitScope (nn/DeferredInit.h) each rank's block is a placeholder drawn later by
// the parameter's name, element by element, with the same distributions.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/Communicator.h"
#include "dtrain/nn/tensor/Split.h"

namespace dtrain::nn::tensor {

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// Allgather the output features (every rank returns the full output); else each rank
  /// returns its block, for a row-parallel layer or a vocab-parallel loss to consume.
  TORCH_ARG(bool, gather_output) = false;
  /// The input is split along the sequence (dim 1) and is allgathered first; the input
  /// gradient is reduce-scattered back.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Backward overlaps the input gradient's allreduce (reduce-scatter) with the weight
  /// gradient (Mappings.h column_parallel_linear; --tp-comm-overlap).
  TORCH_ARG(bool, overlap_comm) = false;
  /// > 0: weight ~ normal(0, init_std), zero bias (GPT-2's init); else LibTorch's Linear init.
  TORCH_ARG(double, init_std) = -1.0;
  /// Consecutive ranks holding the same block: the output features are split into
  /// group size / replicas blocks, rank r keeping block r / replicas (grouped-query attention's
  /// key/value heads when there are fewer of them than ranks). The holders' gradients are
  /// partial sums; strategies sum them (TensorParallelLayout).
  TORCH_ARG(int, replicas) = 1;
};

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// The bias is replicated and added once, after the reduction.
  TORCH_ARG(bool, bias) = true;
  /// The input is already split along its features (a column-parallel layer's output); else
  /// each rank takes its block of the full input.
  TORCH_ARG(bool, input_is_parallel) = true;
  /// Reduce-scatter the output along the sequence (dim 1) instead of allreducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(double, init_std) = -1.0;
};

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  /// Reduce-scatter the output along the sequence instead of allreducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// > 0: weight ~ normal(0, init_std); else LibTorch's Embedding init (normal(0, 1)).
  TORCH_ARG(double, init_std) = -1.0;
};

/// y = x W^T + b with W's rows (output features) split over the group.
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options, comm::CommunicatorPtr group);
  at::Tensor forward(const at::Tensor& input);
  ParameterSplits local_splits() const override;
  /// Sets this rank's block from the full weight [out, in] and bias [out].
  void copy_from_full(const at::Tensor& weight, const at::Tensor& bias = {});
  /// This rank's output features [start, start + length).
  int64_t output_start() const { return start_; }
  int64_t output_length() const { return length_; }

  ColumnParallelLinearOptions options;
  comm::CommunicatorPtr group;
  at::Tensor weight;  ///< [length, in]
  at::Tensor bias;    ///< [length] (undefined without bias)

 private:
  int64_t start_ = 0;
  int64_t length_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

/// y = x W^T + b with W's columns (input features) split over the group; b replicated.
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  RowParallelLinearImpl(const RowParallelLinearOptions& options, comm::CommunicatorPtr group);
  at::Tensor forward(const at::Tensor& input);
  ParameterSplits local_splits() const override;
  void copy_from_full(const at::Tensor& weight, const at::Tensor& bias = {});
  int64_t input_start() const { return start_; }
  int64_t input_length() const { return length_; }

  RowParallelLinearOptions options;
  comm::CommunicatorPtr group;
  at::Tensor weight;  ///< [out, length]
  at::Tensor bias;    ///< [out]

 private:
  int64_t start_ = 0;
  int64_t length_ = 0;
};
TORCH_MODULE(RowParallelLinear);

/// An embedding whose rows (vocabulary) are split over the group: each rank looks up the ids in
/// its block (zeros elsewhere) and the results are summed.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options,
                             comm::CommunicatorPtr group);
  /// ids: any shape of int64; returns [..., embedding_dim].
  at::Tensor forward(const at::Tensor& ids);
  ParameterSplits local_splits() const override;
  void copy_from_full(const at::Tensor& weight);
  int64_t vocab_start() const { return start_; }
  int64_t vocab_length() const { return length_; }

  VocabParallelEmbeddingOptions options;
  comm::CommunicatorPtr group;
  at::Tensor weight;  ///< [length, embedding_dim]

 private:
  int64_t start_ = 0;
  int64_t length_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace dtrain::nn::tensor
