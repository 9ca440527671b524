// `dtrain fl client`: one device taking part in federated training over gRPC
// (services/federated/service).
#include "Command.h"
#include "CommonFlags.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "FederatedShared.h"
#include "NumericOptions.h"
#include "dtrain/comm/TokenFile.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"

namespace dtrain::cli::fl {

namespace {

struct ClientCommandOptions {
  CLI::App* client_cmd = nullptr;
  Shared client_shared;
  services::federated::ClientOptions client;
  std::string client_token_file, client_partition, available = "always";
  double client_test_fraction = -1;  // < 0: 0.2 with --partition, else 0
  int64_t wait_ms = 10000;
  double rpc_timeout_s = 60, retry_window_s = 60;
  bool client_quiet = false;
};

class ClientCommand final : public Command {
 public:
  explicit ClientCommand(CLI::App* fl) {
    ClientCommandOptions& o = options_;
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
    add_seed_flag(cl, o.client_shared.round.seed, "--dataset synthetic: the one it is made from");
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
  bool parsed() const override { return options_.client_cmd->parsed(); }
  int run(const std::vector<std::string>&) override;

 private:
  ClientCommandOptions options_;
};

int ClientCommand::run(const std::vector<std::string>&) {
  ClientCommandOptions& o = options_;
  auto& k = o.client;
  const Shared& sh = o.client_shared;
  if (k.client_id.empty()) k.client_id = default_client_id();
  if (!o.client_token_file.empty()) k.token = comm::rpc::read_token_file(o.client_token_file);
  k.available = services::federated::parse_availability(o.available);
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
  const services::federated::ClientIndices mine = services::federated::client_examples(
      train.targets(), o.client_partition, test_fraction, sh.round.seed);
  std::vector<int64_t> indices = mine.train;
  k.test_indices = mine.test;
  const Shared shared = sh;
  services::federated::Client client(
      [shared](const std::string& name, const std::vector<int64_t>& hidden) {
        return models::make_model(model_spec(shared, name, hidden));
      },
      std::move(train), std::move(indices), k);
  const services::federated::ClientReport report = client.run();
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

}  // namespace

std::unique_ptr<Command> client_command(CLI::App* fl) {
  return std::make_unique<ClientCommand>(fl);
}

}  // namespace dtrain::cli::fl
