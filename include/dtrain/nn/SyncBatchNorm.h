// BatchNorm whose statistics span a group of ranks, as torch.nn.SyncBatchNorm: in training,
// each rank's per-channel mean and variance are gathered and combined (Chan's parallel
// algorithm, exact for uneven batches), the batch is normalized with the group's statistics and
// the running statistics follow the group's batch; in backward the two per-channel gradient sums
// are allreduced, so the input gradient is the one of BatchNorm over the whole global batch.
// Data-parallel ranks then train exactly as one process on the global batch. Without a group
// (or a group of one rank), and in evaluation, it is torch::nn::BatchNorm2d: the same
// parameters, buffers and names, so its state dicts are torchvision's.
//
// dtrain's ResNets are built from it; `dtrain train --sync-batchnorm` hands every such layer the
// run's data-parallel group (set_sync_batchnorm). A model of your own gets the same by using
// SyncBatchNorm2d where it would use torch::nn::BatchNorm2d.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

#include "dtrain/comm/Communicator.h"

namespace dtrain::nn {

/// torch::nn::BatchNorm2d's parameters and buffers, by its names (weight, bias, running_mean,
/// running_var, num_batches_tracked) and initialization; a module of its own because LibTorch
/// does not export what a subclass of its BatchNorm2d needs.
class SyncBatchNorm2dImpl : public torch::nn::Module {
 public:
  explicit SyncBatchNorm2dImpl(int64_t features)
      : SyncBatchNorm2dImpl(torch::nn::BatchNormOptions(features)) {}
  explicit SyncBatchNorm2dImpl(const torch::nn::BatchNormOptions& options);
  /// Collective over `group` in training mode (every rank of the group runs as many forwards
  /// and backwards); input [B, C, H, W].
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  at::Tensor weight, bias;                                    ///< [C] (undefined unless affine)
  at::Tensor running_mean, running_var, num_batches_tracked;  ///< (undefined unless tracked)
  /// null or one rank: plain BatchNorm.
  comm::CommunicatorPtr group;
};
TORCH_MODULE(SyncBatchNorm2d);

/// Gives every SyncBatchNorm2d of `model` the group its statistics span (null: none); returns
/// how many it found.
int64_t set_sync_batchnorm(torch::nn::Module& model, const comm::CommunicatorPtr& group);

}  // namespace dtrain::nn
