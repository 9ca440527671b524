// The federated server's logic without the network, shared by `dtrain fl simulate` (clients as
// threads) and the gRPC server: the global model, the rounds, the selection of K clients among
// those available (seeded by the round, so a resumed server selects as the first run would
// have), the updates of the selected clients checked and averaged by example count, and the
// round closed with those that finished if at least `min_clients` did (else retried). Saved
// after every round, atomically; resumed from the file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/aggregation/Aggregator.h"
#include "dtrain/services/federated/aggregation/Buffered.h"

namespace dtrain::services::federated {

/// Client ids: 1 to 128 characters of [A-Za-z0-9._-].
bool valid_client_id(const std::string& id);

/// A round's rules: who is selected, what they train, how the updates are aggregated, what is
/// protected. The simulation (SimulationOptions::round) and the gRPC server
/// (ServerOptions::round) each hold one and hand it to their RoundServer as it is.
struct RoundServerOptions {
  /// K: clients selected per round (all available ones when fewer; the simulation sets it from
  /// its fraction C).
  int64_t clients_per_round = 10;
  /// A round is applied when at least this many selected clients finished (else retried; 0 =
  /// 1).
  int64_t min_clients = 0;
  /// The aggregator and its parameters.
  AggregatorOptions aggregator;
  /// N, the clients in the federation (SCAFFOLD and FedDyn scale their server state by the
  /// share that took part); 0 = the most clients ever offered to select() (the simulation sets
  /// it to its population).
  int64_t population = 0;
  /// The clients' plan as the flags give it; plan() is the aggregator's for the open round.
  LocalTraining local;
  /// Secure aggregation reveals only the round's sum (checked against the aggregator).
  bool secure_aggregation = false;
  /// The run's seed: selection, and in the simulation and the server also the model, the data
  /// and the clients' local order.
  uint64_t seed = 0;
  /// Differential privacy: updates must be within dp.clip (L2), count equally, and the round's
  /// sum gets Gaussian noise of standard deviation dp.noise_multiplier x dp.clip before it is
  /// divided by the number of selected clients.
  DpSpec dp;
  /// Asynchronous buffered aggregation (FedBuff): with buffer.size = K > 0 there are no rounds;
  /// clients start() whenever fewer than buffer.concurrency train, submit() when done, and
  /// every K accepted updates (each weighted by buffer.staleness) are applied as one step (a
  /// "round" in the records). clients_per_round and min_clients are then unused.
  BufferSpec buffer;
};

struct RoundOutcome {
  /// The round the updates were for, and whether they were applied (false: too few finished,
  /// the round is retried with a new selection).
  int64_t round = 0;
  bool applied = false;
  int64_t selected = 0, finished = 0, dropped = 0;
  /// Example-weighted mean of the finished clients' training losses.
  double train_loss = 0.0;
  int64_t examples = 0;
  /// Differential privacy: the clip the round's updates were held to (adaptive clipping moves
  /// it after each applied round); 0 without.
  double dp_clip = 0.0;
  /// Buffered aggregation: the mean staleness of the step's updates (< 0: synchronous).
  double staleness = -1.0;
};

/// A round as it is reported (metrics file, progress): its outcome, the global model's test
/// figures after it, the bytes that moved and its time.
struct RoundRecord {
  RoundOutcome outcome;
  /// < 0 when the round was not evaluated.
  double test_accuracy = -1.0, test_loss = -1.0;
  int64_t uplink_bytes = 0, downlink_bytes = 0;
  double seconds = 0.0;
  /// Clients available to be selected (< 0: not tracked).
  int64_t available = -1;
  /// Simulated minutes since the run's start when the round ended (the virtual clock; < 0:
  /// none).
  double sim_minutes = -1.0;
  /// Faulty clients among those that trained (simulation with --byzantine; < 0: none).
  int64_t faulty = -1;
  /// Differential privacy: epsilon (at the spec's delta) spent so far; < 0 without it.
  double dp_epsilon = -1.0;
  /// Time spent aggregating: the server's (reading, checking, averaging; with secure
  /// aggregation its protocol work) and a client's on average (encoding; with secure
  /// aggregation its protocol work), training not included. 0 when not measured.
  double server_aggregation_s = 0.0, client_aggregation_s = 0.0;
  /// Secure aggregation in simulation: masks the server expanded, and a sending client on
  /// average (0 when not measured).
  int64_t server_masks = 0;
  double client_masks = 0.0;
  /// Secure aggregation: the degree of SecAgg+'s graph (0: the full graph; -1: not secure).
  int secagg_degree = -1;
  /// A client's local training time on average (simulation; 0 when not measured).
  double client_training_s = 0.0;
  /// A round not applied: the most seconds of local training that clients which ran out of
  /// time in it said its plan needs (< 0: none said).
  double clients_needed_s = -1.0;
};

class RoundServer {
 public:
  RoundServer(at::Tensor initial, RoundServerOptions options);

