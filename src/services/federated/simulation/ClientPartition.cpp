#include "dtrain/services/federated/simulation/ClientPartition.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

PartitionSpec parse_partition(const std::string& text) {
  PartitionSpec spec;
  const auto colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  const std::string value = colon == std::string::npos ? "" : text.substr(colon + 1);
  auto number = [&](double* out) {
    try {
      size_t used = 0;
      *out = std::stod(value, &used);
      return used == value.size();
    } catch (const std::exception&) {
      return false;
    }
  };
  double x = 0;
  if (kind == "iid" && value.empty()) {
    spec.kind = PartitionSpec::Iid;
  } else if (kind == "shards" && number(&x) && x >= 1 && x == std::floor(x)) {
    spec.kind = PartitionSpec::Shards;
    spec.shards_per_client = static_cast<int64_t>(x);
  } else if (kind == "dirichlet" && number(&x) && x > 0 && std::isfinite(x)) {
    spec.kind = PartitionSpec::Dirichlet;
    spec.alpha = x;
  } else {
    DTRAIN_THROW(InputError, "--partition '", text,
                 "': expected iid, shards:K (K >= 1 shards of "
                 "sorted labels per client) or dirichlet:ALPHA (ALPHA > 0)");
  }
  return spec;
}

std::string to_string(const PartitionSpec& spec) {
  switch (spec.kind) {
    case PartitionSpec::Iid:
      return "iid";
    case PartitionSpec::Shards:
      return concat("shards:", spec.shards_per_client);
    case PartitionSpec::Dirichlet:
      return concat("dirichlet:", spec.alpha);
  }
  return "?";
}

namespace {

std::vector<int64_t> labels_of(const at::Tensor& targets) {
  const at::Tensor t = targets.to(at::kLong).contiguous();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

// Dirichlet label skew: for every class, proportions over the clients from Dir(alpha) (gamma
// draws normalized), its examples cut at the cumulative proportions. Redrawn (a bounded number
// of times) until every client holds enough examples to split into train and test.
std::vector<std::vector<int64_t>> dirichlet(const std::vector<int64_t>& labels, int64_t clients,
                                            double alpha, std::mt19937_64& rng,
                                            int64_t min_examples) {
  std::map<int64_t, std::vector<int64_t>> by_class;
  for (int64_t i = 0; i < static_cast<int64_t>(labels.size()); ++i)
    by_class[labels[i]].push_back(i);
  std::gamma_distribution<double> gamma(alpha, 1.0);
  std::vector<std::vector<int64_t>> out;
  constexpr int kAttempts = 100;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    out.assign(clients, {});
    for (auto& [label, members] : by_class) {
      std::shuffle(members.begin(), members.end(), rng);
      std::vector<double> p(clients);
      double sum = 0;
      for (auto& v : p) sum += (v = gamma(rng));
      if (sum <= 0) {  // every draw underflowed (tiny alpha): one client takes the class
        std::fill(p.begin(), p.end(), 0.0);
        p[std::uniform_int_distribution<int64_t>(0, clients - 1)(rng)] = sum = 1.0;
      }
      const auto n = static_cast<int64_t>(members.size());
      double cumulative = 0;
      int64_t begin = 0;
      for (int64_t c = 0; c < clients; ++c) {
        cumulative += p[c] / sum;
        const int64_t end =
            c + 1 == clients ? n : std::min<int64_t>(n, std::llround(cumulative * n));
        for (int64_t k = begin; k < end; ++k) out[c].push_back(members[k]);
        begin = std::max(begin, end);
      }
    }
    const bool enough = std::all_of(out.begin(), out.end(), [&](const std::vector<int64_t>& v) {
      return static_cast<int64_t>(v.size()) >= min_examples;
    });
    if (enough) return out;
  }
  DTRAIN_THROW(InputError, "--partition dirichlet:", alpha, ": in ", kAttempts,
               " draws some of the ", clients, " clients always got fewer than ", min_examples,
               " of the ", labels.size(), " examples (fewer clients or a larger alpha)");
}

}  // namespace

