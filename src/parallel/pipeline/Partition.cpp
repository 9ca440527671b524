// Linear partitioning by dynamic programming (exact; stages and ranks are few).
#include "dtrain/parallel/pipeline/Partition.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::pipeline {

Partition balanced_partition(const std::vector<double>& costs, int ranks,
                             const std::vector<int>& replicas) {
  const int n = static_cast<int>(costs.size());
  DTRAIN_CHECK(replicas.empty() || static_cast<int>(replicas.size()) == ranks,
               "balanced_partition: ", replicas.size(), " replica counts for ", ranks, " ranks");
  DTRAIN_CHECK_INPUT(ranks >= 1, "pipeline stages must be >= 1, got ", ranks);
  DTRAIN_CHECK_INPUT(n >= ranks, "the model has ", n, " stage", n == 1 ? "" : "s",
                     ", fewer than the ", ranks,
                     " pipeline ranks asked for (each rank needs at least one)");
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest maximum load placing stages [0, i) on k ranks.
  std::vector<std::vector<double>> best(ranks + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(ranks + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= ranks; ++k) {
    for (int i = k; i <= n - (ranks - k); ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double share = replicas.empty() ? 1.0 : replicas[k - 1];
        const double load = std::max(best[k - 1][j], (prefix[i] - prefix[j]) / share);
        if (load < best[k][i]) {  // strict: ties keep the earliest cut
          best[k][i] = load;
          cut[k][i] = j;
        }
      }
    }
  }
  Partition p;
  p.begin.assign(ranks + 1, 0);
  p.begin[ranks] = n;
  for (int k = ranks, i = n; k > 0; --k) {
    i = cut[k][i];
    p.begin[k - 1] = i;
  }
  return p;
}

Partition partition_from_counts(const std::string& text, int stages, int ranks) {
  Partition p;
  p.begin.push_back(0);
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    DTRAIN_CHECK_INPUT(!item.empty() && item.size() <= 6 &&
                           item.find_first_not_of("0123456789") == std::string::npos &&
                           std::stoi(item) >= 1,
                       "--pipeline-balance '", text,
                       "': expects stages per rank as whole numbers >= 1 (e.g. 3,2)");
    p.begin.push_back(p.begin.back() + std::stoi(item));
    start = comma + 1;
  }
  DTRAIN_CHECK_INPUT(p.ranks() == ranks, "--pipeline-balance '", text, "' gives ", p.ranks(),
                     " ranks, the pipeline has ", ranks);
  DTRAIN_CHECK_INPUT(p.begin.back() == stages, "--pipeline-balance '", text, "' places ",
                     p.begin.back(), " stages, the model has ", stages);
  return p;
}

std::vector<double> shares(const Partition& partition, const std::vector<double>& costs) {
  const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
  std::vector<double> out;
  for (int r = 0; r < partition.ranks(); ++r) {
    double sum = 0;
    for (int s = partition.first(r); s < partition.end(r); ++s) sum += costs[s];
    out.push_back(total > 0 ? sum / total : 0.0);
  }
  return out;
}

}  // namespace dtrain::parallel::pipeline
