// SecAgg+'s graph (Bell et al. 2020): who a client masks and shares with, the degree a round
// uses, and its threshold. The protocol itself is SecureAggregation.cpp's.
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/SecureAggregation.h"

namespace dtrain::federated::secagg {

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

int parse_secagg_graph(const std::string& text) {
  if (text == "full") return 0;
  if (text == "log") return -1;
  char* end = nullptr;
  const long k = std::strtol(text.c_str(), &end, 10);
  DTRAIN_CHECK_INPUT(!text.empty() && *end == '\0' && k >= 2 && k % 2 == 0 && k < 1000000,
                     "--secagg-graph '", text,
                     "': expected full, log or an even degree K >= 2 (SecAgg+)");
  return static_cast<int>(k);
}

int round_degree(int graph, int64_t n) {
  if (graph == 0) return 0;
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

}  // namespace dtrain::federated::secagg
