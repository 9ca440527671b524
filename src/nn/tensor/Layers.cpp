// Column-, row- and vocab-parallel layers (see Layers.h).
#include "dtrain/nn/tensor/Layers.h"

#include <torch/torch.h>

#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/WeightGrad.h"
#include "dtrain/nn/tensor/Mappings.h"

namespace dtrain::nn::tensor {

namespace {

int size_of(const comm::CommunicatorPtr& group) { return group ? group->size() : 1; }
int rank_of(const comm::CommunicatorPtr& group) { return group ? group->rank() : 0; }

// The full weight [out, in] and bias [out] of a linear layer as every rank draws them.
std::pair<at::Tensor, at::Tensor> full_linear(int64_t in, int64_t out, bool with_bias,
                                              double init_std) {
  torch::NoGradGuard no_grad;
  at::Tensor weight = at::empty({out, in});
  at::Tensor bias = with_bias ? at::empty({out}) : at::Tensor();
  if (init_std > 0) {
    weight.normal_(0.0, init_std);
    if (with_bias) bias.zero_();
  } else {  // torch::nn::Linear's reset_parameters()
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (with_bias) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      bias.uniform_(-bound, bound);
    }
  }
  return {weight, bias};
}

// Inside an InitScope (a model whose values are drawn by name): a linear layer's rules, the
// same distributions as full_linear's.
std::pair<InitRule, InitRule> linear_rules(int64_t in, double init_std) {
  if (init_std > 0) return {InitRule::normal(init_std), InitRule::constant(0.0)};
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));  // kaiming_uniform_(a = √5)
  return {InitRule::uniform(bound), InitRule::uniform(bound)};
}

void check_full(const at::Tensor& given, at::IntArrayRef expected, const char* what) {
  DTRAIN_CHECK_INPUT(given.sizes() == expected, what, " of shape ", given.sizes(),
                     " given where the layer's full tensor is ", expected);
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options_,
                                                   comm::CommunicatorPtr group_)
    : options(options_), group(std::move(group_)) {
  const int replicas = options.replicas();
  DTRAIN_CHECK(replicas >= 1 && size_of(group) % replicas == 0, "a column-parallel linear over ",
               size_of(group), " ranks cannot keep ", replicas, " replicas of each block");
  DTRAIN_CHECK(replicas == 1 || !options.gather_output(),
               "a column-parallel linear with replicated blocks cannot gather its output");
  const int blocks = size_of(group) / replicas;
  DTRAIN_CHECK_INPUT(options.in_features() >= 1 && options.out_features() >= blocks,
                     "a column-parallel linear of ", options.in_features(), " -> ",
                     options.out_features(), " features cannot be split over ", blocks, " ranks");
  std::tie(start_, length_) =
      split_range(options.out_features(), blocks, rank_of(group) / replicas);
  if (current_init() != nullptr) {  // this rank's rows, drawn later by name
    const auto [w, b] = linear_rules(options.in_features(), options.init_std());
    weight = register_parameter("weight", new_parameter({length_, options.in_features()}, w));
    if (options.bias()) bias = register_parameter("bias", new_parameter({length_}, b));
    return;
  }
  auto [w, b] = full_linear(options.in_features(), options.out_features(), options.bias(),
                            options.init_std());
  weight = register_parameter("weight", w.narrow(0, start_, length_).clone());
  if (options.bias()) bias = register_parameter("bias", b.narrow(0, start_, length_).clone());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  if (options.overlap_comm() && size_of(group) > 1 && !dtrain::nn::deferring_weight_grads()) {
    at::Tensor y = column_parallel_linear(input, weight, bias, group, options.sequence_parallel());
    return options.gather_output() ? gather_from_group(y, group, -1, options.out_features()) : y;
  }
  const at::Tensor x = options.sequence_parallel() ? gather_from_sequence(input, group)
                                                   : copy_to_group(input, group);
  at::Tensor y = nn::linear(x, weight, bias);
  return options.gather_output() ? gather_from_group(y, group, -1, options.out_features()) : y;
}

ParameterSplits ColumnParallelLinearImpl::local_splits() const {
  if (size_of(group) == 1) return {};
  const int replicas = options.replicas(), replica = rank_of(group) % replicas;
  ParameterSplits splits;
  splits["weight"] = {0,        start_, length_, {options.out_features(), options.in_features()},
                      replicas, replica};
  if (options.bias()) {
    splits["bias"] = {0, start_, length_, {options.out_features()}, replicas, replica};
  }
  return splits;
}

