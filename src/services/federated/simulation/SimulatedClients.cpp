// What the synchronous rounds (Simulation.cpp) and buffered aggregation (BufferedSimulation.cpp)
// share: the run's clients, one client's local work and its delivery to the server, the state a
// checkpoint keeps of them, and the end of a round (evaluate, save, log).
#include "services/federated/simulation/SimulatedClients.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>

#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/aggregation/Drift.h"
#include "services/federated/RoundLog.h"
#include "services/federated/secagg/SecureRound.h"
#include "services/federated/service/FlWire.h"

namespace dtrain::services::federated {

int64_t download_bytes(const at::Tensor& global) {
  int64_t bytes = 0;
  wire::for_each_chunk({{"", global}}, comm::rpc::kDefaultChunkBytes,
                       [&](comm::rpc::TensorChunk&& chunk) {
                         dtrain::fl::ModelChunk message;
                         *message.mutable_chunk() = std::move(chunk);
                         bytes += wire::message_bytes(message);
                       });
  return bytes;
}

int64_t nanoseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

uint64_t mix(uint64_t seed, uint64_t a, uint64_t b) {
  std::seed_seq seq{seed, a, b};
  uint32_t words[2];
  seq.generate(words, words + 2);
  return (static_cast<uint64_t>(words[0]) << 32) | words[1];
}

SimulatedClients::SimulatedClients(const data::TensorDataset& train_set,
                                   const SimulationOptions& run, RoundServer& round_server)
    : options(run),
      train(train_set),
      flipped(train_set),
      population(train_set.targets(), run.clients, run.partition, run.round.seed,
                 run.local_test_fraction, run.client_examples),
      faulty(faulty_clients(run.byzantine, run.clients, run.round.seed)),
      server(round_server),
      numel(round_server.global().numel()) {
  if (run.byzantine.kind == ByzantineSpec::LabelFlip) {
    const int64_t classes = train_set.targets().max().item<int64_t>() + 1;
    flipped = train_set.with_targets(flip_labels(train_set.targets(), classes));
  }
}

ClientResult run_client(SimulatedClients& clients, Model& replica, const ClientWork& work) {
  const SimulationOptions& options = clients.options;
  const int64_t c = work.client;
  const auto round = static_cast<uint64_t>(work.version);
  ClientResult result;
  const auto training = std::chrono::steady_clock::now();
  const bool attacks = clients.faulty[static_cast<size_t>(c)];
  at::Tensor memory;
  if (work.plan.correction != "none") {
    std::lock_guard<std::mutex> lock(clients.memory_mutex);
    const auto it = clients.memories.find(c);
    if (it != clients.memories.end()) memory = it->second;
  }
  CorrectedUpdate corrected =
      train_client(replica, work.global,
                   attacks && options.byzantine.kind == ByzantineSpec::LabelFlip ? clients.flipped
                                                                                 : clients.train,
                   clients.population.client(c).train, work.plan, work.seed, &memory, work.control);
  ClientUpdate& update = corrected.update;
  if (memory.defined()) {
    std::lock_guard<std::mutex> lock(clients.memory_mutex);
    clients.memories[c] = memory;
  }
  result.training_ns = nanoseconds_since(training);
  if (options.round.dp.enabled()) {
    result.within_clip = update.delta.to(at::kDouble).norm().item<double>() <= work.clip ? 1 : 0;
    update.delta = clip_update(update.delta, work.clip);
  }
  if (attacks) {
    // What it sends instead (it ignores any clip: the server's checks see it).
    update.delta =
        attack(options.byzantine, update.delta, mix(options.round.seed ^ 0xBADC0DEULL, round, c));
    result.attacked = true;
  }
  // A diverged client leaves the round, as a deployed one does (the server would refuse its
  // update; under secure aggregation it could not even tell).
  if (!std::isfinite(update.loss) || !comm::all_finite(update.delta)) {
    result.diverged = true;
    return result;
  }
  if (work.secure != nullptr) {
    work.secure->mask(work.secure_index, update);
    result.masked = true;
    return result;
  }
  // The update travels as a deployed client sends it (encoded, in the upload's messages).
  const auto start = std::chrono::steady_clock::now();
  at::Tensor residual;
  if (options.compression.kind == comm::CompressionSpec::TopK) {
    std::lock_guard<std::mutex> lock(clients.memory_mutex);
    const auto it = clients.residuals.find(c);
    if (it != clients.residuals.end()) residual = it->second;
  }
  comm::EncodedUpdate encoded = comm::encode_update(update.delta, options.compression, &residual,
                                                    mix(options.round.seed ^ 0x51ed27U, round, c));
  if (options.round.dp.enabled() && !attacks) {
    // The clip bounds what the server decodes (q8's rounding, top-k's residual can exceed it).
    fit_within_norm(&encoded, update.delta.numel(), update.delta.scalar_type(), work.clip,
                    &residual);
  }
  if (residual.defined()) {
    std::lock_guard<std::mutex> lock(clients.memory_mutex);
    clients.residuals[c] = residual;
  }
  if (corrected.control_delta.defined()) {
    // SCAFFOLD's control change in the same upload, compressed like the update.
    wire::append_control(&encoded,
                         comm::encode_update(corrected.control_delta, options.compression, nullptr,
                                             mix(options.round.seed ^ 0xC047201ULL, round, c)));
  }
  result.messages =
      wire::update_messages(encoded, std::to_string(c), work.version + 1, update.examples,
                            update.loss, comm::rpc::kDefaultChunkBytes);
  result.encoding_ns = nanoseconds_since(start);
  return result;
}

int64_t deliver(SimulatedClients& clients, const ClientResult& result, const std::string& id,
                int64_t* server_ns) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t numel = clients.numel;
  const at::ScalarType dtype =
      clients.train.raw_inputs().scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  int64_t bytes = 0;
  for (const auto& m : result.messages) bytes += wire::message_bytes(m);
  dtrain::fl::UpdateChunk header;
  comm::EncodedUpdate received;
  at::Tensor dense, control_change;
  std::string why = wire::read_update(result.messages, numel, &header, &received);
  const comm::EncodedUpdate control_received = wire::split_control(&received);
  if (why.empty()) why = comm::decode_update(received, numel, dtype, &dense);
  if (why.empty() && !control_received.parts.empty()) {
    why = comm::decode_update(control_received, numel, dtype, &control_change);
  }
  if (why.empty()) {
    why = clients.server.submit(id, dense, header.examples(), header.train_loss(), control_change,
                                result.within_clip);
  }
  *server_ns += nanoseconds_since(start);
  DTRAIN_CHECK(why.empty(), "client ", id, ": ", why);
  return bytes;
}

