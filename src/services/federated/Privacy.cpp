#include "dtrain/services/federated/Privacy.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

void validate(const DpSpec& s) {
  DTRAIN_CHECK_INPUT(s.clip >= 0 && std::isfinite(s.clip), "--dp-clip must be >= 0, got ", s.clip);
  DTRAIN_CHECK_INPUT(s.noise_multiplier >= 0 && std::isfinite(s.noise_multiplier),
                     "--dp-noise must be >= 0, got ", s.noise_multiplier);
  DTRAIN_CHECK_INPUT(s.delta > 0 && s.delta < 1, "--dp-delta must be in (0, 1), got ", s.delta);
  DTRAIN_CHECK_INPUT(s.noise_multiplier == 0 || s.clip > 0,
                     "--dp-noise needs --dp-clip (the noise is a multiple of the clip norm)");
  DTRAIN_CHECK_INPUT(s.target_quantile >= 0 && s.target_quantile < 1,
                     "--dp-target-quantile must be in [0, 1) (0 = a fixed clip), got ",
                     s.target_quantile);
  DTRAIN_CHECK_INPUT(s.target_quantile == 0 || s.clip > 0,
                     "--dp-target-quantile needs --dp-clip (the clip it starts from)");
  DTRAIN_CHECK_INPUT(s.clip_lr > 0 && std::isfinite(s.clip_lr), "--dp-clip-lr must be > 0, got ",
                     s.clip_lr);
  DTRAIN_CHECK_INPUT(s.count_noise >= 0 && std::isfinite(s.count_noise),
                     "--dp-count-noise must be >= 0, got ", s.count_noise);
}

double update_noise_multiplier(double z, double count_noise) {
  if (z == 0) return 0.0;
  DTRAIN_CHECK_INPUT(z < 2 * count_noise, "--dp-noise ", z,
                     " leaves no noise for the updates' sum: adaptive clipping's count, of noise ",
                     count_noise,
                     " (--dp-count-noise; default the round's clients / 20), takes "
                     "(2 x that)^-2 of z^-2; raise --dp-count-noise above ",
                     z / 2, " or lower --dp-noise");
  return 1.0 / std::sqrt(1.0 / (z * z) - 1.0 / (4 * count_noise * count_noise));
}

at::Tensor clip_update(const at::Tensor& update, double clip) {
  const double norm = update.to(at::kDouble).norm().item<double>();
  if (norm <= clip || norm == 0) return update;
  return update * (clip / norm);
}

namespace {

double log_add(double a, double b) {
  if (a == -std::numeric_limits<double>::infinity()) return b;
  if (b == -std::numeric_limits<double>::infinity()) return a;
  const double hi = std::max(a, b);
  return hi + std::log1p(std::exp(std::min(a, b) - hi));
}

}  // namespace

double sampled_gaussian_rdp(double q, double z, int alpha) {
  DTRAIN_CHECK(alpha >= 2 && q >= 0 && q <= 1, "RDP at order ", alpha, ", rate ", q);
  if (q == 0) return 0.0;
  if (z == 0) return std::numeric_limits<double>::infinity();
  // A = sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 z^2)), in logs.
  double log_a = -std::numeric_limits<double>::infinity();
  for (int k = 0; k <= alpha; ++k) {
    const double log_binomial =
        std::lgamma(alpha + 1.0) - std::lgamma(k + 1.0) - std::lgamma(alpha - k + 1.0);
    const double log_q = k == 0 ? 0.0 : k * std::log(q);
    const double log_1q = alpha - k == 0 ? 0.0
                                         : (q == 1 ? -std::numeric_limits<double>::infinity()
                                                   : (alpha - k) * std::log1p(-q));
    const double term =
        log_binomial + log_q + log_1q + (static_cast<double>(k) * k - k) / (2 * z * z);
    log_a = log_add(log_a, term);
  }
  return log_a / (alpha - 1);
}

std::pair<double, int> dp_epsilon(double q, double z, int64_t steps, double delta) {
  DTRAIN_CHECK(delta > 0 && delta < 1 && steps >= 0, "epsilon for delta ", delta);
  double best = std::numeric_limits<double>::infinity();
  int best_order = 0;
  for (int alpha = 2; alpha <= 256; ++alpha) {
    const double rdp = static_cast<double>(steps) * sampled_gaussian_rdp(q, z, alpha);
    // Balle et al. 2020, Theorem 21.
    const double eps =
        rdp + std::log1p(-1.0 / alpha) - (std::log(delta) + std::log(alpha)) / (alpha - 1);
    if (eps < best) {
      best = eps;
      best_order = alpha;
    }
  }
  return {std::max(0.0, best), best_order};
}

}  // namespace dtrain::services::federated