void ColumnParallelLinearImpl::copy_from_full(const at::Tensor& w, const at::Tensor& b) {
  torch::NoGradGuard no_grad;
  check_full(w, {options.out_features(), options.in_features()}, "weight");
  weight.copy_(w.narrow(0, start_, length_));
  if (options.bias() && b.defined()) {
    check_full(b, {options.out_features()}, "bias");
    bias.copy_(b.narrow(0, start_, length_));
  }
}

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& options_,
                                             comm::CommunicatorPtr group_)
    : options(options_), group(std::move(group_)) {
  DTRAIN_CHECK_INPUT(options.out_features() >= 1 && options.in_features() >= size_of(group),
                     "a row-parallel linear of ", options.in_features(), " -> ",
                     options.out_features(), " features cannot be split over ", size_of(group),
                     " ranks");
  std::tie(start_, length_) = split_range(options.in_features(), size_of(group), rank_of(group));
  if (current_init() != nullptr) {  // this rank's columns, drawn later by name
    const auto [w, b] = linear_rules(options.in_features(), options.init_std());
    weight = register_parameter("weight", new_parameter({options.out_features(), length_}, w));
    if (options.bias())
      bias = register_parameter("bias", new_parameter({options.out_features()}, b));
    return;
  }
  auto [w, b] = full_linear(options.in_features(), options.out_features(), options.bias(),
                            options.init_std());
  weight = register_parameter("weight", w.narrow(1, start_, length_).contiguous());
  if (options.bias()) bias = register_parameter("bias", b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const at::Tensor x = options.input_is_parallel() ? input : scatter_to_group(input, group, -1);
  const at::Tensor partial = nn::linear(x, weight);
  at::Tensor y = options.sequence_parallel() ? reduce_scatter_to_sequence(partial, group)
                                             : reduce_from_group(partial, group);
  return bias.defined() ? y + bias : y;
}

ParameterSplits RowParallelLinearImpl::local_splits() const {
  if (size_of(group) == 1) return {};
  return {{"weight", {1, start_, length_, {options.out_features(), options.in_features()}}}};
}

void RowParallelLinearImpl::copy_from_full(const at::Tensor& w, const at::Tensor& b) {
  torch::NoGradGuard no_grad;
  check_full(w, {options.out_features(), options.in_features()}, "weight");
  weight.copy_(w.narrow(1, start_, length_));
  if (options.bias() && b.defined()) {
    check_full(b, {options.out_features()}, "bias");
    bias.copy_(b);
  }
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(
    const VocabParallelEmbeddingOptions& options_, comm::CommunicatorPtr group_)
    : options(options_), group(std::move(group_)) {
  DTRAIN_CHECK_INPUT(options.embedding_dim() >= 1 && options.num_embeddings() >= size_of(group),
                     "an embedding of ", options.num_embeddings(), " x ", options.embedding_dim(),
                     " cannot be split over ", size_of(group), " ranks");
  std::tie(start_, length_) = split_range(options.num_embeddings(), size_of(group), rank_of(group));
  if (current_init() != nullptr) {  // this rank's rows, drawn later by name
    weight = register_parameter(
        "weight",
        new_parameter({length_, options.embedding_dim()},
                      InitRule::normal(options.init_std() > 0 ? options.init_std() : 1.0)));
    return;
  }
  at::Tensor full = at::empty({options.num_embeddings(), options.embedding_dim()});
  {
    torch::NoGradGuard no_grad;
    full.normal_(0.0, options.init_std() > 0 ? options.init_std() : 1.0);
  }
  weight = register_parameter("weight", full.narrow(0, start_, length_).clone());
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  if (size_of(group) == 1) return at::embedding(weight, ids);
  const at::Tensor outside = ids.lt(start_).logical_or(ids.ge(start_ + length_));
  const at::Tensor local = (ids - start_).masked_fill(outside, 0);
  const at::Tensor partial = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return options.sequence_parallel() ? reduce_scatter_to_sequence(partial, group)
                                     : reduce_from_group(partial, group);
}

ParameterSplits VocabParallelEmbeddingImpl::local_splits() const {
  if (size_of(group) == 1) return {};
  return {{"weight", {0, start_, length_, {options.num_embeddings(), options.embedding_dim()}}}};
}

void VocabParallelEmbeddingImpl::copy_from_full(const at::Tensor& w) {
  torch::NoGradGuard no_grad;
  check_full(w, {options.num_embeddings(), options.embedding_dim()}, "weight");
  weight.copy_(w.narrow(0, start_, length_));
}

}  // namespace dtrain::nn::tensor
