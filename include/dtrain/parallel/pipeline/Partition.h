// Placing a model's stages (Model::stages) on pipeline ranks: contiguous runs, balanced by a
// cost per stage (parameter count, measured time) or given by hand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::parallel::pipeline {

/// Rank r of the pipeline runs stages [begin[r], begin[r + 1]).
struct Partition {
  std::vector<int> begin;  // P + 1 entries, begin[0] = 0, begin[P] = number of stages
  int ranks() const { return static_cast<int>(begin.size()) - 1; }
  int first(int rank) const { return begin[rank]; }
  int end(int rank) const { return begin[rank + 1]; }
};

/// The contiguous split of `costs` over `ranks` ranks that minimizes the largest rank's total
/// (every rank gets at least one stage). InputError when there are fewer stages than ranks.
/// `replicas` (PipeDream's replicated stages): pipeline stage r's work is shared by
/// replicas[r] ranks, its load its total / replicas[r].
Partition balanced_partition(const std::vector<double>& costs, int ranks,
                             const std::vector<int>& replicas = {});

/// "S1,S2,...": stages per rank, which must sum to `stages` with each >= 1 (InputError naming
/// the text otherwise).
Partition partition_from_counts(const std::string& text, int stages, int ranks);

/// Each rank's share of the total cost, for the printed split.
std::vector<double> shares(const Partition& partition, const std::vector<double>& costs);

}  // namespace dtrain::parallel::pipeline
