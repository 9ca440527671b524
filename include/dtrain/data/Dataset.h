// In-memory datasets: inputs and targets as tensors, batches gathered by index. Every data set
// dtrain ships (Fashion-MNIST, synthetic) is small enough to live in memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace dtrain::data {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class TensorDataset {
 public:
  using Transform = std::function<at::Tensor(const at::Tensor&)>;
  TensorDataset() = default;
  /// `inputs` and `targets` share dimension 0; `transform` maps a gathered input batch (e.g.
  /// uint8 pixels -> normalized float).
  TensorDataset(at::Tensor inputs, at::Tensor targets, Transform transform = nullptr);

  int64_t size() const;
  /// The examples at `indices` (int64), transformed.
  Batch get(const std::vector<int64_t>& indices) const;
  /// Examples [begin, end) in order.
  Batch slice(int64_t begin, int64_t end) const;
  /// Shape of one input example (without the batch dimension).
  std::vector<int64_t> input_shape() const;
  const at::Tensor& raw_inputs() const { return inputs_; }
  const at::Tensor& targets() const { return targets_; }

 private:
  at::Tensor inputs_;
  at::Tensor targets_;
  Transform transform_;
};

/// A learnable synthetic classification set: Gaussian inputs labelled by a fixed random linear
/// teacher, for benchmarks and tests that must not depend on files.
TensorDataset make_synthetic(int64_t examples, const std::vector<int64_t>& input_shape,
                             int64_t classes, uint64_t seed);

}  // namespace dtrain::data
