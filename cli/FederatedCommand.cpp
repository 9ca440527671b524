// `dtrain fl simulate|serve|client`: flags into the federated options, data sets loaded,
// summaries printed.
#include "Command.h"
#include "CommonFlags.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include <torch/torch.h>

#include "FederatedShared.h"
#include "Options.h"
#include "dtrain/comm/TokenFile.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/Aggregator.h"
#include "dtrain/services/federated/Client.h"
#include "dtrain/services/federated/SecureAggregation.h"
#include "dtrain/services/federated/Server.h"
#include "dtrain/services/federated/Simulation.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::cli {

class FederatedCommands final : public Command {
 public:
  /// Adds `fl` and its subcommands to `app`.
  explicit FederatedCommands(CLI::App& app);
  ~FederatedCommands();
  bool parsed() const override;
  int run(const std::vector<std::string>& args) override;

 private:
  int simulate();
  int serve();
  int client();
  struct Options;
  std::unique_ptr<Options> options_;
};

using namespace fl;

struct FederatedCommands::Options {
  CLI::App* simulate_cmd = nullptr;
  CLI::App* serve_cmd = nullptr;
  CLI::App* client_cmd = nullptr;
  Shared sim_shared, serve_shared, client_shared;
  federated::SimulationOptions sim;
  std::string partition = "iid";
  std::string availability_trace = "always";
  std::string byzantine = "none";
  std::string client_speed = "none", staleness = "poly:0.5", serve_staleness = "poly:0.5";
  federated::ServerOptions server;
  std::string server_token_file, client_tokens_file;
  federated::ClientOptions client;
  std::string client_token_file, client_partition, available = "always";
  double client_test_fraction = -1;  // < 0: 0.2 with --partition, else 0
  int64_t wait_ms = 10000;
  double rpc_timeout_s = 60, retry_window_s = 60;
  bool client_quiet = false;
  bool error_feedback = true;
};

