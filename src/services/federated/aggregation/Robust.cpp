#include "dtrain/services/federated/aggregation/Robust.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <ATen/CPUGeneratorImpl.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"

namespace dtrain::services::federated {

namespace {

// The updates as rows of one float64 matrix (checked: n >= 1, one size and dtype).
at::Tensor rows(const std::vector<at::Tensor>& updates, const char* what) {
  DTRAIN_CHECK(!updates.empty(), what, ": no updates");
  for (const auto& u : updates) {
    DTRAIN_CHECK(u.dim() == 1 && u.numel() == updates[0].numel() &&
                     u.scalar_type() == updates[0].scalar_type(),
                 what, ": updates of different sizes or dtypes");
  }
  return at::stack(updates).to(at::kDouble);
}

}  // namespace

void validate(const RobustSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.assumed_faulty >= 0 && spec.assumed_faulty < 0.5,
                     "--assumed-faulty must be a fraction in [0, 0.5), got ", spec.assumed_faulty);
  DTRAIN_CHECK_INPUT(spec.update_clip >= 0 && std::isfinite(spec.update_clip),
                     "--update-clip must be >= 0 (0 = the round's median norm), got ",
                     spec.update_clip);
}

at::Tensor coordinate_median(const std::vector<at::Tensor>& updates) {
  const at::Tensor sorted = std::get<0>(rows(updates, "median").sort(0));
  const int64_t n = sorted.size(0);
  const at::Tensor middle = n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) * 0.5;
  return middle.to(updates[0].scalar_type());
}

at::Tensor trimmed_mean(const std::vector<at::Tensor>& updates, double fraction) {
  const at::Tensor sorted = std::get<0>(rows(updates, "trimmed mean").sort(0));
  const int64_t n = sorted.size(0);
  int64_t cut = static_cast<int64_t>(std::floor(fraction * static_cast<double>(n)));
  cut = std::min(cut, (n - 1) / 2);  // leave at least one value
  return sorted.narrow(0, cut, n - 2 * cut).mean(0).to(updates[0].scalar_type());
}

std::vector<size_t> krum_select(const std::vector<at::Tensor>& updates, int64_t faulty, int64_t m) {
  const at::Tensor x = rows(updates, "krum");
  const int64_t n = x.size(0);
  // Squared distances from the Gram matrix (n is small, the rows long).
  const at::Tensor gram = x.matmul(x.t());
  const at::Tensor norms = gram.diagonal();
  const at::Tensor d2 = (norms.unsqueeze(1) + norms.unsqueeze(0) - 2 * gram).clamp_min(0);
  const auto d = d2.accessor<double, 2>();
  const int64_t neighbours = std::max<int64_t>(1, std::min(n - 1, n - faulty - 2));
  std::vector<double> score(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> others;
    for (int64_t j = 0; j < n; ++j) {
      if (j != i) others.push_back(d[i][j]);
    }
    std::sort(others.begin(), others.end());
    for (int64_t k = 0; k < std::min<int64_t>(neighbours, static_cast<int64_t>(others.size()));
         ++k) {
      score[static_cast<size_t>(i)] += others[static_cast<size_t>(k)];
    }
  }
  std::vector<size_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return score[a] < score[b]; });
  order.resize(static_cast<size_t>(std::clamp<int64_t>(m, 1, n)));
  return order;
}

at::Tensor clipped_mean(const std::vector<at::Tensor>& updates, const std::vector<double>& weights,
                        double clip) {
  const at::Tensor x = rows(updates, "clipped mean");
  DTRAIN_CHECK(weights.size() == updates.size(), "clipped mean: one weight per update");
  const at::Tensor norms = x.norm(2, {1});
  if (clip <= 0) {
    // The median norm (the mean of the two middle ones for an even count).
    const at::Tensor sorted = std::get<0>(norms.sort());
    const int64_t n = sorted.size(0);
    clip = n % 2 == 1 ? sorted[n / 2].item<double>()
                      : 0.5 * (sorted[n / 2 - 1].item<double>() + sorted[n / 2].item<double>());
  }
  const at::Tensor scale = (clip / norms.clamp_min(1e-300)).clamp_max(1.0);
  const at::Tensor w = at::tensor(weights, at::kDouble);
  const at::Tensor mean = (x * (scale * w).unsqueeze(1)).sum(0) / w.sum();
  return mean.to(updates[0].scalar_type());
}

