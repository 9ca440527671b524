// A federated client (`dtrain fl client`, or embedded in an application with its own data and
// model): checks in with the server while it is available, and when selected downloads the
// round's model, trains it on its own examples as the round's plan says (epochs, batch, rate,
// FedProx's mu), compresses the update as the plan says (keeping top-k's error-feedback residual
// between rounds) and uploads it before the deadline. If its availability ends mid-round it
// leaves the round (the server drops it). Unreachable servers are retried with back-off within
// a window; every call has a deadline.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/data/Dataset.h"

namespace dtrain::services::federated {

/// When a client may train: local-time windows "HH:MM-HH:MM" (a window may cross midnight),
/// comma-separated; "always" for none. InputError naming --available otherwise.
std::function<bool()> parse_availability(const std::string& text);
/// The same windows at a given time of day (minutes after midnight): for tests and traces.
bool available_at(const std::string& text, int minute_of_day);

struct ClientOptions {
  /// HOST:PORT of `dtrain fl serve`.
  std::string server;
  /// 1 to 128 of [A-Za-z0-9._-].
  std::string client_id;
  /// The token this client's calls carry ("" = none); TLS: the CA file to trust.
  std::string token;
  bool tls = false;
  std::string tls_ca;
  /// Whether the client may train now (idle, charging, on Wi-Fi...); null = always. Checked
  /// before each check-in and between local batches.
  std::function<bool()> available;
  /// A check-in waits this long to be selected before asking again.
  std::chrono::milliseconds wait{10000};
  /// Deadline of every call (a download or upload: per call as a whole). Calls within a round
  /// (its secure-aggregation steps before the upload, the download, the upload) also end at
  /// the round's deadline: past it the client leaves the round, counted as missed.
  std::chrono::milliseconds rpc_timeout{60000};
  /// How long an unreachable server is retried (with back-off) before giving up.
  std::chrono::milliseconds retry_window{60000};
  /// Progress lines: selected for a round, update sent, a round left and why, the server
  /// unreachable and reached again, done (null = silent).
  std::function<void(const std::string&)> log;
  /// Keep what top-k did not send for the next update.
  bool error_feedback = true;
  /// Leave after this many trained rounds (0 = until the server says DONE).
  int64_t max_rounds = 0;
  /// Threads for local training (0 = keep LibTorch's setting).
  int threads = 0;
  /// Personalization once training is over: fine-tune the final global model for this many
  /// epochs (0 = none) on the client's examples, only the last personalize_layers parameter
  /// groups (0 = all), with the last round's plan otherwise; test both on `test_indices`
  /// (examples of the same data set, kept out of training) and save the result to
  /// `save_model` (torch::save of the module; "" = not saved).
  int64_t personalize_epochs = 0;
  int64_t personalize_layers = 0;
  std::vector<int64_t> test_indices;
  std::string save_model;
};

struct ClientReport {
  int64_t rounds_trained = 0;
  /// Rounds left because availability ended (or local training diverged); uploads the server
  /// refused or took as late; rounds left because they closed or their deadline passed before
  /// this client was done (a slow client, or a network that failed mid-round).
  int64_t rounds_abandoned = 0, uploads_refused = 0, rounds_missed = 0;
  int64_t uplink_bytes = 0, downlink_bytes = 0;
  /// Why the client stopped ("the last round is over", ...).
  std::string done_reason;
  /// With personalization and test examples: accuracy of the final global model and of the
  /// personalized one on them (< 0 when not measured).
  double global_accuracy = -1.0, personalized_accuracy = -1.0;
};

class Client {
 public:
  /// Builds the model the server names (its architecture name and MLP hidden widths); an
  /// application with its own model ignores them. Its parameter count must be the server's.
  using ModelFactory =
      std::function<Model(const std::string& name, const std::vector<int64_t>& hidden)>;

  /// `train` and `indices`: the client's own examples.
  Client(ModelFactory make_model, data::TensorDataset train, std::vector<int64_t> indices,
         ClientOptions options);
  ~Client();
  /// Takes part in rounds until the server says DONE (or max_rounds). Throws CommError naming
  /// the server when it stays unreachable past the retry window, InputError when it refuses
  /// this client (token, id) or its model does not match.
  ClientReport run();

 private:
  struct State;
  class Steps;
  std::unique_ptr<State> state_;
};

}  // namespace dtrain::services::federated
