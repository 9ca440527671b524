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

int64_t TensorDataset::size() const { return inputs_.defined() ? inputs_.size(0) : 0; }

Batch TensorDataset::get(const std::vector<int64_t>& indices) const {
  at::Tensor index = at::tensor(indices, at::kLong);
  at::Tensor x = inputs_.index_select(0, index);
  return {transform_ ? transform_(x) : x, targets_.index_select(0, index)};
}

Batch TensorDataset::slice(int64_t begin, int64_t end) const {
  at::Tensor x = inputs_.slice(0, begin, end);
  return {transform_ ? transform_(x) : x, targets_.slice(0, begin, end)};
}

std::vector<int64_t> TensorDataset::input_shape() const {
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
