// `dtrain fl serve`: the federated server over gRPC (services/federated/service).
#include "Command.h"
#include "CommonFlags.h"

#include <cstdio>

#include "FederatedShared.h"
#include "NumericOptions.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/comm/TokenFile.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/service/Server.h"
#include "dtrain/services/federated/simulation/Simulation.h"

namespace dtrain::cli::fl {

namespace {

struct ServeOptions {
  CLI::App* serve_cmd = nullptr;
  Shared serve_shared;
  services::federated::ServerOptions server;
  std::string server_token_file, client_tokens_file;
  std::string serve_staleness = "poly:0.5";
};

class ServeCommand final : public Command {
 public:
  explicit ServeCommand(CLI::App* fl) {
    ServeOptions& o = options_;
    auto& v = o.server;
    o.serve_cmd =
        fl->add_subcommand("serve", "Run the federated server (clients: dtrain fl client)");
    CLI::App& sv = *o.serve_cmd;
    sv.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    add(sv, "--listen", v.listen, "HOST:PORT to serve on")->capture_default_str();
    add_round_flags(
        sv, v.rounds, o.serve_shared, v.secagg_threshold, v.metrics_file,
        "; also the fewest waiting clients a round starts with after --selection-timeout");
    add(sv, "--clients-per-round", o.serve_shared.round.clients_per_round,
        "K: clients selected each round")
        ->capture_default_str();
    add(sv, "--secagg-dropout", v.secagg_dropout,
        "The fraction of a round's clients expected to leave (after sharing keys) that "
        "--secagg-graph auto sizes the degree for; the server raises it to the largest share "
        "the last 5 secure rounds lost")
        ->capture_default_str();
    add_buffer_flags(sv, o.serve_shared, o.serve_staleness,
                     " (each client has --round-timeout from its start)");
    add(sv, "--population", o.serve_shared.round.population,
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
  }
  bool parsed() const override { return options_.serve_cmd->parsed(); }
  int run(const std::vector<std::string>&) override;

 private:
  ServeOptions options_;
};

int ServeCommand::run(const std::vector<std::string>&) {
  ServeOptions& o = options_;
  auto& v = o.server;
  const Shared& sh = o.serve_shared;
  v.round = sh.round;
  v.compression = comm::parse_compression(sh.compression);
  v.secagg_graph = services::federated::secagg::parse_secagg_graph(sh.secagg_graph);
  v.round.buffer.staleness = services::federated::parse_staleness(o.serve_staleness);
  v.model = sh.model.name;
  v.hidden = sh.model.hidden;
  if (!o.server_token_file.empty()) v.token = comm::rpc::read_token_file(o.server_token_file);
  if (!o.client_tokens_file.empty())
    v.client_tokens = services::federated::read_client_tokens(o.client_tokens_file);
  const models::ModelSpec spec = model_spec(sh, sh.model.name, sh.model.hidden);
  set_up_process(sh.threads);
  const data::TensorDataset test = load(sh, false);
  Model model = initial_model(sh, spec);
  services::federated::Server server(services::federated::flatten_parameters(model), v,
                                     [&](const at::Tensor& global) {
                                       services::federated::load_flat_parameters(model, global);
                                       return services::federated::evaluate_model(model, test);
                                     });
  if (v.round.buffer.enabled()) {
    std::fprintf(stderr,
                 "fl server: listening on %s (port %d), %lld buffered steps of %lld updates, "
                 "%lld clients at once, staleness %s\n",
                 v.listen.c_str(), server.port(), static_cast<long long>(v.rounds),
                 static_cast<long long>(v.round.buffer.size),
                 static_cast<long long>(v.round.buffer.clients_at_once()),
                 services::federated::to_string(v.round.buffer.staleness).c_str());
  } else {
    std::fprintf(stderr, "fl server: listening on %s (port %d), %lld rounds of %lld clients\n",
                 v.listen.c_str(), server.port(), static_cast<long long>(v.rounds),
                 static_cast<long long>(v.round.clients_per_round));
  }
  if (server.round() > 0) {
    std::fprintf(stderr, "fl server: resumed at round %lld from %s/server.pt\n",
                 static_cast<long long>(server.round()), v.checkpoint_dir.c_str());
  }
  const services::federated::ServerResult result = server.run();
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

}  // namespace

std::unique_ptr<Command> serve_command(CLI::App* fl) { return std::make_unique<ServeCommand>(fl); }

}  // namespace dtrain::cli::fl
