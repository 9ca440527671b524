// Differential privacy for federated learning (DP-FedAvg, McMahan et al. 2018): each client
// clips its update to an L2 norm S, the server averages the clipped updates with equal weights
// over the round's K selected clients and adds Gaussian noise of standard deviation z S to
// their sum (z: the noise multiplier). A client's whole data set then changes the sum by at
// most S, and the rounds are a sampled Gaussian mechanism (sampling rate q = K / N) whose
// privacy loss a Renyi-DP accountant adds up: epsilon for a given delta after T rounds
// (Mironov 2017; the sampled Gaussian's RDP at integer orders from Mironov, Talwar and Zhang
// 2019; the RDP to (epsilon, delta) conversion of Balle et al. 2020).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace dtrain::services::federated {

struct DpSpec {
  /// S: the L2 norm every update is clipped to (0 = no differential privacy).
  double clip = 0.0;
  /// z: the noise's standard deviation over S.
  double noise_multiplier = 0.0;
  /// delta of the reported (epsilon, delta).
  double delta = 1e-5;
  /// Adaptive clipping (Andrew et al. 2021): the clip follows this quantile of the clients'
  /// update norms, privately (0 = the clip stays --dp-clip, which is otherwise the start). Each
  /// client says whether its update was within the clip; the server counts them with Gaussian
  /// noise of standard deviation count_noise (0 = the round's clients / 20) and moves the clip
  /// by exp(-clip_lr (fraction within - quantile)). The count takes its share of z: the sum's
  /// noise multiplier becomes (z^-2 - (2 count_noise)^-2)^-1/2, and the accountant's z is
  /// unchanged.
  double target_quantile = 0.0;
  double clip_lr = 0.2;
  double count_noise = 0.0;
  bool enabled() const { return clip > 0; }
  bool adaptive() const { return enabled() && target_quantile > 0; }
};

/// The noise multiplier of the updates' sum when adaptive clipping's count (noise standard
/// deviation `count_noise`) shares the total `noise_multiplier` z; InputError naming the flags
/// when z >= 2 count_noise leaves nothing for the sum. 0 when z is 0.
double update_noise_multiplier(double noise_multiplier, double count_noise);

/// InputError naming --dp-clip, --dp-noise or --dp-delta when out of range.
void validate(const DpSpec& spec);

/// `update` scaled down to L2 norm <= clip (unchanged when already within it).
at::Tensor clip_update(const at::Tensor& update, double clip);

/// The sampled Gaussian mechanism's Renyi divergence of integer order alpha >= 2 for sampling
/// rate q and noise multiplier z (computed in log space; +inf when z = 0).
double sampled_gaussian_rdp(double q, double noise_multiplier, int alpha);

/// The smallest epsilon over orders 2..256 for `steps` rounds at `delta`, and its order.
std::pair<double, int> dp_epsilon(double q, double noise_multiplier, int64_t steps, double delta);

}  // namespace dtrain::services::federated
