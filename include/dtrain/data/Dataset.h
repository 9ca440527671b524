// Data sets as the trainer sees them: examples gathered into batches by index. Small sets live
// in memory as tensors (Fashion-MNIST, synthetic, a character corpus); larger ones are read
// from files on demand through a SampleSource (token shards, memory-mapped).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace dtrain::data {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

/// Examples read on demand (from files): what TensorDataset asks of a set that is not held in
/// tensors.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  /// The examples at `indices`, batched.
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
  /// One input example's shape.
  virtual std::vector<int64_t> input_shape() const = 0;
  /// > 0 for token windows of that length.
  virtual int64_t context() const { return 0; }
  /// Every example's label, read without the examples (an image folder's, from its class
  /// folders): what samplers, partitions and a pipeline's last stage read; undefined: none.
  virtual at::Tensor labels() const { return {}; }
  /// The epoch the next batches belong to (random augmentation draws from it, so a resumed run
  /// augments as the uninterrupted one).
  virtual void set_epoch(int64_t) const {}
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
  /// Examples from a source. `presampled`: the source's order is already its random order over
  /// every epoch (Megatron's shuffle index), so samplers read it in order, once.
  static TensorDataset from_source(std::shared_ptr<const SampleSource> source, bool presampled);

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
  int64_t context() const { return source_ ? source_->context() : context_; }
  /// The order is the set's own, over all its epochs: read it in order, once (from_source).
  bool presampled() const { return presampled_; }
  /// Tells a source the epoch of the batches that follow (see SampleSource::set_epoch).
  void set_epoch(int64_t epoch) const {
    if (source_) source_->set_epoch(epoch);
  }

 private:
  at::Tensor window_index(const at::Tensor& starts, int64_t shift) const;
  at::Tensor inputs_;
  at::Tensor targets_;
  Transform transform_;
  int64_t context_ = 0;
  int64_t stride_ = 1;
  std::shared_ptr<const SampleSource> source_;
  bool presampled_ = false;
};

/// A learnable synthetic classification set: Gaussian inputs labelled by a fixed random linear
/// teacher, for benchmarks and tests that must not depend on files.
TensorDataset make_synthetic(int64_t examples, const std::vector<int64_t>& input_shape,
                             int64_t classes, uint64_t seed);

}  // namespace dtrain::data
