// TensorDataset gathering and the synthetic data set.
#include "dtrain/data/Dataset.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::data {

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets, Transform transform)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), transform_(std::move(transform)) {
  DTRAIN_CHECK(inputs_.dim() >= 1 && targets_.dim() >= 1 && inputs_.size(0) == targets_.size(0),
               "dataset inputs (", inputs_.sizes(), ") and targets (", targets_.sizes(),
               ") disagree on the number of examples");
}

TensorDataset TensorDataset::with_targets(at::Tensor targets) const {
  DTRAIN_CHECK(!source_, "with_targets: a set read from files keeps its targets");
  DTRAIN_CHECK(context_ == 0, "with_targets: a token stream has no targets to replace");
  return TensorDataset(inputs_, std::move(targets), transform_);
}

TensorDataset TensorDataset::windows(at::Tensor tokens, int64_t context, int64_t stride) {
  DTRAIN_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong,
               "a token stream is a 1-D int64 tensor, got ", tokens.sizes(), " ",
               tokens.scalar_type());
  DTRAIN_CHECK(context >= 1 && stride >= 1, "windows need context >= 1 and stride >= 1");
  DTRAIN_CHECK_INPUT(tokens.size(0) >= context + 1, "a stream of ", tokens.size(0),
                     " tokens is too short for one window of ", context,
                     " tokens and its next-token targets (needs ", context + 1, ")");
  TensorDataset dataset;
  dataset.inputs_ = tokens.contiguous();
  dataset.context_ = context;
  dataset.stride_ = stride;
  return dataset;
}

TensorDataset TensorDataset::from_source(std::shared_ptr<const SampleSource> source,
                                         bool presampled) {
  DTRAIN_CHECK(source != nullptr, "from_source: no source");
  TensorDataset dataset;
  dataset.source_ = std::move(source);
  dataset.presampled_ = presampled;
  dataset.targets_ = dataset.source_->labels();  // undefined when the source has none
  return dataset;
}

int64_t TensorDataset::size() const {
  if (source_) return source_->size();
  if (!inputs_.defined()) return 0;
  if (context_ > 0) return (inputs_.size(0) - context_ - 1) / stride_ + 1;
  return inputs_.size(0);
}

at::Tensor TensorDataset::window_index(const at::Tensor& starts, int64_t shift) const {
  return (starts * stride_ + shift).unsqueeze(1) + at::arange(context_, at::kLong).unsqueeze(0);
}

Batch TensorDataset::get(const std::vector<int64_t>& indices) const {
  if (source_) return source_->get(indices);
  at::Tensor index = at::tensor(indices, at::kLong);
  if (context_ > 0) {
    return {inputs_.index({window_index(index, 0)}), inputs_.index({window_index(index, 1)})};
  }
  at::Tensor x = inputs_.index_select(0, index);
  return {transform_ ? transform_(x) : x, targets_.index_select(0, index)};
}

at::Tensor TensorDataset::get_targets(const std::vector<int64_t>& indices) const {
  if (source_ && !targets_.defined()) return source_->get(indices).targets;
  at::Tensor index = at::tensor(indices, at::kLong);
  if (context_ > 0) return inputs_.index({window_index(index, 1)});
  return targets_.index_select(0, index);
}

Batch TensorDataset::slice(int64_t begin, int64_t end) const {
  if (source_) {
    std::vector<int64_t> indices(end - begin);
    for (int64_t i = begin; i < end; ++i) indices[i - begin] = i;
    return source_->get(indices);
  }
  if (context_ > 0) {
    at::Tensor starts = at::arange(begin, end, at::kLong);
    return {inputs_.index({window_index(starts, 0)}), inputs_.index({window_index(starts, 1)})};
  }
  at::Tensor x = inputs_.slice(0, begin, end);
  return {transform_ ? transform_(x) : x, targets_.slice(0, begin, end)};
}

std::vector<int64_t> TensorDataset::input_shape() const {
  if (source_) return source_->input_shape();
  if (context_ > 0) return {context_};
  auto sizes = inputs_.sizes().vec();
  sizes.erase(sizes.begin());
  return sizes;
}

TensorDataset make_synthetic(int64_t examples, const std::vector<int64_t>& input_shape,
                             int64_t classes, uint64_t seed) {
  at::Generator generator = at::detail::createCPUGenerator(seed);
  std::vector<int64_t> shape{examples};
  shape.insert(shape.end(), input_shape.begin(), input_shape.end());
  at::Tensor inputs = at::randn(shape, generator, at::TensorOptions(at::kFloat));
  const int64_t features = inputs.numel() / std::max<int64_t>(examples, 1);
  at::Tensor teacher = at::randn({features, classes}, generator, at::TensorOptions(at::kFloat));
  at::Tensor targets = inputs.reshape({examples, features}).matmul(teacher).argmax(1);
  return TensorDataset(inputs, targets);
}

}  // namespace dtrain::data
