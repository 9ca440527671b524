// Cross-entropy and argmax over logits whose last dimension (the vocabulary) is split over a
// group, as a column-parallel output layer leaves them: no rank ever holds the full logits
// (Megatron-LM's vocab-parallel cross-entropy). Each rank's block is [vocab_start,
// vocab_start + logits.size(-1)).
#pragma once

#include <ATen/core/Tensor.h>

#include "dtrain/comm/Communicator.h"

namespace dtrain::nn::tensor {

/// Mean over every position of -log softmax(full logits)[target]: logits [..., block],
/// targets [...] (int64 ids of the full vocabulary). Differentiable in `logits`. Three small
/// allreduces over the group (max, then sum of exponentials and target logit together).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const comm::CommunicatorPtr& group, int64_t vocab_start);

/// The full vocabulary's argmax at every position ([...] int64), ties going to the lowest id.
at::Tensor vocab_parallel_argmax(const at::Tensor& logits, const comm::CommunicatorPtr& group,
                                 int64_t vocab_start);

}  // namespace dtrain::nn::tensor
