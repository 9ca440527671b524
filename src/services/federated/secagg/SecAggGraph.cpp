// SecAgg+'s graph (Bell et al. 2020): who a client masks and shares with, the degree a round
// uses, and its threshold. The protocol itself is SecureAggregation.cpp's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"

namespace dtrain::services::federated::secagg {

std::map<uint32_t, std::vector<uint32_t>> neighbour_graph(std::vector<uint32_t> ids, int degree,
                                                          uint64_t seed) {
  const auto n = static_cast<int64_t>(ids.size());
  DTRAIN_CHECK_INPUT(degree >= 2 && degree % 2 == 0, "SecAgg+ needs an even degree >= 2, got ",
                     degree);
  DTRAIN_CHECK_INPUT(degree < n - 1, "SecAgg+ degree ", degree, " is not below the round's ", n,
                     " clients - 1: that is the full graph (the classic protocol)");
  std::sort(ids.begin(), ids.end());
  // Fisher-Yates with splitmix64: the same order on every platform (std::shuffle's is not).
  uint64_t state = seed;
  auto next = [&state] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(ids[static_cast<size_t>(i)], ids[next() % static_cast<uint64_t>(i + 1)]);
  }
  std::map<uint32_t, std::vector<uint32_t>> graph;
  for (int64_t i = 0; i < n; ++i) {
    auto& mine = graph[ids[static_cast<size_t>(i)]];
    for (int d = 1; d <= degree / 2; ++d) {
      mine.push_back(ids[static_cast<size_t>((i + d) % n)]);
      mine.push_back(ids[static_cast<size_t>((i - d + n) % n)]);
    }
    std::sort(mine.begin(), mine.end());
  }
  return graph;
}

int default_degree(int64_t n) {
  int k = 2 * static_cast<int>(std::ceil(std::log2(static_cast<double>(std::max<int64_t>(2, n)))));
  k += k % 2;
  const int64_t largest = (n - 2) - (n - 2) % 2;  // the largest even degree below n - 1
  if (largest < 2) return 0;
  return static_cast<int>(std::min<int64_t>(k, largest));
}

double binomial_below(int64_t m, double q, int64_t t) {
  if (t <= 0) return 0.0;
  if (t > m) return 1.0;
  if (q >= 1.0) return 0.0;
  if (q <= 0.0) return 1.0;
  const double log_q = std::log(q), log_p = std::log1p(-q);
  const double log_m = std::lgamma(static_cast<double>(m) + 1);
  double sum = 0.0;
  for (int64_t j = 0; j < t; ++j) {
    const auto jd = static_cast<double>(j), rest = static_cast<double>(m - j);
    sum +=
        std::exp(log_m - std::lgamma(jd + 1) - std::lgamma(rest + 1) + jd * log_q + rest * log_p);
  }
  return std::min(1.0, sum);
}

double unmask_failure_bound(int64_t n, int degree, int threshold, double dropout) {
  const double q = 1.0 - dropout;
  // The full graph: the round unmasks when at least t of its n clients are left.
  if (degree == 0) return binomial_below(n, q, threshold);
  // Client u's secret is held by u and its k neighbours: a dropped u's key needs t of its
  // neighbours, a survivor's self mask t - 1 of them besides itself. A union bound over the n
  // clients (each neighbourhood's count is binomial however they overlap).
  const double one =
      dropout * binomial_below(degree, q, threshold) + q * binomial_below(degree, q, threshold - 1);
  return std::min(1.0, static_cast<double>(n) * one);
}

int auto_degree(int64_t n, double threshold_fraction, double dropout, double max_failure) {
  DTRAIN_CHECK_INPUT(dropout >= 0 && dropout < 1, "--secagg-dropout must be a fraction in [0, 1), ",
                     "got ", dropout);
  int k = default_degree(n);
  if (k == 0 || dropout == 0) return k;
  const int largest = static_cast<int>((n - 2) - (n - 2) % 2);
  for (;;) {
    const int t = secagg_threshold(threshold_fraction, k + 1);
    if (t <= k + 1 && unmask_failure_bound(n, k, t, dropout) <= max_failure) return k;
    if (k >= largest) break;
    // Steps of about 6% (even): few tail sums however large the round.
    k = std::min(largest, k + std::max(2, (k / 16) & ~1));
  }
  return 0;  // no sparse graph is enough: the full one
}

void check_auto_graph(int64_t n, double threshold_fraction, double dropout, double max_failure) {
  if (auto_degree(n, threshold_fraction, dropout, max_failure) > 0) return;
  const int t = secagg_threshold(threshold_fraction, static_cast<int>(n));
  const double failure = unmask_failure_bound(n, 0, t, dropout);
  DTRAIN_CHECK_INPUT(
      failure <= max_failure, "--secagg-graph auto: with ", dropout * 100,
      "% dropouts (--secagg-dropout) and a threshold of ",
      threshold_fraction > 0 ? threshold_fraction : 0.5, " (--secagg-threshold), a round of ", n,
      " clients aborts with probability ", failure,
      " even on the full graph; lower --secagg-threshold below the survivors' share");
}

std::string describe_auto_degree(int64_t n, double threshold_fraction, double dropout,
                                 double max_failure) {
  const int k = auto_degree(n, threshold_fraction, dropout, max_failure);
  const int holders = k > 0 ? k + 1 : static_cast<int>(n);
  const int t = secagg_threshold(threshold_fraction, holders);
  char line[320];
  std::snprintf(line, sizeof line,
                "--secagg-graph auto: %s for rounds of %lld clients at %.0f%% dropouts (t = %d "
                "of %d holders of each secret): a round aborts with probability <= %.1e",
                k > 0 ? ("degree " + std::to_string(k)).c_str() : "the full graph",
                static_cast<long long>(n), dropout * 100, t, holders,
                std::max(unmask_failure_bound(n, k, t, dropout), 0.0));
  return line;
}

int parse_secagg_graph(const std::string& text) {
  if (text == "full") return 0;
  if (text == "log") return -1;
  if (text == "auto") return kAutoGraph;
  char* end = nullptr;
  const long k = std::strtol(text.c_str(), &end, 10);
  DTRAIN_CHECK_INPUT(!text.empty() && *end == '\0' && k >= 2 && k % 2 == 0 && k < 1000000,
                     "--secagg-graph '", text,
                     "': expected full, log, auto or an even degree K >= 2 (SecAgg+)");
  return static_cast<int>(k);
}

int round_degree(int graph, int64_t n, double threshold_fraction, double dropout) {
  if (graph == 0) return 0;
  if (graph == kAutoGraph) return auto_degree(n, threshold_fraction, dropout);
  if (graph < 0) return default_degree(n);
  DTRAIN_CHECK_INPUT(graph < n - 1, "--secagg-graph ", graph,
                     ": SecAgg+ degree larger than the round allows (", n, " clients: at most ",
                     n - 2, "; full is the classic protocol)");
  return graph;
}

int secagg_threshold(double fraction, int holders) {
  return std::max(2,
                  fraction > 0 ? static_cast<int>(std::ceil(fraction * holders)) : holders / 2 + 1);
}

}  // namespace dtrain::services::federated::secagg
