// `dtrain fl simulate`: flags into SimulationOptions, the data set loaded, a summary printed.
#include "Federated.h"

#include <ATen/Parallel.h>

#include <cstdio>
#include <thread>

#include "Options.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/parallel/federated/Simulation.h"

namespace dtrain::cli {

struct FederatedCommands::Options {
  CLI::App* simulate = nullptr;
  federated::SimulationOptions sim;
  std::string partition = "iid";
  std::string algorithm = "fedavg";
  std::string model = "mlp";
  std::vector<int64_t> hidden{200, 200};
  std::string dataset = "fashion-mnist";
  std::string data_dir;
  int64_t synthetic_examples = 4000;
};

FederatedCommands::FederatedCommands(CLI::App& app) : options_(std::make_unique<Options>()) {
  auto* fl = app.add_subcommand("fl", "Federated learning (FedAvg and its relatives)");
  fl->require_subcommand(1);
  Options& o = *options_;
  auto& s = o.sim;
  o.simulate = fl->add_subcommand(
      "simulate", "Simulate many clients in one process against the federated server's logic");
  CLI::App& c = *o.simulate;
  c.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add(c, "--clients", s.clients, "Clients (each a partition of the training set)")
      ->capture_default_str();
  add(c, "--fraction", s.fraction, "C: the fraction of clients selected each round")
      ->capture_default_str();
  add(c, "--rounds", s.rounds, "Rounds")->capture_default_str();
  add(c, "--min-clients", s.min_clients,
      "A round counts when at least this many selected clients finished (0 = 1); else retried")
      ->capture_default_str();
  add(c, "--partition", o.partition,
      "How the training set is cut: iid, shards:K (sorted labels, K shards per client: "
      "pathological non-IID) or dirichlet:ALPHA (label skew)")
      ->capture_default_str();
  add(c, "--local-test-fraction", s.local_test_fraction,
      "Share of each client's examples held out as its local test set")
      ->capture_default_str();
  add(c, "--algorithm", o.algorithm, "fedavg, or fedsgd (E = 1 and the full local batch)")
      ->capture_default_str();
  add(c, "--local-epochs", s.local.epochs, "E: local passes over a client's examples")
      ->capture_default_str();
  add(c, "--local-batch", s.local.batch, "B: local batch size (0 = a client's whole set)")
      ->capture_default_str();
  add(c, "--lr", s.local.lr, "Local SGD learning rate")->capture_default_str();
  add(c, "--momentum", s.local.momentum, "Local SGD momentum")->capture_default_str();
  add(c, "--weight-decay", s.local.weight_decay, "Local L2 weight decay")->capture_default_str();
  add(c, "--prox-mu", s.local.prox_mu, "FedProx's proximal term mu (0 = FedAvg)")
      ->capture_default_str();
  add(c, "--server-optimizer", s.server.name,
      "Applied to the averaged update: sgd (FedAvg; FedAvgM with --server-momentum) or adam "
      "(FedAdam)")
      ->capture_default_str();
  add(c, "--server-lr", s.server.lr, "The server optimizer's rate (1 with sgd: plain FedAvg)")
      ->capture_default_str();
  add(c, "--server-momentum", s.server.momentum, "FedAvgM's momentum")->capture_default_str();
  add(c, "--dropout", s.dropout,
      "Probability that a selected client drops out before sending its update")
      ->capture_default_str();
  add(c, "--model", o.model, "mlp, cnn or linear")->capture_default_str();
  add(c, "--hidden", o.hidden, "MLP hidden widths (McMahan et al.'s 2NN: 200 200)")
      ->capture_default_str();
  add(c, "--dataset", o.dataset, "fashion-mnist or synthetic")->capture_default_str();
  add(c, "--data-dir", o.data_dir,
      "Fashion-MNIST IDX files (default: $DTRAIN_DATA_DIR or Debian's dataset-fashion-mnist)");
  add(c, "--synthetic-examples", o.synthetic_examples, "--dataset synthetic: training examples")
      ->capture_default_str();
  add(c, "--threads", s.threads, "Threads training clients (default: the cores)");
  add(c, "--seed", s.seed, "Random seed (partition, selection, local order)")
      ->capture_default_str();
  add(c, "--eval-every", s.eval_every, "Evaluate the global model every N rounds")
      ->capture_default_str();
  add(c, "--target-accuracy", s.target_accuracy,
      "Stop once the global model's test accuracy reaches this (0 = never)")
      ->capture_default_str();
  add(c, "--metrics-file", s.metrics_file, "JSON Lines: one record per round");
  add(c, "--checkpoint-dir", s.checkpoint_dir,
      "Save the server (model, optimizer, round) here every round; resume from it");
  c.add_flag("!--no-progress", s.progress, "No progress bar");
}

FederatedCommands::~FederatedCommands() = default;

bool FederatedCommands::parsed() const { return options_->simulate->parsed(); }

int FederatedCommands::run() {
  Options& o = *options_;
  auto& s = o.sim;
  s.partition = federated::parse_partition(o.partition);
  federated::apply_algorithm(o.algorithm, &s.local);
  DTRAIN_CHECK_INPUT(o.dataset == "fashion-mnist" || o.dataset == "synthetic", "--dataset '",
                     o.dataset, "': expected fashion-mnist or synthetic");
  models::ModelSpec spec;
  spec.name = o.model;
  spec.hidden = o.hidden;
  DTRAIN_CHECK_INPUT(o.model == "mlp" || o.model == "cnn" || o.model == "linear", "--model '",
                     o.model, "': expected mlp, cnn or linear");
  data::TensorDataset train, test;
  if (o.dataset == "fashion-mnist") {
    train = data::load_fashion_mnist(o.data_dir, data::Split::Train);
    test = data::load_fashion_mnist(o.data_dir, data::Split::Test);
  } else {
    DTRAIN_CHECK_INPUT(o.synthetic_examples >= 2, "--synthetic-examples must be >= 2");
    spec.input_shape = {1, 28, 28};
    train = data::make_synthetic(o.synthetic_examples, spec.input_shape, 10, s.seed + 1);
    test = data::make_synthetic(std::max<int64_t>(1000, o.synthetic_examples / 5),
                                spec.input_shape, 10, s.seed + 2);
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  at::set_num_threads(cores);  // evaluation; client threads use one each
  const auto result = federated::simulate(spec, train, test, s);
  double accuracy = -1;
  for (const auto& r : result.rounds) {
    if (r.test_accuracy >= 0) accuracy = r.test_accuracy;
  }
  std::printf("federated %s, %lld clients (%s), C = %g, E = %lld, B = %lld: %lld rounds",
              o.algorithm.c_str(), static_cast<long long>(s.clients),
              federated::to_string(s.partition).c_str(), s.fraction,
              static_cast<long long>(s.local.epochs), static_cast<long long>(s.local.batch),
              static_cast<long long>(result.rounds_done));
  if (accuracy >= 0) std::printf(", test accuracy %.4f", accuracy);
  if (result.rounds_to_target > 0) {
    std::printf(", reached %.3f in round %lld", s.target_accuracy,
                static_cast<long long>(result.rounds_to_target));
  }
  std::printf("\n");
  return 0;
}

}  // namespace dtrain::cli
