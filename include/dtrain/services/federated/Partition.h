// Federated data: a training set cut into clients the way the FedAvg literature does it - IID
// (a shuffle dealt out evenly), McMahan et al.'s pathological non-IID "shards" (examples sorted
// by label, cut into clients x K shards, K per client, so each client sees about K classes) and
// Dirichlet(alpha) label skew (each class spread over the clients in proportions drawn from a
// symmetric Dirichlet: small alpha, few classes per client). Each client's examples are then
// split into its own train and test parts (personalization is measured on the test parts).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::federated {

struct PartitionSpec {
  enum Kind { Iid, Shards, Dirichlet };
  Kind kind = Iid;
  /// Shards: shards (about classes) per client.
  int64_t shards_per_client = 2;
  /// Dirichlet: the concentration (> 0; small = skewed).
  double alpha = 0.5;
};

/// "iid", "shards:K" or "dirichlet:ALPHA" (InputError naming --partition otherwise).
PartitionSpec parse_partition(const std::string& text);
std::string to_string(const PartitionSpec& spec);

struct ClientIndices {
  /// Indices into the training set: the client's local training and test examples.
  std::vector<int64_t> train;
  std::vector<int64_t> test;
};

/// Cuts the examples with labels `targets` (int64 class indices) into `clients` clients, each
/// holding at least one training example, and holds out `test_fraction` of each client's
/// examples as its local test set. Deterministic in `seed`. InputError when the set is too
/// small for the request (fewer examples than clients, fewer than clients x K shards).
std::vector<ClientIndices> partition(const at::Tensor& targets, int64_t clients,
                                     const PartitionSpec& spec, uint64_t seed,
                                     double test_fraction = 0.2);

/// The I-th of N label-skewed slices (`--partition I/N` of `dtrain fl client`): shards:2 of the
/// set with seed 0, client I.
ClientIndices partition_slice(const at::Tensor& targets, int64_t index, int64_t count,
                              double test_fraction = 0.2);

/// Distinct labels among `indices` (a skew measure for reports and tests).
int64_t classes_among(const at::Tensor& targets, const std::vector<int64_t>& indices);

}  // namespace dtrain::federated
