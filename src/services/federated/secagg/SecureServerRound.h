// The federated server's side of one secure round over gRPC (Bonawitz et al.'s steps as the
// SecAgg RPC carries them): the protocol ids of the round's clients, the phase the round is in,
// who has sent which step, and the translation between the SecAgg messages and the
// secagg::ServerSession. No locking and no waiting here: the server's Service holds its mutex
// around every call and drives the phases (run_secure).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dtrain/federated.pb.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"

namespace dtrain::services::federated {

struct SecureServerRound {
  enum Phase { Keys, Shares, Masking, Reveal, Done, Aborted };

  /// Protocol ids 1..K in `chosen` order and t (`threshold_fraction` of K, 0 = a majority; at
  /// least 2); `ref` is the weight reference clients scale their inputs by (the largest example
  /// count of the chosen, or 1 for equal weights).
  /// `graph` (parse_secagg_graph) > 0 or -1: SecAgg+ on a graph drawn from `graph_seed`, t a
  /// fraction of a neighbourhood (degree + 1); "auto" sizes the degree for `dropout`.
  SecureServerRound(const std::vector<std::string>& chosen, double threshold_fraction, int64_t ref,
                    int64_t numel, int graph = 0, uint64_t graph_seed = 0, double dropout = 0.0);

  /// What happened to a step a client sent: applied, too late for its step (the round has
  /// moved on), malformed (the message's fields), or refused by the protocol (the session's
  /// checks: a duplicate, a share for an unknown client, ...); `why` says which field or check.
  struct StepResult {
    enum Kind { Applied, Late, Malformed, Refused };
    Kind kind = Applied;
    std::string why;
  };
  /// Applies client `me`'s step (KEYS, SHARES, REVEAL; SURVIVORS carries nothing).
  StepResult apply(const dtrain::fl::SecAggRequest& request, uint32_t me);

  /// The phase the reply to `step` waits for (the protocol has moved past the step).
  static Phase ready_at(dtrain::fl::SecAggRequest::Step step);
  /// The reply to `step` for client `me`: the advertised keys, the shares addressed to it, or
  /// the clients whose masked inputs arrived.
  void fill_reply(dtrain::fl::SecAggRequest::Step step, uint32_t me,
                  dtrain::fl::SecAggReply* reply) const;

  Phase phase = Keys;
  std::unique_ptr<secagg::ServerSession> session;
  std::map<std::string, uint32_t> ids;
  std::map<uint32_t, std::string> names;
  int threshold = 2;
  int64_t ref = 1;
  int degree = 0;  // SecAgg+'s (0: the full graph)
  uint64_t graph_seed = 0;
  std::set<uint32_t> sent_keys, sent_shares, sent_masked, sent_reveal;
  std::vector<secagg::PublicKeys> u1;
  std::vector<uint32_t> u2, u3;
  std::string abort_reason;
  double server_s = 0.0;
};

}  // namespace dtrain::services::federated
