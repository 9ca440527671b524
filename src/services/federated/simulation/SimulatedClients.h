// What `fl simulate`'s synchronous rounds (Simulation.cpp) and buffered aggregation
// (BufferedSimulation.cpp) share: the run's clients (made when selected), the state that
// outlives a client's round, one client's local work (train, clip, attack, encode as a deployed
// client would) and its delivery to the server (read back as the server reads an upload).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dtrain/federated.pb.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "services/federated/RoundLog.h"

namespace dtrain::services::federated {

class SecureRound;

/// A hash of (seed, a, b) for the per-client, per-round draws.
uint64_t mix(uint64_t seed, uint64_t a, uint64_t b);
int64_t nanoseconds_since(std::chrono::steady_clock::time_point start);
/// The bytes of the model's download messages (what each selected client receives).
int64_t download_bytes(const at::Tensor& global);

struct SimulatedClients {
  SimulatedClients(const data::TensorDataset& train, const SimulationOptions& options,
                   RoundServer& server);
  const SimulationOptions& options;
  const data::TensorDataset& train;
  /// Label flippers train on a copy of the set with flipped labels.
  data::TensorDataset flipped;
  ClientPopulation population;
  std::vector<bool> faulty;
  RoundServer& server;
  /// The model's parameter count (read once: global() copies the model).
  int64_t numel = 0;
  /// State kept only for the clients that have it: top-k's error feedback, drift correction's
  /// (SCAFFOLD's c_i, FedDyn's h_i).
  std::mutex memory_mutex;
  std::map<int64_t, at::Tensor> residuals, memories;
};

/// One client's local work from the model it was handed.
struct ClientWork {
  int64_t client = 0;
  /// The model version (the round) it trains from, and its training seed.
  int64_t version = 0;
  uint64_t seed = 0;
  at::Tensor global, control;
  LocalTraining plan;
  double clip = 0.0;
  /// Secure aggregation: the round's protocol and this client's place in it (masked, not
  /// encoded).
  SecureRound* secure = nullptr;
  size_t secure_index = 0;
};

struct ClientResult {
  bool diverged = false, attacked = false, masked = false;
  int within_clip = -1;
  std::vector<dtrain::fl::UpdateChunk> messages;
  int64_t training_ns = 0, encoding_ns = 0;
};

ClientResult run_client(SimulatedClients& clients, Model& replica, const ClientWork& work);

/// Reads `result`'s upload as the server does and submits it; returns the upload's bytes and
/// adds the server's time to `server_ns`. Throws when the server refuses it (a bug here).
int64_t deliver(SimulatedClients& clients, const ClientResult& result, const std::string& id,
                int64_t* server_ns);

/// The clients' state a checkpoint keeps, as tensors named "residual/C" and "memory/C" (C the
/// client's number): what a resumed run needs to go on as an uninterrupted one does.
std::map<std::string, at::Tensor> client_state(SimulatedClients& clients);
/// Restores what client_state() gave from a loaded checkpoint's extra tensors (others are
/// left to the caller); InputError naming `path` if one does not fit the model.
void restore_client_state(SimulatedClients& clients, const std::map<std::string, at::Tensor>& extra,
                          const std::string& path);

/// Evaluates the global model after an applied round (every eval_every and the last), saves the
/// server's checkpoint with `state()`'s tensors (the clients' state), logs the record; returns
/// whether the target accuracy was reached.
bool finish_round(const SimulationOptions& options, RoundServer& server, Model& global_model,
                  const data::TensorDataset& test, RoundLog& log, RoundRecord& record,
                  SimulationResult& result, int64_t min_clients,
                  const std::function<std::map<std::string, at::Tensor>()>& state);

/// The buffered (FedBuff) simulation on the virtual clock: Simulation.cpp calls it when
/// options.buffer is enabled.
void simulate_buffered(SimulatedClients& clients, std::vector<Model>& replicas, Model& global_model,
                       const data::TensorDataset& test, RoundLog& log, SimulationResult& result);

}  // namespace dtrain::services::federated
