// `dtrain fl serve`: the federated server as a gRPC service (proto/dtrain/federated.proto)
// around RoundServer. Clients check in and wait; a round starts when K of them are waiting (or,
// after --selection-timeout, at least --min-clients), selects K at random (seeded by the round),
// tells them to train with the round's plan, streams them the global model and takes their
// (possibly compressed) updates until all arrive or the round's deadline passes; stragglers are
// dropped and the round is applied if at least --min-clients finished, else retried with a new
// selection. Per round: a metrics line, the progress bar, the checkpoint (resumed at start).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/Compression.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Robust.h"

namespace dtrain::services::federated {

struct ServerOptions {
  /// HOST:PORT (port 0: any free port; see Server::port()).
  std::string listen = "0.0.0.0:0";
  int64_t rounds = 10;
  /// The rounds' rules (Aggregator.h, RoundServer.h): K (clients_per_round), min_clients (also
  /// the fewest waiting clients a round starts with after selection_timeout_s), the aggregator,
  /// the clients' plan, N (population: 0 = the most ever waiting at once), the seed,
  /// differential privacy (clients clip to dp.clip, told in the plan; the server refuses updates
  /// above it and adds the noise; epsilon is reported with the sampling rate K / (clients seen
  /// so far), an upper bound of the true rate), secure aggregation and buffered aggregation
  /// (buffer.size > 0: no rounds - a client that checks in starts training from the current
  /// model whenever fewer than buffer.concurrency are, each with its own --round-timeout, its
  /// update is taken whenever it arrives, weighted by its staleness, and every buffer.size of
  /// them are applied as one step: what --rounds, the records and checkpoints count; not with
  /// secure aggregation).
  RoundServerOptions round;
  /// Seconds a round waits for the selected clients' updates.
  double round_timeout_s = 120;
  /// Seconds to wait for K waiting clients before starting a round with fewer (at least
  /// min_clients of them).
  double selection_timeout_s = 30;
  /// Seconds without enough clients (fewer than min_clients waiting) before giving up.
  double wait_timeout_s = 600;
  comm::CompressionSpec compression;
  /// The model as clients built from flags make it (told to them at selection).
  std::string model = "mlp";
  std::vector<int64_t> hidden{200, 200};
  /// A shared token every call must carry ("" = none) ...
  std::string token;
  /// ... or one per client id (client -> token; every call must carry its client's).
  std::map<std::string, std::string> client_tokens;
  /// TLS: PEM certificate chain and key files (both or neither).
  std::string tls_cert, tls_key;
  /// Server checkpoint DIR/server.pt after every applied round; resumed at start.
  std::string checkpoint_dir;
  std::string metrics_file;
  bool progress = true;
  /// Evaluate the global model every this many rounds (and after the last).
  int64_t eval_every = 1;
  /// Secure aggregation (round.secure_aggregation; Bonawitz et al. 2017): the server learns
  /// only each round's sum. Threshold t = ceil(secagg_threshold x K) (0: a majority); each of the
  /// protocol's steps but the masked inputs (which wait for training, until the round's deadline)
  /// waits at most secagg_step_timeout_s for the round's clients.
  double secagg_threshold = 0.0;
  /// SecAgg+ (parse_secagg_graph): 0 the full graph, -1 about 2 log2 K, kAutoGraph (sized for
  /// secagg_dropout, the expected fraction of a round's clients that leave), or an even degree.
  int secagg_graph = 0;
  double secagg_dropout = 0.2;
  double secagg_step_timeout_s = 30.0;
  int secagg_frac_bits = 16;
};

/// "client token" lines (# comments and blank lines skipped); InputError naming the file and
/// line for anything else, a duplicate client or a bad id.
std::map<std::string, std::string> read_client_tokens(const std::string& path);

struct ServerResult {
  std::vector<RoundRecord> rounds;
  int64_t start_round = 0, rounds_done = 0;
  at::Tensor global;
  /// Updates refused (and why, the last few), uploads too late.
  int64_t refused = 0, late = 0;
  std::vector<std::string> refusals;
  /// Clients' reports of running out of time in local training (the lines the server printed).
  std::vector<std::string> out_of_time;
};

class Server {
 public:
  /// `evaluate`: the global model's (test loss, test accuracy), or null for none.
  using Evaluate = std::function<std::pair<double, double>(const at::Tensor& global)>;
  Server(at::Tensor initial, ServerOptions options, Evaluate evaluate = nullptr);
  ~Server();
  int port() const;
  /// Rounds applied so far (more than 0 when resumed from a checkpoint).
  int64_t round() const;
  /// The address clients on this machine reach ("127.0.0.1:PORT" for a wildcard listen).
  std::string address() const;
  /// Runs the rounds; returns when the last is applied (clients checking in afterwards are told
  /// DONE for a few seconds, then the service stops).
  ServerResult run();
  /// Makes run() return after the current round (from another thread or a signal handler's
  /// watcher).
  void stop();

 private:
  class Service;
  std::unique_ptr<Service> service_;
};

}  // namespace dtrain::services::federated
