// One round of secure aggregation inside the simulation: a session per selected client and
// the server's, the protocol's steps in the order a deployment runs them (keys and shares
// before training, masked inputs after it, reveals once the server knows who sent one), each
// side's time measured. A client's input is its update weighted by examples / ref (ref: the
// largest selected client's examples, public), its loss likewise, in fixed point, and its
// example count as an integer: the server learns only their sums.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"

namespace dtrain::services::federated {

/// A client's input to secure aggregation: its update and loss times weight / ref in fixed point
/// (clipped to `bound`), then `weight` as an integer (weight: its examples, or 1 for equal
/// weights; ref: the round's largest weight, public).
at::Tensor secure_input(const ClientUpdate& update, int64_t weight, int64_t ref, int frac_bits,
                        double bound);

/// What the unmasked sum of secure_input()s holds: the weighted sum of updates, the sum of
/// weights and the weighted sum of losses.
struct SecureSum {
  at::Tensor weighted_sum;
  double weight = 0.0, loss_sum = 0.0;
};
SecureSum secure_sum(const at::Tensor& sum, int64_t numel, int64_t ref, int frac_bits);

class SecureRound {
 public:
  /// `examples[i]`: selected client i's example count; `threshold`: t (>= 2, <= the clients;
  /// with a graph, <= degree + 1). `degree` > 0: SecAgg+ on the round's graph drawn from
  /// `graph_seed` (0: the classic full graph).
  SecureRound(const std::vector<std::string>& selected, const std::vector<int64_t>& examples,
              int64_t numel, int threshold, int frac_bits, int degree = 0, uint64_t graph_seed = 0);
  /// Client i's masked input of `update`, added to the server's sum as it arrives (thread-safe
  /// across different i).
  void mask(size_t i, const ClientUpdate& update);
  /// Unmasks the sum of the masked inputs and submits it to `server`; "" or why not.
  std::string finish(RoundServer& server);

  double server_seconds() const { return server_s_; }
  /// Mean over the clients that sent their masked input (their whole protocol's time).
  double client_seconds() const;
  int64_t uplink_bytes() const { return uplink_; }
  /// Masks expanded: by the server, and by a client on average (the ChaCha20 floor's count).
  int64_t server_masks() const { return server_->mask_expansions(); }
  double client_masks() const;

 private:
  const std::vector<std::string> selected_;
  const int64_t numel_;
  const int frac_bits_;
  std::vector<int64_t> weights_;
  int64_t ref_ = 1;
  double bound_ = 0.0;
  std::vector<std::unique_ptr<secagg::ClientSession>> clients_;
  std::unique_ptr<secagg::ServerSession> server_;
  std::vector<char> sent_;  // client i sent its masked input
  std::vector<double> client_s_;
  std::mutex server_mutex_;  // the server session and its time, as inputs arrive
  double server_s_ = 0.0;
  std::atomic<int64_t> uplink_{0};
  std::vector<uint32_t> u2_;
};

}  // namespace dtrain::services::federated
