// The communication of tensor parallelism as paired autograd functions (Megatron-LM's
// mappings): each forward op's backward is its partner, so a layer built from them is
// differentiable with no hand-written gradient exchange. Every function is the identity for a
// null group or a group of one rank. Collectives wait with the group's timeout; a peer that does
// not arrive is an error naming the op and group, never a hang.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::nn::tensor {

/// Forward: identity. Backward: allreduce (sum) of the gradient over `group`. Where a
/// replicated activation enters rank-local (split) computation.
at::Tensor copy_to_group(const at::Tensor& x, const comm::CommunicatorPtr& group);

/// Forward: allreduce (sum) over `group`. Backward: identity. Where rank-local partial results
/// (a row-parallel layer's) become a replicated activation.
at::Tensor reduce_from_group(const at::Tensor& x, const comm::CommunicatorPtr& group);

/// Forward: this rank's share of `dim` (split_range). Backward: allgather along `dim`.
at::Tensor scatter_to_group(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim);

/// Forward: allgather of every rank's share along `dim`. Backward: this rank's share of the
/// gradient. `total` = the gathered size of `dim` when shares differ (split_range's balanced
/// shares); -1 when every rank holds the same.
at::Tensor gather_from_group(const at::Tensor& x, const comm::CommunicatorPtr& group, int64_t dim,
                             int64_t total = -1);

/// Sequence parallelism (activations [batch, sequence, ...] split along the sequence):
/// forward: allgather along dim 1; backward: reduce-scatter along dim 1 (the gradient of a
/// replicated input entering split computation, summed over the group and split again).
at::Tensor gather_from_sequence(const at::Tensor& x, const comm::CommunicatorPtr& group);

/// Sequence parallelism: forward: reduce-scatter along dim 1 (a row-parallel layer's partial
/// sums, each rank keeping its part of the sequence); backward: allgather along dim 1.
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const comm::CommunicatorPtr& group);

/// A column-parallel linear layer, y = x' W^T + b with x' = copy_to_group(x) or (with
/// `sequence_parallel`) gather_from_sequence(x), as one autograd function whose backward
/// overlaps the input gradient's collective with the weight gradient (Megatron's asynchronous
/// tensor-parallel communication): it computes dx' = dy W, starts dx''s allreduce (or
/// reduce-scatter along the sequence), computes dW = dy^T x' and db while it runs, then waits.
/// The same numbers as the separate mapping and linear. Under autocast the matmuls run in the
/// autocast dtype as at::linear's would. Not for a zero-bubble split backward (nn::linear's
/// deferral): the caller uses the separate path then.
at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& bias, const comm::CommunicatorPtr& group,
                                  bool sequence_parallel);

/// Forward: all-to-all of rows (dim 0) over `group`: send_rows[j] rows of `x`, in order, to
/// rank j; the result holds recv_rows[i] rows from each rank i, in rank order. Backward: the
/// same exchange reversed. A mixture of experts' dispatch and combine (expert parallelism).
at::Tensor all_to_all_rows(const at::Tensor& x, const comm::CommunicatorPtr& group,
                           const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows);

/// Sequence parallelism: forward: this rank's part of dim 1; backward: allgather along dim 1.
inline at::Tensor scatter_to_sequence(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  return scatter_to_group(x, group, 1);
}

}  // namespace dtrain::nn::tensor
