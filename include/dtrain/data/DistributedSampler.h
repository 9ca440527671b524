// DistributedSampler: each rank's share of a data set for one epoch (torch.utils.data's
// DistributedSampler): a seeded shuffle per epoch, then every rank takes a strided slice, so the
// ranks' k-th batches together are exactly the single-process k-th global batch.
#pragma once

#include <cstdint>
#include <vector>

namespace dtrain::data {

struct SamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  /// true: drop the tail so every rank gets floor(N / ranks); false: pad by wrapping around.
  bool drop_last = false;
};

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank, SamplerOptions options = {});

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  /// Examples this rank sees per epoch (equal on every rank).
  int64_t num_samples() const { return num_samples_; }
  /// This rank's dataset indices for the current epoch, in visiting order.
  std::vector<int64_t> indices() const;

 private:
  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t num_samples_;
};

}  // namespace dtrain::data