  /// Rounds applied so far (the next round's number).
  int64_t round() const;
  /// A copy of the global model (flat).
  at::Tensor global() const;
  const RoundServerOptions& options() const { return options_; }
  /// What the selected clients train with in the next round (the aggregator's configure).
  LocalTraining plan() const;
  /// ... and in round (model version) `round`.
  LocalTraining plan_at(int64_t round) const;
  const Aggregator& aggregator() const { return *aggregator_; }

  /// Opens the next round (or reopens a retried one): selects K of `available` at random
  /// (seeded by the round and attempt) and returns them.
  std::vector<std::string> select(const std::vector<std::string>& available);
  /// The same for a population of clients 0..population-1 named by their numbers (the
  /// simulation): K drawn uniformly among those `available` says are, without listing them all;
  /// `available_count` (if given) receives how many are.
  std::vector<std::string> select_from(int64_t population,
                                       const std::function<bool(int64_t)>& available,
                                       int64_t* available_count = nullptr);
  bool selected(const std::string& client) const;
  /// SCAFFOLD's server control variate the open round's clients train with (undefined: zeros
  /// or none).
  at::Tensor client_control() const;
  /// Takes a selected client's update for the open round (with SCAFFOLD its control-variate
  /// change too). "" or why it was refused (not selected, already sent, wrong size or dtype,
  /// NaN/Inf, no examples, a control change missing): nothing changed.
  /// With adaptive clipping `within_clip` (0 or 1) says whether the update was within the clip
  /// before the client clipped it (-1: not said, refused then).
  std::string submit(const std::string& client, const at::Tensor& delta, int64_t examples,
                     double train_loss = 0.0, const at::Tensor& control_delta = at::Tensor(),
                     int within_clip = -1);
  /// Differential privacy: the clip the open round's updates must be within.
  double dp_clip() const;
  /// Secure aggregation: the finished clients' updates arrive only as their example-weighted
  /// sum (`examples` in all, `loss_sum` their example-weighted training losses); the server
  /// never sees one. "" or why refused (a client not selected or already counted, a wrong size,
  /// NaN/Inf, no examples).
  std::string submit_sum(const at::Tensor& weighted_sum, double examples,
                         const std::vector<std::string>& clients, double loss_sum);
  /// Buffered aggregation: hands `client` the current model (it trains from this step's version;
  /// its update's staleness counts the steps applied meanwhile). "" or why refused: already
  /// training, or --concurrency clients are.
  std::string start(const std::string& client);
  /// Buffered aggregation: `client` stopped training without an update (dropped out, left).
  void leave(const std::string& client);
  /// Buffered aggregation: clients training now, and whether the buffer holds K updates (then
  /// close() applies them).
  int64_t training() const;
  /// Buffered aggregation: the clients training now and the step each started from.
  std::map<std::string, int64_t> training_steps() const;
  bool buffer_full() const;
  bool buffered() const { return options_.buffer.enabled(); }
  /// The simulation's virtual clock (minutes), kept with the server so a resumed run goes on
  /// from the same simulated time.
  double clock() const;
  void set_clock(double minutes);
  /// Ends the open round: applies the mean update of those that finished if at least
  /// min_clients did; the rest count as dropped.
  RoundOutcome close();

  /// Writes the global model, optimizer state and round to `path` atomically, with the
  /// caller's `extra` tensors (the simulation's clients' state) in the same file.
  void save(const std::string& path, const std::map<std::string, at::Tensor>& extra = {}) const;
  /// Restores what save() wrote; InputError naming the file if it is damaged or holds another
  /// model size or optimizer. The extra tensors it held: loaded_extra().
  void load(const std::string& path);
  const std::map<std::string, at::Tensor>& loaded_extra() const { return loaded_extra_; }

 private:
  const RoundServerOptions options_;
  mutable std::mutex mutex_;
  std::map<std::string, at::Tensor> loaded_extra_;
  at::Tensor global_;
  AggregatorPtr aggregator_;
  int64_t round_ = 0;
  int64_t attempt_ = 0;  // retries of the open round
  std::set<std::string> selected_;
  std::map<std::string, int64_t> submitted_;  // client -> examples
  WeightedMean mean_;
  std::vector<WeightedUpdate> updates_;      // kept when the aggregator needs them
  at::Tensor control_sum_;                   // SCAFFOLD: the accepted control changes (float64)
  int64_t most_offered_ = 0;                 // the population when not given
  double clip_ = 0.0;                        // differential privacy's clip (adaptive: moves)
  double count_noise() const;                // adaptive clipping's sigma_b
  void clear_round();                        // what a round collects, emptied (lock held)
  int64_t within_clip_ = 0;                  // adaptive clipping: accepted updates within it
  std::map<std::string, int64_t> training_;  // buffered: client -> the step it started from
  int64_t buffered_ = 0, left_ = 0;          // buffered: updates in the buffer, clients left
  double staleness_sum_ = 0.0;               // buffered: the buffer's summed staleness
  double clock_ = 0.0;                       // the simulation's virtual clock
  double loss_sum_ = 0.0;
};

}  // namespace dtrain::services::federated
