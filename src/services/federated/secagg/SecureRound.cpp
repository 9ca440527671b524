#include "services/federated/secagg/SecureRound.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "dtrain/comm/Compression.h"
#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t reveal_bytes(const secagg::Reveal& r) {
  int64_t bytes = 4;
  for (const auto& entry : r.b_shares) bytes += 4 + 8 * static_cast<int64_t>(entry.second.size());
  for (const auto& entry : r.sk_shares) bytes += 4 + 8 * static_cast<int64_t>(entry.second.size());
  return bytes;
}

}  // namespace

at::Tensor secure_input(const ClientUpdate& update, int64_t weight, int64_t ref, int frac_bits,
                        double bound) {
  const double scale = static_cast<double>(weight) / static_cast<double>(ref);
  const at::Tensor weighted = at::cat(
      {update.delta.to(at::kDouble) * scale, at::full({1}, update.loss * scale, at::kDouble)});
  return at::cat({secagg::to_fixed(weighted, frac_bits, bound), at::full({1}, weight, at::kInt)});
}

SecureSum secure_sum(const at::Tensor& sum, int64_t numel, int64_t ref, int frac_bits) {
  const at::Tensor values = secagg::from_fixed(sum.narrow(0, 0, numel + 1), frac_bits);
  SecureSum out;
  // Sums of (weight / ref) x update: back to weighted sums.
  out.weighted_sum = values.narrow(0, 0, numel) * static_cast<double>(ref);
  out.loss_sum = values[numel].item<double>() * static_cast<double>(ref);
  out.weight = static_cast<double>(sum[numel + 1].item<int32_t>());
  return out;
}

SecureRound::SecureRound(const std::vector<std::string>& selected,
                         const std::vector<int64_t>& examples, int64_t numel, int threshold,
                         int frac_bits, int degree, uint64_t graph_seed)
    : selected_(selected), numel_(numel), frac_bits_(frac_bits) {
  const auto n = selected.size();
  DTRAIN_CHECK_INPUT(n >= 2, "secure aggregation needs at least 2 clients per round, got ", n);
  const int holders = degree > 0 ? degree + 1 : static_cast<int>(n);
  DTRAIN_CHECK_INPUT(threshold >= 2 && threshold <= holders,
                     "the secure-aggregation threshold must be in [2, ", holders, "], got ",
                     threshold, degree > 0 ? " (SecAgg+: a neighbourhood holds degree + 1)" : "");
  weights_ = examples;
  ref_ = *std::max_element(examples.begin(), examples.end());
  bound_ = secagg::fixed_bound(frac_bits_, static_cast<int64_t>(n));
  // Elements: the weighted update, the weighted loss, the example count.
  const int64_t elements = numel_ + 2;
  sent_.assign(n, 0);
  client_s_.assign(n, 0.0);
  auto start = Clock::now();
  server_ = std::make_unique<secagg::ServerSession>(elements, threshold);
  std::map<uint32_t, std::vector<uint32_t>> graph;
  if (degree > 0) {
    std::vector<uint32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 1u);
    graph = secagg::neighbour_graph(ids, degree, graph_seed);
    server_->set_graph(graph);
  }
  server_s_ += since(start);
  // Keys, then shares, routed by the server.
  for (size_t i = 0; i < n; ++i) {
    start = Clock::now();
    clients_.push_back(
        std::make_unique<secagg::ClientSession>(static_cast<uint32_t>(i + 1), elements, threshold));
    if (degree > 0) clients_.back()->set_neighbours(graph.at(static_cast<uint32_t>(i + 1)));
    const secagg::PublicKeys keys = clients_.back()->advertise();
    client_s_[i] += since(start);
    uplink_ += 4 + 64;
    start = Clock::now();
    server_->add_keys(keys);
    server_s_ += since(start);
  }
  start = Clock::now();
  const auto u1 = server_->advertised();
  server_s_ += since(start);
  for (size_t i = 0; i < n; ++i) {
    start = Clock::now();
    const auto sealed = clients_[i]->share_keys(u1);
    client_s_[i] += since(start);
    for (const auto& s : sealed) uplink_ += 8 + static_cast<int64_t>(s.ciphertext.size());
    start = Clock::now();
    server_->add_shares(sealed);
    server_s_ += since(start);
  }
  start = Clock::now();
  u2_ = server_->shared();
  std::vector<std::vector<secagg::SealedShares>> inbox;
  for (size_t i = 0; i < n; ++i) inbox.push_back(server_->shares_for(static_cast<uint32_t>(i + 1)));
  server_s_ += since(start);
  for (size_t i = 0; i < n; ++i) {
    start = Clock::now();
    clients_[i]->receive(inbox[i]);
    client_s_[i] += since(start);
  }
}

void SecureRound::mask(size_t i, const ClientUpdate& update) {
  const auto start = Clock::now();
  // The weight given for client i: its examples (all 1 with differential privacy).
  const at::Tensor input = secure_input(update, weights_[i], ref_, frac_bits_, bound_);
  const at::Tensor masked = clients_[i]->masked_input(input, u2_);
  client_s_[i] += since(start);
  uplink_ += 4 + 4 * masked.numel();
  // The server adds it to its sum on arrival, as a deployed one does (it holds one sum, not an
  // input per client).
  std::lock_guard<std::mutex> lock(server_mutex_);
  const auto arrived = Clock::now();
  server_->add_masked(static_cast<uint32_t>(i + 1), masked);
  sent_[i] = 1;
  server_s_ += since(arrived);
}

double SecureRound::client_masks() const {
  int64_t sum = 0, count = 0;
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (!sent_[i]) continue;
    sum += clients_[i]->mask_expansions();
    ++count;
  }
  return count > 0 ? static_cast<double>(sum) / static_cast<double>(count) : 0.0;
}

double SecureRound::client_seconds() const {
  // A sending client's (as client_masks): a dropout did less.
  double sum = 0;
  int64_t count = 0;
  for (size_t i = 0; i < clients_.size(); ++i) {
    if (!sent_[i]) continue;
    sum += client_s_[i];
    ++count;
  }
  return count > 0 ? sum / static_cast<double>(count) : 0.0;
}

std::string SecureRound::finish(RoundServer& server) {
  auto start = Clock::now();
  std::vector<std::string> finished;
  for (size_t i = 0; i < sent_.size(); ++i) {
    if (sent_[i]) finished.push_back(selected_[i]);
  }
  std::vector<uint32_t> u3;
  try {
    u3 = server_->masked();
  } catch (const Error& e) {
    server_s_ += since(start);
    return e.what();
  }
  server_s_ += since(start);
  for (const uint32_t id : u3) {
    start = Clock::now();
    const secagg::Reveal reveal = clients_[id - 1]->reveal(u3);
    client_s_[id - 1] += since(start);
    uplink_ += reveal_bytes(reveal);
    start = Clock::now();
    server_->add_reveal(reveal);
    server_s_ += since(start);
  }
  start = Clock::now();
  at::Tensor sum;
  try {
    sum = server_->finish();
  } catch (const Error& e) {
    // Too few shares of some secret (with SecAgg+: in some neighbourhood): the masks cannot
    // come off; the round has no updates and is retried.
    server_s_ += since(start);
    return e.what();
  }
  const SecureSum total = secure_sum(sum, numel_, ref_, frac_bits_);
  const std::string why =
      server.submit_sum(total.weighted_sum, total.weight, finished, total.loss_sum);
  server_s_ += since(start);
  return why;
}

}  // namespace dtrain::services::federated
