// Per-epoch seeded permutation and rank-strided selection.
#include "dtrain/data/DistributedSampler.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int num_replicas, int rank,
                                       SamplerOptions options)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
  DTRAIN_CHECK(num_replicas_ >= 1 && rank_ >= 0 && rank_ < num_replicas_, "sampler rank ", rank_,
               " of ", num_replicas_, " is invalid");
  DTRAIN_CHECK_INPUT(dataset_size_ >= (options_.drop_last ? num_replicas_ : 1), "data set of ",
                     dataset_size_, " examples is too small for ", num_replicas_, " ranks");
  num_samples_ = options_.drop_last ? dataset_size_ / num_replicas_
                                    : (dataset_size_ + num_replicas_ - 1) / num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order(dataset_size_);
  if (options_.shuffle) {
    at::Generator generator =
        at::detail::createCPUGenerator(options_.seed + static_cast<uint64_t>(epoch_));
    at::Tensor permutation = at::randperm(dataset_size_, generator, at::TensorOptions(at::kLong));
    const int64_t* p = permutation.data_ptr<int64_t>();
    order.assign(p, p + dataset_size_);
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) order[i] = i;
  }
  const int64_t total = num_samples_ * num_replicas_;
  for (int64_t i = dataset_size_; i < total; ++i) order.push_back(order[i % dataset_size_]);
  order.resize(total);
  std::vector<int64_t> mine;
  mine.reserve(num_samples_);
  for (int64_t i = rank_; i < total; i += num_replicas_) mine.push_back(order[i]);
  return mine;
}

}  // namespace dtrain::data