std::map<std::string, at::Tensor> client_state(SimulatedClients& clients) {
  std::map<std::string, at::Tensor> state;
  std::lock_guard<std::mutex> lock(clients.memory_mutex);
  for (const auto& [c, t] : clients.residuals) state["residual/" + std::to_string(c)] = t;
  for (const auto& [c, t] : clients.memories) state["memory/" + std::to_string(c)] = t;
  return state;
}

void restore_client_state(SimulatedClients& clients, const std::map<std::string, at::Tensor>& extra,
                          const std::string& path) {
  std::lock_guard<std::mutex> lock(clients.memory_mutex);
  clients.residuals.clear();
  clients.memories.clear();
  for (const auto& [name, tensor] : extra) {
    const auto slash = name.find('/');
    const std::string kind = name.substr(0, slash);
    if (kind != "residual" && kind != "memory") continue;
    char* end = nullptr;
    const long long c = std::strtoll(name.c_str() + slash + 1, &end, 10);
    DTRAIN_CHECK_INPUT(*end == '\0' && c >= 0 && c < clients.options.clients, path,
                       ": the state of a client '", name, "' that this run of ",
                       clients.options.clients, " clients does not have");
    DTRAIN_CHECK_INPUT(tensor.dim() == 1 && tensor.numel() == clients.numel, path, ": client ", c,
                       "'s ", kind, " holds ", tensor.numel(), " numbers, the model ",
                       clients.numel);
    (kind == "residual" ? clients.residuals : clients.memories)[c] = tensor;
  }
}

bool finish_round(const SimulationOptions& options, RoundServer& server, Model& global_model,
                  const data::TensorDataset& test, RoundLog& log, RoundRecord& record,
                  SimulationResult& result, int64_t min_clients,
                  const std::function<std::map<std::string, at::Tensor>()>& state) {
  const int64_t done = server.round();
  if (options.round.dp.enabled()) {
    const int64_t per_round = options.round.buffer.enabled() ? options.round.buffer.size
                                                             : server.options().clients_per_round;
    record.dp_epsilon =
        dp_epsilon(static_cast<double>(per_round) / static_cast<double>(options.clients),
                   options.round.dp.noise_multiplier, done, options.round.dp.delta)
            .first;
  }
  if (record.outcome.applied && (done % options.eval_every == 0 || done == options.rounds)) {
    load_flat_parameters(global_model, server.global());
    std::tie(record.test_loss, record.test_accuracy) = evaluate_model(global_model, test);
  }
  const std::string checkpoint =
      options.checkpoint_dir.empty() ? "" : options.checkpoint_dir + "/server.pt";
  if (!checkpoint.empty() && record.outcome.applied) server.save(checkpoint, state());
  log.report(record, done, min_clients);
  result.rounds.push_back(record);
  if (options.target_accuracy > 0 && record.test_accuracy >= options.target_accuracy &&
      result.rounds_to_target == 0) {
    result.rounds_to_target = done;
    result.minutes_to_target = record.sim_minutes;
    return true;
  }
  return false;
}

}  // namespace dtrain::services::federated
