#include "FederatedShared.h"

#include <unistd.h>

#include <cstdio>

#include <torch/torch.h>

#include "dtrain/data/Datasets.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Aggregator.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::cli::fl {

// The registered models federated learning can train: classifiers whose state is parameters.
std::string federated_models() {
  std::string names;
  for (const auto& name : models::model_names()) {
    const models::ModelInfo model = models::model_info(name);
    if (!model.language_model && model.parameters_only) names += (names.empty() ? "" : ", ") + name;
  }
  return names;
}

// The rounds' flags of the simulation and the server (the same meaning in both).
void add_round_flags(CLI::App& c, int64_t& rounds, Shared& s, double& secagg_threshold,
                     std::string& metrics_file, const std::string& min_clients_more) {
  add(c, "--rounds", rounds, "Rounds")->capture_default_str();
  add(c, "--min-clients", s.round.min_clients,
      "A round counts when at least this many selected clients finished (0 = 1); else it is "
      "retried" +
          min_clients_more)
      ->capture_default_str();
  c.add_flag("--secure-aggregation", s.round.secure_aggregation,
             "Secure aggregation (Bonawitz et al. 2017): the server learns only each round's sum");
  add(c, "--secagg-threshold", secagg_threshold,
      "Secure aggregation's t as a fraction of the round's clients (with SecAgg+: of a "
      "neighbourhood, degree + 1; 0 = a majority); rounds with fewer survivors abort")
      ->capture_default_str();
  add(c, "--secagg-graph", s.secagg_graph,
      "Secure aggregation among whom: full (every pair of the round's clients, Bonawitz et al.), "
      "log (SecAgg+, Bell et al. 2020: a random graph of degree about 2 log2 K from the round's "
      "seed; masks and shares only among neighbours), auto (SecAgg+ with the smallest degree "
      "from log up at which a round aborts with probability <= 0.001 at --secagg-dropout's "
      "rate) or an even degree K")
      ->capture_default_str();
  // --metrics, as `dtrain train` names it; --metrics-file, its first name, still works.
  add(c, "--metrics,--metrics-file", metrics_file, "JSON Lines metrics: one record per round");
}

void add_buffer_flags(CLI::App& c, Shared& s, std::string& staleness, const std::string& more) {
  services::federated::BufferSpec& buffer = s.round.buffer;
  add(c, "--buffer-size", buffer.size,
      "K: asynchronous buffered aggregation (FedBuff): updates are taken as they arrive and "
      "applied every K (0 = synchronous rounds); --rounds counts these server steps" +
          more)
      ->capture_default_str();
  add(c, "--concurrency", buffer.concurrency,
      "C: clients training at once with --buffer-size (0 = 10 x K)")
      ->capture_default_str();
  add(c, "--staleness", staleness,
      "How a buffered update's weight falls with its staleness s (server steps since its client "
      "started): constant, poly:A ((1 + s)^-A) or hinge:A,B (1 up to s = B, then "
      "1 / (A (s - B) + 1))")
      ->capture_default_str();
}

void add_plan(CLI::App& c, Shared& s) {
  std::string algorithms;
  for (const auto& name : services::federated::aggregator_names()) {
    algorithms += (algorithms.empty() ? "" : ", ") + name;
  }
  add(c, "--algorithm", s.round.aggregator.algorithm,
      "The aggregator: " + algorithms +
          " (fedsgd: E = 1 and the full local batch; fedavg with "
          "--server-optimizer adam is fedadam, with --server-momentum fedavgm, with --prox-mu "
          "fedprox)")
      ->capture_default_str();
  add(c, "--local-epochs", s.round.local.epochs, "E: local passes over a client's examples")
      ->capture_default_str();
  add(c, "--local-batch", s.round.local.batch, "B: local batch size (0 = a client's whole set)")
      ->capture_default_str();
  add_sgd_flags(c, s.round.local.lr, s.round.local.momentum, s.round.local.weight_decay, "Local");
  add(c, "--lr-decay", s.round.local.lr_decay, "The local rate is multiplied by this every round")
      ->capture_default_str();
  add(c, "--prox-mu", s.round.local.prox_mu, "FedProx's proximal term mu (0 = FedAvg)")
      ->capture_default_str();
  add(c, "--compression", s.compression,
      "How clients compress updates: none, q8 (8-bit, stochastic rounding) or topk:FRACTION "
      "(the largest FRACTION of elements, with error feedback)")
      ->capture_default_str();
  add(c, "--server-optimizer", s.round.aggregator.server.name,
      "Applied to the averaged update: sgd (FedAvg; FedAvgM with --server-momentum) or adam "
      "(FedAdam)")
      ->capture_default_str();
  add(c, "--server-lr", s.round.aggregator.server.lr,
      "The server optimizer's rate (1 with sgd: plain FedAvg)")
      ->capture_default_str();
  add(c, "--server-momentum", s.round.aggregator.server.momentum, "FedAvgM's momentum")
      ->capture_default_str();
  add(c, "--feddyn-alpha", s.round.aggregator.feddyn_alpha,
      "feddyn: the weight alpha of its dynamic regularizer (Acar et al. 2021 use 0.01-0.1)")
      ->capture_default_str();
  add(c, "--scaffold-option", s.round.aggregator.scaffold_option,
      "scaffold: how clients update their control variate: 1 (the gradient at the server "
      "model: one more pass) or 2 (from the local steps' movement)")
      ->capture_default_str();
  add(c, "--assumed-faulty", s.round.aggregator.robust.assumed_faulty,
      "Robust aggregators: the fraction of a round's updates they tolerate as faulty "
      "(trimmed-mean cuts it from each end; krum's f = it x n; multi-krum averages n - f)")
      ->capture_default_str();
  add(c, "--update-clip", s.round.aggregator.robust.update_clip,
      "clipped-mean: scale every update to at most this L2 norm (0 = the round's median norm)")
      ->capture_default_str();
  add(c, "--dp-clip", s.round.dp.clip,
      "Differential privacy (DP-FedAvg): clip each client's update to this L2 norm and weight "
      "clients equally (0 = off)")
      ->capture_default_str();
  add(c, "--dp-noise", s.round.dp.noise_multiplier,
      "Gaussian noise on the round's sum, standard deviation this x --dp-clip")
      ->capture_default_str();
  add(c, "--dp-delta", s.round.dp.delta, "The delta of the (epsilon, delta) reported per round")
      ->capture_default_str();
  add(c, "--dp-target-quantile", s.round.dp.target_quantile,
      "Adaptive clipping (Andrew et al. 2021): the clip follows this quantile of the update "
      "norms, privately, starting at --dp-clip (0 = a fixed clip; 0.5 in the paper)")
      ->capture_default_str();
  add(c, "--dp-clip-lr", s.round.dp.clip_lr,
      "Adaptive clipping: the clip's geometric learning rate")
      ->capture_default_str();
  add(c, "--dp-count-noise", s.round.dp.count_noise,
      "Adaptive clipping: the noise on the count of updates within the clip (0 = the round's "
      "clients / 20); it takes its share of --dp-noise")
      ->capture_default_str();
  add_model_flags(
      c, s.model,
      federated_models() +
          " (fedavg-cnn: McMahan et al.'s CNN, 5x5 convolutions "
          "and a 512-unit layer)",
      [](const models::ModelInfo& info) { return !info.language_model && info.parameters_only; },
      [](FlagSet& flags) { add_to_help(flags, "--hidden", " (McMahan et al.'s 2NN)"); });
  add_seed_flag(c, s.round.seed, "model, selection, local order");
  add(c, "--init-from", s.init_from,
      "Start the global model from these weights: a training checkpoint (directory or root) of "
      "any strategy and world size, or a consolidated file");
  add(c, "--save-model", s.save_model,
      "Write the final global model here as a consolidated file (dtrain train --init-from "
      "continues it under any strategy)");
}

