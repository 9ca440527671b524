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

namespace dtrain::services::federated {

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

/// Every client's examples, made when asked for. While the set can give each of the clients at
/// least `examples_per_client` examples it is dealt by partition() (computed once, kept);
/// beyond that (a population larger than the set: `fl simulate --clients 1000000`) each client
/// draws examples_per_client distinct examples from the set by (seed, client) when it is
/// selected, label-skewed by the partition's rule: iid draws uniformly, shards:K draws K classes
/// and then its examples from them evenly, dirichlet:ALPHA draws class proportions from
/// Dir(ALPHA) and each example's class from them. Either way a client is the same whenever and
/// however often it is made.
class ClientPopulation {
 public:
  ClientPopulation(const at::Tensor& targets, int64_t clients, const PartitionSpec& spec,
                   uint64_t seed, double test_fraction = 0.2, int64_t examples_per_client = 50);
  int64_t size() const { return clients_; }
  /// Whether clients draw their examples (else the set is dealt).
  bool sampled() const { return dealt_.empty(); }
  /// Client `c`'s examples (0 <= c < size()).
  ClientIndices client(int64_t c) const;

 private:
  int64_t clients_;
  PartitionSpec spec_;
  uint64_t seed_;
  double test_fraction_;
  int64_t per_client_;
  std::vector<ClientIndices> dealt_;
  std::vector<std::vector<int64_t>> by_class_;  // sampled: each class's example indices
};

/// The I-th of N label-skewed slices (`--partition I/N` of `dtrain fl client`): shards:2 of the
/// set with seed 0, client I.
ClientIndices partition_slice(const at::Tensor& targets, int64_t index, int64_t count,
                              double test_fraction = 0.2);

/// A `dtrain fl client`'s examples of a set with labels `targets`: the I-th of N slices for
/// `partition` "I/N" (partition_slice), or for "" all of them in a shuffle by `seed` with the
/// last `test_fraction` held out. InputError naming --partition or --local-test-fraction.
ClientIndices client_examples(const at::Tensor& targets, const std::string& partition,
                              double test_fraction, uint64_t seed);

/// Distinct labels among `indices` (a skew measure for reports and tests).
int64_t classes_among(const at::Tensor& targets, const std::vector<int64_t>& indices);

}  // namespace dtrain::services::federated
