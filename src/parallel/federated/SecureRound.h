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
#include <string>
#include <vector>

#include "dtrain/parallel/federated/FedAvg.h"
#include "dtrain/parallel/federated/RoundServer.h"
#include "dtrain/parallel/federated/SecureAggregation.h"

namespace dtrain::federated {

class SecureRound {
 public:
  /// `examples[i]`: selected client i's example count; `threshold`: t (>= 2, <= the clients).
  SecureRound(const std::vector<std::string>& selected, const std::vector<int64_t>& examples,
              int64_t numel, int threshold, int frac_bits);
  /// Client i's masked input of `update` (thread-safe across different i).
  void mask(size_t i, const ClientUpdate& update);
  /// Unmasks the sum of the masked inputs and submits it to `server`; "" or why not.
  std::string finish(RoundServer& server);

  double server_seconds() const { return server_s_; }
  /// Mean over the clients that took part.
  double client_seconds() const;
  int64_t uplink_bytes() const { return uplink_; }

 private:
  const std::vector<std::string> selected_;
  const int64_t numel_;
  const int frac_bits_;
  double ref_ = 1.0, bound_ = 0.0;
  std::vector<std::unique_ptr<secagg::ClientSession>> clients_;
  std::unique_ptr<secagg::ServerSession> server_;
  std::vector<at::Tensor> masked_;
  std::vector<double> client_s_;
  std::vector<std::string> errors_;
  double server_s_ = 0.0;
  std::atomic<int64_t> uplink_{0};
  std::vector<uint32_t> u2_;
};

}  // namespace dtrain::federated
