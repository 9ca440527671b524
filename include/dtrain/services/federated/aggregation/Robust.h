// Robust aggregation, and the faulty clients that measure it. A server that sees each client's
// update can replace their mean by a statistic that a few arbitrary (Byzantine) updates cannot
// drag far: the coordinate-wise median or trimmed mean (Yin et al. 2018), Krum and multi-Krum
// (Blanchard et al. 2017: the update(s) closest to their n - f - 2 nearest neighbours), or the
// mean of updates clipped to a norm (Sun et al. 2019). Each is a registered aggregator
// (Aggregator.cpp: median, trimmed-mean, krum, multi-krum, clipped-mean) whose result the server
// optimizer applies like FedAvg's mean. With identical updates every one of them returns it.
//
// The attacks (simulation only, `--byzantine F:KIND[:S]`): a fixed fraction F of the clients,
// drawn from the seed, send a sign-flipped update (-S x theirs), a scaled one (S x theirs), noise
// (N(0, S^2) in every coordinate), or train on flipped labels (class c -> classes - 1 - c).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::services::federated {

/// The defences' parameters (flags --assumed-faulty, --update-clip).
struct RobustSpec {
  /// The fraction of a round's updates the defence tolerates as faulty: trimmed-mean cuts this
  /// fraction from each end of every coordinate; Krum assumes f = floor(fraction x n) and
  /// multi-Krum averages the n - f best.
  double assumed_faulty = 0.2;
  /// clipped-mean: every update is scaled to at most this L2 norm (0 = the round's median norm).
  double update_clip = 0.0;
};

/// InputError naming the flag out of range.
void validate(const RobustSpec& spec);

/// The statistics, over n >= 1 flat updates of one size and dtype (computed in float64,
/// returned in the updates' dtype). The median of an even count is the mean of the two middle
/// values; the trimmed mean cuts floor(fraction x n) values from each end (fewer if that would
/// leave none).
at::Tensor coordinate_median(const std::vector<at::Tensor>& updates);
at::Tensor trimmed_mean(const std::vector<at::Tensor>& updates, double fraction);
/// Krum's scores: for each update, the sum of squared distances to its n - f - 2 nearest others
/// (at least 1 of them); indices of the `m` lowest, best first.
std::vector<size_t> krum_select(const std::vector<at::Tensor>& updates, int64_t faulty, int64_t m);
/// `weights`-weighted mean of the updates, each scaled to L2 norm <= clip (clip <= 0: the
/// median of their norms).
at::Tensor clipped_mean(const std::vector<at::Tensor>& updates, const std::vector<double>& weights,
                        double clip);

/// Faulty clients in simulation.
struct ByzantineSpec {
  enum Kind { None, SignFlip, Scaled, Gaussian, LabelFlip };
  Kind kind = None;
  /// The fraction of all clients that are faulty (each drawn once from the seed).
  double fraction = 0.0;
  /// sign-flip: -scale x the update (default 1); scaled: scale x (default 10); gaussian: the
  /// noise's standard deviation (default 1).
  double scale = 1.0;
  bool enabled() const { return kind != None && fraction > 0; }
};

/// "none" or "F:KIND[:S]" with KIND sign-flip, scaled, gaussian, label-flip (InputError naming
/// --byzantine otherwise).
ByzantineSpec parse_byzantine(const std::string& text);
std::string to_string(const ByzantineSpec& spec);

/// Which of `clients` clients are faulty: round(fraction x clients) of them, drawn from `seed`.
std::vector<bool> faulty_clients(const ByzantineSpec& spec, int64_t clients, uint64_t seed);

/// What a faulty client sends instead of its honest update `delta` (label-flip: `delta`, which
/// it trained on flipped labels); `seed` draws the noise.
at::Tensor attack(const ByzantineSpec& spec, const at::Tensor& delta, uint64_t seed);

/// The labels a label-flipping client trains on: c -> classes - 1 - c.
at::Tensor flip_labels(const at::Tensor& targets, int64_t classes);

}  // namespace dtrain::services::federated
