// What `dtrain fl simulate` and `dtrain fl serve` share: the clients' plan, the server
// optimizer and the aggregators' flags, the model, the data; the helpers that read them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "Command.h"
#include "CommonFlags.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Buffered.h"
#include "dtrain/services/federated/aggregation/Robust.h"

namespace dtrain::cli::fl {

// Flags the simulation and the server share: the rounds' rules (the clients' plan, the
// aggregator and its server optimizer, privacy, secure and buffered aggregation, the seed: bound
// here once, handed to SimulationOptions::round or ServerOptions::round whole), the model, the
// data.
struct Shared {
  services::federated::RoundServerOptions round;
  std::string init_from, save_model;
  std::string compression = "none";
  std::string secagg_graph = "full";
  /// The model (--model, its flags) and the data (--dataset, the sets' flags). Federated
  /// learning's own defaults, where they differ from dtrain train's (models::ModelSpec,
  /// data::DataSource): McMahan et al.'s 2NN, a small synthetic set, small images with flips
  /// (a client's own folder is small).
  models::ModelSpec model = [] {
    models::ModelSpec spec;
    spec.name = "mlp";
    spec.hidden = {200, 200};
    return spec;
  }();
  std::string dataset = "fashion-mnist";
  data::DataSource data = [] {
    data::DataSource source;
    source.synthetic_examples = 4000;
    source.image_size = 32;
    source.augment = "flip";
    return source;
  }();
  int threads = 0;
};

// The registered models federated learning can train: classifiers whose state is parameters.
std::string federated_models();

// The rounds' flags of the simulation and the server (the same meaning in both).
void add_round_flags(CLI::App& c, int64_t& rounds, Shared& s, double& secagg_threshold,
                     std::string& metrics_file, const std::string& min_clients_more);

// Asynchronous buffered aggregation's flags (--buffer-size, --concurrency, --staleness).
void add_buffer_flags(CLI::App& c, Shared& s, std::string& staleness, const std::string& more);

// The plan's, the server's, the aggregators' and the model's flags (simulate and serve).
void add_plan(CLI::App& c, Shared& s);

// The model the flags name, from --init-from's weights when given.
Model initial_model(const Shared& s, const models::ModelSpec& spec);

// --save-model: the final global model as a consolidated file.
void save_final(const Shared& s, const models::ModelSpec& spec, const at::Tensor& global);

// The data set's flags and --threads.
void add_data(CLI::App& c, Shared& s, const char* use);

// The model --model names, checked to be a classifier of parameters.
models::ModelSpec model_spec(const Shared& s, const std::string& name,
                             const std::vector<int64_t>& hidden);

// The set's training or test split.
data::TensorDataset load(const Shared& s, bool train);
/// The data sets federated learning can partition ("a or b"), and --dataset's entry (InputError
/// naming them for another).
std::string federated_datasets();
/// The set --dataset names, described for its source (an image folder's classes and size);
/// InputError unless it is a classification set.
data::DatasetInfo federated_dataset(const Shared& s);

// Threads for tensor ops (--threads, else $DTRAIN_THREADS or the cores), and glibc malloc kept
// from mmapping each large temporary (a FedSGD client's full-batch activations): without it a
// FedSGD round with the CNN spends 45% of its time in the kernel (BENCHMARKS.md). Called before
// the data loads: tuned after it, the rounds still unmapped 1.6x as often.
void set_up_process(int threads);

// `dtrain fl simulate`, `dtrain fl serve`, `dtrain fl client` on the `fl` group.
std::unique_ptr<Command> simulate_command(CLI::App* fl);
std::unique_ptr<Command> serve_command(CLI::App* fl);
std::unique_ptr<Command> client_command(CLI::App* fl);

// HOSTNAME-PID.
std::string default_client_id();

}  // namespace dtrain::cli::fl