std::vector<ClientIndices> partition(const at::Tensor& targets, int64_t clients,
                                     const PartitionSpec& spec, uint64_t seed,
                                     double test_fraction) {
  const std::vector<int64_t> labels = labels_of(targets);
  const auto n = static_cast<int64_t>(labels.size());
  DTRAIN_CHECK_INPUT(clients >= 1, "--clients must be >= 1, got ", clients);
  DTRAIN_CHECK_INPUT(test_fraction >= 0 && test_fraction < 1,
                     "--local-test-fraction must be in [0, 1), got ", test_fraction);
  // Every client keeps at least one training example after its test share is held out.
  const auto min_examples = static_cast<int64_t>(std::ceil(1.0 / (1.0 - test_fraction)));
  DTRAIN_CHECK_INPUT(n >= clients * min_examples, "cannot cut ", n, " examples into ", clients,
                     " clients of at least ", min_examples, " examples");
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int64_t>> members(clients);
  if (spec.kind == PartitionSpec::Iid) {
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t c = 0; c < clients; ++c) {
      members[c].assign(order.begin() + c * n / clients, order.begin() + (c + 1) * n / clients);
    }
  } else if (spec.kind == PartitionSpec::Shards) {
    const int64_t shards = clients * spec.shards_per_client;
    DTRAIN_CHECK_INPUT(n >= shards * min_examples, "--partition shards:", spec.shards_per_client,
                       ": ", n, " examples cannot make ", shards, " shards for ", clients,
                       " clients");
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);  // ties within a class in random order
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return labels[a] < labels[b]; });
    std::vector<int64_t> shard_ids(shards);
    std::iota(shard_ids.begin(), shard_ids.end(), 0);
    std::shuffle(shard_ids.begin(), shard_ids.end(), rng);
    for (int64_t c = 0; c < clients; ++c) {
      for (int64_t k = 0; k < spec.shards_per_client; ++k) {
        const int64_t s = shard_ids[c * spec.shards_per_client + k];
        members[c].insert(members[c].end(), order.begin() + s * n / shards,
                          order.begin() + (s + 1) * n / shards);
      }
    }
  } else {
    members = dirichlet(labels, clients, spec.alpha, rng, min_examples);
  }
  std::vector<ClientIndices> out(clients);
  for (int64_t c = 0; c < clients; ++c) {
    std::vector<int64_t>& mine = members[c];
    std::shuffle(mine.begin(), mine.end(), rng);
    const auto total = static_cast<int64_t>(mine.size());
    const int64_t test =
        std::min<int64_t>(total - 1, static_cast<int64_t>(std::floor(test_fraction * total)));
    out[c].train.assign(mine.begin(), mine.end() - test);
    out[c].test.assign(mine.end() - test, mine.end());
  }
  return out;
}

ClientPopulation::ClientPopulation(const at::Tensor& targets, int64_t clients,
                                   const PartitionSpec& spec, uint64_t seed, double test_fraction,
                                   int64_t examples_per_client)
    : clients_(clients),
      spec_(spec),
      seed_(seed),
      test_fraction_(test_fraction),
      per_client_(examples_per_client) {
  DTRAIN_CHECK_INPUT(clients >= 1, "--clients must be >= 1, got ", clients);
  DTRAIN_CHECK_INPUT(test_fraction >= 0 && test_fraction < 1,
                     "--local-test-fraction must be in [0, 1), got ", test_fraction);
  DTRAIN_CHECK_INPUT(examples_per_client >= 1, "--client-examples must be >= 1, got ",
                     examples_per_client);
  const int64_t n = targets.numel();
  if (n >= clients * examples_per_client) {
    dealt_ = partition(targets, clients, spec, seed, test_fraction);
    return;
  }
  DTRAIN_CHECK_INPUT(examples_per_client <= n, "--client-examples ", examples_per_client,
                     " is more than the ", n, " training examples");
  const std::vector<int64_t> labels = labels_of(targets);
  for (int64_t i = 0; i < n; ++i) {
    const auto label = static_cast<size_t>(labels[static_cast<size_t>(i)]);
    if (by_class_.size() <= label) by_class_.resize(label + 1);
    by_class_[label].push_back(i);
  }
}