FederatedCommands::FederatedCommands(CLI::App& app) : options_(std::make_unique<Options>()) {
  auto* fl = app.add_subcommand("fl", "Federated learning (FedAvg and its relatives)");
  fl->require_subcommand(1);
  Options& o = *options_;

  // simulate
  auto& s = o.sim;
  o.simulate_cmd = fl->add_subcommand(
      "simulate", "Simulate many clients in one process against the federated server's logic");
  CLI::App& c = *o.simulate_cmd;
  c.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add(c, "--clients", s.clients, "Clients (each a partition of the training set)")
      ->capture_default_str();
  add(c, "--fraction", s.fraction, "C: the fraction of clients selected each round")
      ->capture_default_str();
  add_round_flags(c, s.rounds, s.min_clients, s.secure_aggregation, s.secagg_threshold,
                  o.sim_shared.secagg_graph, s.metrics_file, "");
  add(c, "--partition", o.partition,
      "How the training set is cut: iid, shards:K (sorted labels, K shards per client: "
      "pathological non-IID) or dirichlet:ALPHA (label skew)")
      ->capture_default_str();
  add(c, "--local-test-fraction", s.local_test_fraction,
      "Share of each client's examples held out as its local test set")
      ->capture_default_str();
  add(c, "--client-examples", s.client_examples,
      "Examples a client holds at least: the set is dealt while it can give every client this "
      "many; a larger population (--clients 1000000) has each client draw this many by its "
      "seed, label-skewed by --partition")
      ->capture_default_str();
  add_plan(c, o.sim_shared);
  c.add_flag("!--no-error-feedback", o.error_feedback,
             "topk: drop what was not sent instead of keeping it for the next update");
  add(c, "--availability", o.availability_trace,
      "Who can be selected when: always, or diurnal:HOURS (each client, in its own time zone, "
      "available HOURS a day; a client whose window closes mid-round leaves it)")
      ->capture_default_str();
  add(c, "--round-minutes", s.availability.round_minutes,
      "Simulated minutes per round (moves the diurnal clock)")
      ->capture_default_str();
  add(c, "--client-speed", o.client_speed,
      "The virtual clock: each device's slowness, none (a round takes --round-minutes), "
      "constant, lognormal:SIGMA (median 1) or pareto:ALPHA (>= 1, heavy tail); a device takes "
      "slowness x --step-seconds per local step of simulated time")
      ->capture_default_str();
  add(c, "--step-seconds", s.speed.step_seconds,
      "Simulated seconds a median device takes per local step (batch)")
      ->capture_default_str();
  add(c, "--round-deadline", s.round_deadline,
      "Synchronous rounds on the virtual clock: simulated minutes a round waits for its clients "
      "(the slower ones are dropped; 0 = wait for every selected client)")
      ->capture_default_str();
  add_buffer_flags(c, s.buffer, o.staleness, " (in simulation: on the virtual clock)");
  add(c, "--byzantine", o.byzantine,
      "Faulty clients: F:KIND[:S], a fraction F of the clients (drawn from the seed) sending "
      "sign-flip (-S x their update, S = 1), scaled (S x, S = 10), gaussian (noise of standard "
      "deviation S = 1) or label-flip (trained on class c -> classes - 1 - c) updates")
      ->capture_default_str();
  add(c, "--dropout", s.dropout,
      "Probability that a selected client drops out before sending its update")
      ->capture_default_str();
  add(c, "--secagg-dropout", s.secagg_dropout,
      "The fraction of a round's clients expected to leave that --secagg-graph auto sizes the "
      "degree for (< 0: --dropout's)")
      ->capture_default_str();
  add_data(c, o.sim_shared, "the clients' data and the test set");
  add_run_flags(c, s.checkpoint_dir, s.eval_every, s.progress,
                "Save the server (model, optimizer, round) here every round; resume from it",
                "rounds");
  add(c, "--personalize-epochs", s.personalize_epochs,
      "After training, each client fine-tunes the global model for this many epochs on its own "
      "examples; both are tested on its local test set (0 = no personalization)")
      ->capture_default_str();
  add(c, "--personalize-layers", s.personalize_layers, "Fine-tune only the last N layers (0 = all)")
      ->capture_default_str();
  add(c, "--target-accuracy", s.target_accuracy,
      "Stop once the global model's test accuracy reaches this (0 = never)")
      ->capture_default_str();

  // serve
  auto& v = o.server;
  o.serve_cmd = fl->add_subcommand("serve", "Run the federated server (clients: dtrain fl client)");
  CLI::App& sv = *o.serve_cmd;
  sv.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add(sv, "--listen", v.listen, "HOST:PORT to serve on")->capture_default_str();
  add_round_flags(
      sv, v.rounds, v.min_clients, v.secure_aggregation, v.secagg_threshold,
      o.serve_shared.secagg_graph, v.metrics_file,
      "; also the fewest waiting clients a round starts with after --selection-timeout");
  add(sv, "--clients-per-round", v.clients_per_round, "K: clients selected each round")
      ->capture_default_str();
  add(sv, "--secagg-dropout", v.secagg_dropout,
      "The fraction of a round's clients expected to leave (after sharing keys) that "
      "--secagg-graph auto sizes the degree for; the server raises it to the largest share "
      "the last 5 secure rounds lost")
      ->capture_default_str();
  add_buffer_flags(sv, v.buffer, o.serve_staleness,
                   " (each client has --round-timeout from its start)");
  add(sv, "--population", v.population,
      "scaffold, feddyn: N, the clients in the federation (their server state moves by the "
      "share that took part; 0 = the most clients ever waiting at once)")
      ->capture_default_str();
  add(sv, "--round-timeout", v.round_timeout_s,
      "Seconds a round waits for its clients' updates (stragglers are dropped)")
      ->capture_default_str();
  add(sv, "--selection-timeout", v.selection_timeout_s,
      "Seconds to wait for K clients before starting a round with fewer")
      ->capture_default_str();
  add(sv, "--wait-timeout", v.wait_timeout_s,
      "Seconds with fewer than --min-clients waiting before giving up")
      ->capture_default_str();
  add_plan(sv, o.serve_shared);
  add_data(sv, o.serve_shared, "the test set the global model is evaluated on");
  add_run_flags(sv, v.checkpoint_dir, v.eval_every, v.progress,
                "Save the server (model, optimizer, round) here every round; resume from it",
                "rounds");
  add(sv, "--secagg-step-timeout", v.secagg_step_timeout_s,
      "Seconds each secure-aggregation step (keys, shares, reveals) waits for the clients")
      ->capture_default_str();
  add(sv, "--auth-token-file", o.server_token_file, "A token every call must carry");
  add(sv, "--client-tokens", o.client_tokens_file,
      "File of 'CLIENT_ID TOKEN' lines: each client's calls must carry its own token");
  add(sv, "--tls-cert", v.tls_cert, "PEM certificate chain: serve TLS");
  add(sv, "--tls-key", v.tls_key, "PEM private key of --tls-cert");

  // client
  auto& k = o.client;
  o.client_cmd = fl->add_subcommand("client", "Take part in federated training (a device)");
  CLI::App& cl = *o.client_cmd;
  cl.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add(cl, "--server", k.server, "HOST:PORT of dtrain fl serve")->required();
  add(cl, "--client-id", k.client_id, "This client's id (default: HOSTNAME-PID)");
  add(cl, "--partition", o.client_partition,
      "I/N: train on the I-th of N label-skewed slices of the training set (demos); default: "
      "all of it");
  add(cl, "--local-test-fraction", o.client_test_fraction,
      "The share of this client's examples held out to test personalization (default: 0.2 "
      "with --partition, else 0: all of them train)");
  add_data(cl, o.client_shared, "this client's own training examples");
  add_seed_flag(cl, o.client_shared.seed, "--dataset synthetic: the one it is made from");
  add(cl, "--available", o.available,
      "When this client may train: local-time windows like 22:00-06:00 (comma-separated), or "
      "always; it leaves a round when its window closes")
      ->capture_default_str();
  add(cl, "--auth-token-file", o.client_token_file, "The token this client's calls carry");
  cl.add_flag("--tls", k.tls, "Connect with TLS");
  add(cl, "--tls-ca", k.tls_ca, "PEM certificates to trust (default: the system's)");
  add(cl, "--wait-ms", o.wait_ms, "A check-in waits this long to be selected")
      ->capture_default_str();
  add(cl, "--rpc-timeout", o.rpc_timeout_s,
      "Seconds a call may take (a download or upload as a whole); calls within a round also end "
      "at its deadline")
      ->capture_default_str();
  add(cl, "--retry-window", o.retry_window_s,
      "Seconds an unreachable server is retried (with back-off) before the client gives up")
      ->capture_default_str();
  cl.add_flag(
      "--quiet", o.client_quiet,
      "No progress lines (selected, update sent, rounds left and why, the server unreachable)");
  add(cl, "--max-rounds", k.max_rounds, "Leave after training this many rounds (0 = until done)")
      ->capture_default_str();
  cl.add_flag("!--no-error-feedback", k.error_feedback,
              "topk: drop what was not sent instead of keeping it for the next update");
  add(cl, "--personalize-epochs", k.personalize_epochs,
      "When training is over, fine-tune the final model for this many epochs on this client's "
      "examples (0 = no personalization); both are tested on its held-out examples "
      "(--local-test-fraction)")
      ->capture_default_str();
  add(cl, "--personalize-layers", k.personalize_layers,
      "Fine-tune only the last N layers (0 = all)")
      ->capture_default_str();
  add(cl, "--save-model", k.save_model, "Save the personalized model here (torch::save)");
}

