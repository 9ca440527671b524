// `dtrain fl simulate`: federated learning research on one machine - many clients, each a
// partition of a training set, trained as tasks on a pool of threads against the same server
// logic (RoundServer) the gRPC server runs. Per round: the global model's test accuracy and
// loss, clients selected / finished / dropped, uplink and downlink bytes, round time; a
// metrics file, a progress bar, the server's checkpoint after every round (a rerun with the same
// directory resumes).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/Compression.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Buffered.h"
#include "dtrain/services/federated/aggregation/Robust.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"

namespace dtrain::services::federated {

/// Who can take part when, in simulation: everyone always, or a diurnal trace - each client
/// has its own time zone (a uniform offset) and is available `hours` a day (its local night,
/// from 00:00); simulated time advances `round_minutes` per round attempt. A client whose
/// window closes during a round leaves it (dropped).
struct AvailabilityTrace {
  enum Kind { Always, Diurnal };
  Kind kind = Always;
  double hours = 8.0;
  double round_minutes = 10.0;
  /// Whether `client` is available at simulated minute `minute` (0 = the run's start).
  bool available(int64_t client, double minute, uint64_t seed) const;
  /// Minutes until `client`'s window closes, from `minute` when it is available (infinity for
  /// always; 0 when it is not available).
  double minutes_left(int64_t client, double minute, uint64_t seed) const;
};

/// "always" or "diurnal:HOURS" (InputError naming --availability otherwise).
AvailabilityTrace parse_availability_trace(const std::string& text);

struct SimulationOptions {
  int64_t clients = 100;
  /// C: the fraction of clients selected per round (at least one).
  double fraction = 0.1;
  int64_t rounds = 50;
  /// The rounds' rules (RoundServer.h): min_clients, the aggregator, the clients' plan, the seed
  /// (also the partition's, the faulty clients' and the clock's), differential privacy
  /// (DP-FedAvg: clients clip, the server adds noise; epsilon per round), secure aggregation
  /// (not with compression; see secagg_* below) and asynchronous buffered aggregation (FedBuff;
  /// needs the virtual clock). clients_per_round and population are set from fraction and
  /// clients.
  RoundServerOptions round;
  PartitionSpec partition;
  double local_test_fraction = 0.2;
  /// Examples each client holds at least: the training set is dealt while it can give every
  /// client this many; a larger population draws them per client (ClientPopulation).
  int64_t client_examples = 50;
  /// Faulty clients (--byzantine): a fixed fraction of the population attacks every round it
  /// is selected for.
  ByzantineSpec byzantine;
  /// How clients compress their updates (uplink bytes are measured on the encoded messages).
  comm::CompressionSpec compression;
  /// Secure aggregation (round.secure_aggregation; Bonawitz et al.): the server learns only the
  /// sum of each round's updates. Threshold t = ceil(secagg_threshold x K) (0: a majority,
  /// floor(K/2) + 1); inputs in fixed point with secagg_frac_bits fraction bits. Not with
  /// compression.
  double secagg_threshold = 0.0;
  int secagg_frac_bits = 16;
  /// SecAgg+ (parse_secagg_graph): 0 the classic full graph, -1 a degree of about 2 log2 K,
  /// kAutoGraph (sized for secagg_dropout), or an even degree; the threshold is then
  /// secagg_threshold of a neighbourhood (degree + 1).
  int secagg_graph = 0;
  /// The dropout rate "auto" sizes the degree for (< 0: `dropout`).
  double secagg_dropout = -1.0;
  /// Availability of the clients over simulated time (selection only among those available).
  AvailabilityTrace availability;
  /// A selected client drops out before sending its update with this probability.
  double dropout = 0.0;
  /// The virtual clock: each device's speed (none: every round attempt takes round_minutes).
  /// With it a synchronous round lasts until its slowest selected client is done or has left
  /// (a dropout leaves at a uniform point of its training), at most round_deadline minutes
  /// (0 = no deadline; clients not done by then are dropped).
  ClientSpeed speed;
  double round_deadline = 0.0;
  /// Worker threads training clients (0 = the cores); each uses one LibTorch thread.
  int threads = 0;
  /// Evaluate the global model on the test set every this many rounds (and the last).
  int64_t eval_every = 1;
  /// Stop once the test accuracy reaches this (0 = run every round).
  double target_accuracy = 0.0;
  /// Personalization after the last round: every client fine-tunes the global model for this
  /// many epochs (0 = none) on its training examples, only the last personalize_layers
  /// parameter groups (0 = all), and both models are tested on its own test examples.
  int64_t personalize_epochs = 0;
  int64_t personalize_layers = 0;
  std::string metrics_file;
  /// The initial global model (flat; undefined: built from the seed).
  at::Tensor initial;
  /// The server's checkpoint goes to DIR/server.pt after every round; resumed from it.
  std::string checkpoint_dir;
  bool progress = true;
};

struct SimulationResult {
  std::vector<RoundRecord> rounds;
  /// The first round (1-based count of applied rounds; buffered: server steps) whose
  /// evaluation reached target_accuracy, 0 if none did; and the simulated minutes then (the
  /// virtual clock; < 0 without it).
  int64_t rounds_to_target = 0;
  double minutes_to_target = -1.0;
  int64_t start_round = 0;
  /// Rounds applied in all (the server's round at the end).
  int64_t rounds_done = 0;
  at::Tensor global;
  /// With personalize_epochs > 0.
  PersonalizationReport personalization;
};

/// The global model's mean loss and accuracy on `data` (batches of `batch`).
std::pair<double, double> evaluate_model(Model& model, const data::TensorDataset& data,
                                         int64_t batch = 1000);

/// What `dtrain fl simulate` prints at the end: one line of the run (algorithm, clients, C or the
/// buffer, E and B, rounds, accuracy, privacy, faulty clients, uplink, time to the target), and
/// one of personalization when asked; each line ends in a newline.
std::string summary(const SimulationOptions& options, const SimulationResult& result);

SimulationResult simulate(const models::ModelSpec& spec, const data::TensorDataset& train,
                          const data::TensorDataset& test, const SimulationOptions& options);

}  // namespace dtrain::services::federated