ClientIndices ClientPopulation::client(int64_t c) const {
  DTRAIN_CHECK(c >= 0 && c < clients_, "client ", c, " of a population of ", clients_);
  if (!dealt_.empty()) return dealt_[static_cast<size_t>(c)];
  // The client's own draws: (seed, client) only.
  std::seed_seq seq{seed_, static_cast<uint64_t>(c), uint64_t{0x9091A7E5}};
  std::mt19937_64 rng(seq);
  std::vector<size_t> classes;  // the non-empty ones
  for (size_t k = 0; k < by_class_.size(); ++k) {
    if (!by_class_[k].empty()) classes.push_back(k);
  }
  // How many examples of each class this client holds.
  std::vector<int64_t> count(by_class_.size(), 0);
  if (spec_.kind == PartitionSpec::Shards) {
    std::shuffle(classes.begin(), classes.end(), rng);
    const auto k = static_cast<int64_t>(
        std::min<size_t>(classes.size(), static_cast<size_t>(spec_.shards_per_client)));
    for (int64_t j = 0; j < per_client_; ++j) ++count[classes[static_cast<size_t>(j % k)]];
  } else {
    std::vector<double> weight(classes.size(), 1.0);
    if (spec_.kind == PartitionSpec::Dirichlet) {
      std::gamma_distribution<double> gamma(spec_.alpha, 1.0);
      double sum = 0;
      for (auto& w : weight) sum += (w = gamma(rng));
      if (sum <= 0) {  // every draw underflowed (tiny alpha): one class
        std::fill(weight.begin(), weight.end(), 0.0);
        weight[std::uniform_int_distribution<size_t>(0, weight.size() - 1)(rng)] = 1.0;
      }
    } else {
      // iid: in proportion to the classes' sizes.
      for (size_t j = 0; j < classes.size(); ++j) {
        weight[j] = static_cast<double>(by_class_[classes[j]].size());
      }
    }
    std::discrete_distribution<size_t> pick(weight.begin(), weight.end());
    for (int64_t j = 0; j < per_client_; ++j) ++count[classes[pick(rng)]];
  }
  std::vector<int64_t> mine;
  for (size_t k = 0; k < by_class_.size(); ++k) {
    const auto& members = by_class_[k];
    const int64_t want = std::min<int64_t>(count[k], static_cast<int64_t>(members.size()));
    // Distinct examples of the class (few against its size: rejection is cheap).
    std::set<int64_t> chosen;
    std::uniform_int_distribution<size_t> any(0, members.size() - 1);
    while (static_cast<int64_t>(chosen.size()) < want) chosen.insert(members[any(rng)]);
    mine.insert(mine.end(), chosen.begin(), chosen.end());
  }
  std::shuffle(mine.begin(), mine.end(), rng);
  ClientIndices out;
  const auto total = static_cast<int64_t>(mine.size());
  const int64_t test =
      std::min<int64_t>(total - 1, static_cast<int64_t>(std::floor(test_fraction_ * total)));
  out.train.assign(mine.begin(), mine.end() - test);
  out.test.assign(mine.end() - test, mine.end());
  return out;
}

ClientIndices partition_slice(const at::Tensor& targets, int64_t index, int64_t count,
                              double test_fraction) {
  DTRAIN_CHECK_INPUT(count >= 1 && index >= 0 && index < count, "--partition ", index, "/", count,
                     ": expected I/N with 0 <= I < N");
  PartitionSpec spec;
  spec.kind = PartitionSpec::Shards;
  spec.shards_per_client = 2;
  return partition(targets, count, spec, 0, test_fraction)[index];
}

int64_t classes_among(const at::Tensor& targets, const std::vector<int64_t>& indices) {
  const std::vector<int64_t> labels = labels_of(targets);
  std::set<int64_t> seen;
  for (const int64_t i : indices) seen.insert(labels[i]);
  return static_cast<int64_t>(seen.size());
}

ClientIndices client_examples(const at::Tensor& targets, const std::string& partition,
                              double test_fraction, uint64_t seed) {
  DTRAIN_CHECK_INPUT(test_fraction >= 0 && test_fraction < 1,
                     "--local-test-fraction must be in [0, 1), got ", test_fraction);
  if (!partition.empty()) {
    long long index = -1, count = -1;
    char extra = 0;
    DTRAIN_CHECK_INPUT(std::sscanf(partition.c_str(), "%lld/%lld%c", &index, &count, &extra) == 2 &&
                           count >= 1 && index >= 0 && index < count,
                       "--partition '", partition, "': expected I/N with 0 <= I < N");
    return partition_slice(targets, index, count, test_fraction);
  }
  // Its own examples: a seeded shuffle, the last share held out (none by default).
  ClientIndices mine;
  mine.train.resize(static_cast<size_t>(targets.size(0)));
  std::iota(mine.train.begin(), mine.train.end(), 0);
  const auto test =
      static_cast<int64_t>(std::floor(test_fraction * static_cast<double>(mine.train.size())));
  DTRAIN_CHECK_INPUT(static_cast<int64_t>(mine.train.size()) - test >= 1, "--local-test-fraction ",
                     test_fraction, " leaves none of the ", mine.train.size(),
                     " examples to train on");
  if (test > 0) {
    std::shuffle(mine.train.begin(), mine.train.end(), std::mt19937_64(seed));
    mine.test.assign(mine.train.end() - test, mine.train.end());
    mine.train.resize(mine.train.size() - static_cast<size_t>(test));
  }
  return mine;
}

}  // namespace dtrain::services::federated