FederatedCommands::~FederatedCommands() = default;

bool FederatedCommands::parsed() const {
  return options_->simulate_cmd->parsed() || options_->serve_cmd->parsed() ||
         options_->client_cmd->parsed();
}

int FederatedCommands::run(const std::vector<std::string>&) {
  if (options_->serve_cmd->parsed()) return serve();
  if (options_->client_cmd->parsed()) return client();
  return simulate();
}

int FederatedCommands::simulate() {
  Options& o = *options_;
  auto& s = o.sim;
  const Shared& sh = o.sim_shared;
  s.partition = federated::parse_partition(o.partition);
  const double round_minutes = s.availability.round_minutes;
  s.availability = federated::parse_availability_trace(o.availability_trace);
  s.availability.round_minutes = round_minutes;
  s.local = sh.local;
  s.server = sh.server;
  s.dp = sh.dp;
  s.robust = sh.robust;
  s.feddyn_alpha = sh.feddyn_alpha;
  s.scaffold_option = sh.scaffold_option;
  s.byzantine = federated::parse_byzantine(o.byzantine);
  const double step_seconds = s.speed.step_seconds;
  s.speed = federated::parse_client_speed(o.client_speed);
  s.speed.step_seconds = step_seconds;
  DTRAIN_CHECK_INPUT(step_seconds > 0 && std::isfinite(step_seconds),
                     "--step-seconds must be > 0, got ", step_seconds);
  s.buffer.staleness = federated::parse_staleness(o.staleness);
  s.seed = sh.seed;
  s.threads = sh.threads;
  s.algorithm = sh.algorithm;
  s.compression = federated::parse_compression(sh.compression);
  s.compression.error_feedback = o.error_feedback;
  s.secagg_graph = federated::secagg::parse_secagg_graph(sh.secagg_graph);
  const models::ModelSpec spec = model_spec(sh, sh.model, sh.hidden);
  set_up_process(sh.threads);  // evaluation (--threads, or the cores); client threads use one each
  const data::TensorDataset train = load(sh, true), test = load(sh, false);
  if (!sh.init_from.empty()) s.initial = federated::flatten_parameters(initial_model(sh, spec));
  const auto result = federated::simulate(spec, train, test, s);
  double accuracy = -1, uplink = 0;
  int64_t applied = 0;
  for (const auto& r : result.rounds) {
    if (r.test_accuracy >= 0) accuracy = r.test_accuracy;
    if (r.outcome.applied) {
      uplink += static_cast<double>(r.uplink_bytes);
      ++applied;
    }
  }
  std::printf("federated %s, %lld clients (%s), ", sh.algorithm.c_str(),
              static_cast<long long>(s.clients), federated::to_string(s.partition).c_str());
  if (s.buffer.enabled()) {
    std::printf("buffered K = %lld, concurrency %lld, staleness %s",
                static_cast<long long>(s.buffer.size),
                static_cast<long long>(s.buffer.clients_at_once()),
                federated::to_string(s.buffer.staleness).c_str());
  } else {
    std::printf("C = %g", s.fraction);
  }
  std::printf(", E = %lld, B = %lld: %lld %s", static_cast<long long>(s.local.epochs),
              static_cast<long long>(s.local.batch), static_cast<long long>(result.rounds_done),
              s.buffer.enabled() ? "server steps" : "rounds");
  if (accuracy >= 0) std::printf(", test accuracy %.4f", accuracy);
  if (!result.rounds.empty() && result.rounds.back().dp_epsilon >= 0) {
    std::printf(", (%.3g, %g)-DP", result.rounds.back().dp_epsilon, s.dp.delta);
  }
  if (s.byzantine.enabled()) {
    std::printf(", faulty clients %s", federated::to_string(s.byzantine).c_str());
  }
  if (applied > 0) {
    std::printf(", uplink %.0f bytes per round (%s)", uplink / static_cast<double>(applied),
                federated::to_string(s.compression).c_str());
  }
  if (result.rounds_to_target > 0) {
    std::printf(", reached %.3f in %s %lld", s.target_accuracy,
                s.buffer.enabled() ? "step" : "round",
                static_cast<long long>(result.rounds_to_target));
    if (result.minutes_to_target >= 0) {
      std::printf(" (%.1f simulated minutes)", result.minutes_to_target);
    }
  }
  if (!result.rounds.empty() && result.rounds.back().sim_minutes >= 0) {
    std::printf(", %.1f simulated minutes in all", result.rounds.back().sim_minutes);
  }
  std::printf("\n");
  if (s.personalize_epochs > 0) {
    std::printf(
        "personalization (%lld epochs, %s): mean local test accuracy of %zu clients: "
        "global model %.4f, personalized %.4f\n",
        static_cast<long long>(s.personalize_epochs),
        s.personalize_layers == 0 ? "all layers"
                                  : concat("last ", s.personalize_layers, " layers").c_str(),
        result.personalization.global_accuracy.size(), result.personalization.mean_global,
        result.personalization.mean_personalized);
  }
  save_final(sh, spec, result.global);
  return 0;
}

