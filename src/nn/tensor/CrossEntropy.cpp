// Vocab-parallel cross-entropy as one autograd function: the forward reduces the row maxima,
// then the sums of exponentials and the target logits; the backward is local (softmax minus
// the one-hot target, each rank for its block).
#include "dtrain/nn/tensor/CrossEntropy.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include "dtrain/common/Error.h"

namespace dtrain::nn::tensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void allreduce(const at::Tensor& t, const comm::CommunicatorPtr& group, comm::ReduceOp op) {
  if (group && group->size() > 1) comm::on_lane(group)->allreduce(t, {op})->wait();
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, comm::CommunicatorPtr group,
                            int64_t vocab_start) {
    const int64_t block = logits.size(-1);
    // fp32 at least (bf16 logits are widened), float64 kept.
    const auto compute = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor rows = logits.reshape({-1, block}).to(compute).contiguous();
    const at::Tensor flat_targets = targets.reshape({-1});
    DTRAIN_CHECK_INPUT(flat_targets.size(0) == rows.size(0), "cross-entropy of logits ",
                       logits.sizes(), " against targets ", targets.sizes());
    at::Tensor maxima = std::get<0>(rows.max(-1)).contiguous();
    allreduce(maxima, group, comm::ReduceOp::Max);
    const at::Tensor shifted = rows - maxima.unsqueeze(-1);
    const at::Tensor exps = shifted.exp();
    const at::Tensor outside =
        flat_targets.lt(vocab_start).logical_or(flat_targets.ge(vocab_start + block));
    const at::Tensor local = (flat_targets - vocab_start).masked_fill(outside, 0);
    const at::Tensor target_logit =
        shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0);
    at::Tensor sums = at::stack({exps.sum(-1), target_logit}).contiguous();  // [2, N]
    allreduce(sums, group, comm::ReduceOp::Sum);
    const at::Tensor losses = sums[0].log() - sums[1];
    ctx->save_for_backward({exps / sums[0].unsqueeze(-1), local, outside});
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return losses.mean();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax of this rank's block
    const at::Tensor& local = saved[1];
    const at::Tensor inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(1, local.unsqueeze(1), -inside.unsqueeze(1));
    grad.mul_(grads[0].to(grad.scalar_type()) / static_cast<double>(grad.size(0)));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.view(ctx->saved_data["shape"].toIntVector()).to(dtype), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const comm::CommunicatorPtr& group, int64_t vocab_start) {
  return VocabParallelCrossEntropy::apply(logits, targets, group, vocab_start);
}

at::Tensor vocab_parallel_argmax(const at::Tensor& logits, const comm::CommunicatorPtr& group,
                                 int64_t vocab_start) {
  auto [values, indices] = logits.detach().max(-1);
  if (!group || group->size() == 1) return indices;
  const int ranks = group->size();
  const at::Tensor mine_values = values.to(at::kDouble).reshape({-1}).contiguous();
  const at::Tensor mine_ids = (indices + vocab_start).reshape({-1}).contiguous();
  at::Tensor all_values = at::empty({ranks, mine_values.numel()}, mine_values.options());
  at::Tensor all_ids = at::empty({ranks, mine_ids.numel()}, mine_ids.options());
  comm::on_lane(group)->allgather(all_values.view({-1}), mine_values)->wait();
  comm::on_lane(group)->allgather(all_ids.view({-1}), mine_ids)->wait();
  // Ranks hold increasing blocks, so the first rank with the maximum has the lowest id.
  const at::Tensor best_rank = all_values.argmax(0);
  return all_ids.gather(0, best_rank.unsqueeze(0)).squeeze(0).view(values.sizes());
}

}  // namespace dtrain::nn::tensor