ByzantineSpec parse_byzantine(const std::string& text) {
  ByzantineSpec spec;
  if (text == "none" || text.empty()) return spec;
  const auto bad = [&](const std::string& why) {
    DTRAIN_THROW(InputError, "--byzantine '", text, "': ", why,
                 " (expected F:KIND[:S], KIND sign-flip, scaled, gaussian or label-flip, "
                 "F the faulty fraction of the clients in [0, 1))");
  };
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t colon; (colon = text.find(':', start)) != std::string::npos; start = colon + 1) {
    parts.push_back(text.substr(start, colon - start));
  }
  parts.push_back(text.substr(start));
  if (parts.size() < 2 || parts.size() > 3) bad("wrong number of fields");
  if (!parse_finite_number(parts[0], &spec.fraction) || spec.fraction < 0 || spec.fraction >= 1) {
    bad("the fraction '" + parts[0] + "' is not in [0, 1)");
  }
  const std::string& kind = parts[1];
  if (kind == "sign-flip") {
    spec.kind = ByzantineSpec::SignFlip;
  } else if (kind == "scaled") {
    spec.kind = ByzantineSpec::Scaled;
    spec.scale = 10.0;
  } else if (kind == "gaussian") {
    spec.kind = ByzantineSpec::Gaussian;
  } else if (kind == "label-flip") {
    spec.kind = ByzantineSpec::LabelFlip;
  } else {
    bad("unknown kind '" + kind + "'");
  }
  if (parts.size() == 3) {
    if (spec.kind == ByzantineSpec::LabelFlip) bad("label-flip takes no scale");
    if (!parse_finite_number(parts[2], &spec.scale) || spec.scale <= 0) {
      bad("the scale '" + parts[2] + "' is not a number > 0");
    }
  }
  return spec;
}

std::string to_string(const ByzantineSpec& spec) {
  static const char* names[] = {"none", "sign-flip", "scaled", "gaussian", "label-flip"};
  if (!spec.enabled()) return "none";
  std::string out = concat(spec.fraction, ":", names[spec.kind]);
  if (spec.kind != ByzantineSpec::LabelFlip) out += concat(":", spec.scale);
  return out;
}

std::vector<bool> faulty_clients(const ByzantineSpec& spec, int64_t clients, uint64_t seed) {
  std::vector<bool> faulty(static_cast<size_t>(clients), false);
  if (!spec.enabled()) return faulty;
  std::vector<int64_t> order(static_cast<size_t>(clients));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::mt19937_64 rng(seed ^ 0xB12A7714EULL);
  std::shuffle(order.begin(), order.end(), rng);
  const auto count =
      static_cast<size_t>(std::llround(spec.fraction * static_cast<double>(clients)));
  for (size_t i = 0; i < count; ++i) faulty[static_cast<size_t>(order[i])] = true;
  return faulty;
}

at::Tensor attack(const ByzantineSpec& spec, const at::Tensor& delta, uint64_t seed) {
  switch (spec.kind) {
    case ByzantineSpec::SignFlip:
      return delta * -spec.scale;
    case ByzantineSpec::Scaled:
      return delta * spec.scale;
    case ByzantineSpec::Gaussian: {
      at::Generator generator = at::detail::createCPUGenerator(seed);
      return at::randn(delta.sizes(), generator, delta.scalar_type()) * spec.scale;
    }
    default:
      return delta;
  }
}

at::Tensor flip_labels(const at::Tensor& targets, int64_t classes) {
  return (classes - 1) - targets;
}

}  // namespace dtrain::services::federated