int FederatedCommands::serve() {
  Options& o = *options_;
  auto& v = o.server;
  const Shared& sh = o.serve_shared;
  v.local = sh.local;
  v.algorithm = sh.algorithm;
  v.optimizer = sh.server;
  v.dp = sh.dp;
  v.robust = sh.robust;
  v.feddyn_alpha = sh.feddyn_alpha;
  v.scaffold_option = sh.scaffold_option;
  v.compression = federated::parse_compression(sh.compression);
  v.secagg_graph = federated::secagg::parse_secagg_graph(sh.secagg_graph);
  v.buffer.staleness = federated::parse_staleness(o.serve_staleness);
  v.model = sh.model;
  v.hidden = sh.hidden;
  v.seed = sh.seed;
  if (!o.server_token_file.empty()) v.token = rpc::read_token_file(o.server_token_file);
  if (!o.client_tokens_file.empty())
    v.client_tokens = federated::read_client_tokens(o.client_tokens_file);
  const models::ModelSpec spec = model_spec(sh, sh.model, sh.hidden);
  set_up_process(sh.threads);
  const data::TensorDataset test = load(sh, false);
  Model model = initial_model(sh, spec);
  federated::Server server(federated::flatten_parameters(model), v, [&](const at::Tensor& global) {
    federated::load_flat_parameters(model, global);
    return federated::evaluate_model(model, test);
  });
  if (v.buffer.enabled()) {
    std::fprintf(stderr,
                 "fl server: listening on %s (port %d), %lld buffered steps of %lld updates, "
                 "%lld clients at once, staleness %s\n",
                 v.listen.c_str(), server.port(), static_cast<long long>(v.rounds),
                 static_cast<long long>(v.buffer.size),
                 static_cast<long long>(v.buffer.clients_at_once()),
                 federated::to_string(v.buffer.staleness).c_str());
  } else {
    std::fprintf(stderr, "fl server: listening on %s (port %d), %lld rounds of %lld clients\n",
                 v.listen.c_str(), server.port(), static_cast<long long>(v.rounds),
                 static_cast<long long>(v.clients_per_round));
  }
  if (server.round() > 0) {
    std::fprintf(stderr, "fl server: resumed at round %lld from %s/server.pt\n",
                 static_cast<long long>(server.round()), v.checkpoint_dir.c_str());
  }
  const federated::ServerResult result = server.run();
  double accuracy = -1;
  for (const auto& r : result.rounds) {
    if (r.test_accuracy >= 0) accuracy = r.test_accuracy;
  }
  std::printf("fl server: %lld rounds", static_cast<long long>(result.rounds_done));
  if (accuracy >= 0) std::printf(", test accuracy %.4f", accuracy);
  std::printf(", %lld updates refused, %lld late\n", static_cast<long long>(result.refused),
              static_cast<long long>(result.late));
  save_final(sh, spec, result.global);
  return 0;
}