// The model the flags name, from --init-from's weights when given.
Model initial_model(const Shared& s, const models::ModelSpec& spec) {
  torch::manual_seed(s.round.seed);
  Model model = models::make_model(spec);
  if (!s.init_from.empty()) train::load_model_from(*model.module, s.init_from);
  return model;
}

void save_final(const Shared& s, const models::ModelSpec& spec, const at::Tensor& global) {
  if (s.save_model.empty()) return;
  Model model = models::make_model(spec);
  services::federated::load_flat_parameters(model, global);
  train::save_consolidated(*model.module, s.save_model);
  std::printf("wrote the global model to %s\n", s.save_model.c_str());
}

void add_data(CLI::App& c, Shared& s, const char* use) {
  add_data_flags(
      c, s.dataset, s.data, federated_datasets() + ": " + use,
      [](const data::DatasetInfo& info) { return !info.language; },
      [](FlagSet& flags) { add_to_help(flags, "--image-size", " (every party the same)"); });
  add_threads_flag(c, s.threads, "$DTRAIN_THREADS, else the cores");
}

models::ModelSpec model_spec(const Shared& s, const std::string& name,
                             const std::vector<int64_t>& hidden) {
  const models::ModelInfo model = models::model_info(name);
  DTRAIN_CHECK_INPUT(!model.language_model && model.parameters_only, "--model '", name,
                     "': ", "federated learning averages parameters of classifiers: expected ",
                     federated_models());
  models::ModelSpec spec;
  spec.name = name;
  spec.hidden = hidden;
  const data::DatasetInfo dataset = federated_dataset(s);
  spec.input_shape = dataset.input_shape;
  spec.classes = dataset.classes;
  return spec;
}

// Classification sets: the built-in ones partitioned over simulated clients, and a party's own
// (images:ROOT, a folder per class or tar shards).
std::string federated_datasets() {
  return data::dataset_names_where([](const data::DatasetInfo& d) { return !d.language; });
}

namespace {

data::DataSource source_of(const Shared& s, bool train) {
  data::DataSource source = s.data;
  source.argument = data::dataset_argument(s.dataset);
  source.seed = s.round.seed + 1;
  source.train = train;
  source.test = !train;
  return source;
}

}  // namespace

data::DatasetInfo federated_dataset(const Shared& s) {
  DTRAIN_CHECK_INPUT(!data::dataset_info(s.dataset).language, "--dataset '", s.dataset,
                     "': federated learning trains classifiers: expected ", federated_datasets(),
                     " (images:ROOT: a party's own image folders)");
  return data::dataset_info_for(s.dataset, source_of(s, true));
}

// The set's training or test split.
data::TensorDataset load(const Shared& s, bool train) {
  data::LoadedData data = data::load_dataset(s.dataset, source_of(s, train));
  return train ? std::move(data.train) : std::move(data.test);
}

// Threads for tensor ops (--threads, else $DTRAIN_THREADS or the cores), and glibc malloc kept
// from mmapping each large temporary (a FedSGD client's full-batch activations): without it a
// FedSGD round with the CNN spends 45% of its time in the kernel (BENCHMARKS.md). Called before
// the data loads: tuned after it, the rounds still unmapped 1.6x as often.
void set_up_process(int threads) {
  launch::set_threads(threads > 0 ? threads : launch::default_threads(1));
  launch::tune_allocator();
}

std::string default_client_id() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !services::federated::valid_client_id(host)) {
    std::snprintf(host, sizeof host, "client");
  }
  return concat(host, "-", ::getpid());
}

}  // namespace dtrain::cli::fl
