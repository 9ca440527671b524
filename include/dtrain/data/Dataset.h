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

  /// A token stream (1-D int64) read as windows for next-token prediction: example i is
  /// tokens[i * stride, i * stride + context) and its targets the same window shifted by one.
  /// Nothing is copied until a batch is gathered. stride 1 gives every window (training, with a
  /// sampler's random order: random windows); stride = context tiles the stream (evaluation).
  static TensorDataset windows(at::Tensor tokens, int64_t context, int64_t stride);

  int64_t size() const;
  /// The examples at `indices` (int64), transformed.
  Batch get(const std::vector<int64_t>& indices) const;
  /// Only their targets (for ranks that need no inputs, e.g. a pipeline's last stage).
  at::Tensor get_targets(const std::vector<int64_t>& indices) const;
  /// Examples [begin, end) in order.
  Batch slice(int64_t begin, int64_t end) const;
  /// Shape of one input example (without the batch dimension).
  std::vector<int64_t> input_shape() const;
  /// The stored tensors (for windows: the token stream, and no targets).
  const at::Tensor& raw_inputs() const { return inputs_; }
  const at::Tensor& targets() const { return targets_; }
  /// The same inputs (and transform) with other targets (one per example).
  TensorDataset with_targets(at::Tensor targets) const;
  /// > 0 for a windowed token stream.
  int64_t context() const { return context_; }

 private:
  at::Tensor window_index(const at::Tensor& starts, int64_t shift) const;
  at::Tensor inputs_;
  at::Tensor targets_;
  Transform transform_;
  int64_t context_ = 0;
  int64_t stride_ = 1;
};

/// A learnable synthetic classification set: Gaussian inputs labelled by a fixed random linear
/// teacher, for benchmarks and tests that must not depend on files.
TensorDataset make_synthetic(int64_t examples, const std::vector<int64_t>& input_shape,
                             int64_t classes, uint64_t seed);

}  // namespace dtrain::data