int FederatedCommands::client() {
  Options& o = *options_;
  auto& k = o.client;
  const Shared& sh = o.client_shared;
  if (k.client_id.empty()) k.client_id = default_client_id();
  if (!o.client_token_file.empty()) k.token = rpc::read_token_file(o.client_token_file);
  k.available = federated::parse_availability(o.available);
  k.wait = std::chrono::milliseconds(o.wait_ms);
  DTRAIN_CHECK_INPUT(o.rpc_timeout_s > 0, "--rpc-timeout ", o.rpc_timeout_s,
                     ": expected a positive number of seconds");
  DTRAIN_CHECK_INPUT(o.retry_window_s >= 0, "--retry-window ", o.retry_window_s,
                     ": expected 0 or more seconds");
  k.rpc_timeout = std::chrono::milliseconds(std::llround(o.rpc_timeout_s * 1000));
  k.retry_window = std::chrono::milliseconds(std::llround(o.retry_window_s * 1000));
  if (!o.client_quiet) {
    const std::string id = k.client_id;
    k.log = [id](const std::string& line) {
      std::fprintf(stderr, "fl client %s: %s\n", id.c_str(), line.c_str());
    };
  }
  set_up_process(sh.threads);
  data::TensorDataset train = load(sh, true);
  const double test_fraction = o.client_test_fraction >= 0  ? o.client_test_fraction
                               : o.client_partition.empty() ? 0
                                                            : 0.2;
  DTRAIN_CHECK_INPUT(test_fraction < 1, "--local-test-fraction must be in [0, 1), got ",
                     test_fraction);
  std::vector<int64_t> indices;
  if (o.client_partition.empty()) {
    // Its own examples: a seeded shuffle, the last share held out (none by default).
    indices.resize(static_cast<size_t>(train.size()));
    std::iota(indices.begin(), indices.end(), 0);
    const auto test =
        static_cast<int64_t>(std::floor(test_fraction * static_cast<double>(indices.size())));
    DTRAIN_CHECK_INPUT(static_cast<int64_t>(indices.size()) - test >= 1, "--local-test-fraction ",
                       test_fraction, " leaves none of the ", indices.size(),
                       " examples to train on");
    if (test > 0) {
      std::shuffle(indices.begin(), indices.end(), std::mt19937_64(sh.seed));
      k.test_indices.assign(indices.end() - test, indices.end());
      indices.resize(indices.size() - static_cast<size_t>(test));
    }
  } else {
    long long index = -1, count = -1;
    char extra = 0;
    DTRAIN_CHECK_INPUT(
        std::sscanf(o.client_partition.c_str(), "%lld/%lld%c", &index, &count, &extra) == 2 &&
            count >= 1 && index >= 0 && index < count,
        "--partition '", o.client_partition, "': expected I/N with 0 <= I < N");
    const federated::ClientIndices slice =
        federated::partition_slice(train.targets(), index, count, test_fraction);
    indices = slice.train;
    k.test_indices = slice.test;
  }
  const Shared shared = sh;
  federated::Client client(
      [shared](const std::string& name, const std::vector<int64_t>& hidden) {
        return models::make_model(model_spec(shared, name, hidden));
      },
      std::move(train), std::move(indices), k);
  const federated::ClientReport report = client.run();
  std::printf(
      "fl client %s: %lld rounds trained, %lld left (unavailable), %lld missed (closed "
      "or past the deadline), %lld uploads refused; uplink %lld bytes, downlink %lld "
      "bytes; %s\n",
      k.client_id.c_str(), static_cast<long long>(report.rounds_trained),
      static_cast<long long>(report.rounds_abandoned), static_cast<long long>(report.rounds_missed),
      static_cast<long long>(report.uploads_refused), static_cast<long long>(report.uplink_bytes),
      static_cast<long long>(report.downlink_bytes), report.done_reason.c_str());
  if (report.personalized_accuracy >= 0) {
    std::printf(
        "fl client %s: personalized (%lld epochs): local test accuracy %.4f, the global "
        "model's %.4f\n",
        k.client_id.c_str(), static_cast<long long>(k.personalize_epochs),
        report.personalized_accuracy, report.global_accuracy);
  }
  return 0;
}

std::unique_ptr<Command> federated_command(CLI::App& app) {
  return std::make_unique<FederatedCommands>(app);
}

}  // namespace dtrain::cli
