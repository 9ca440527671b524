// `dtrain ps serve`: one parameter-server shard (Downpour's and Sandblaster's), until SIGINT
// or SIGTERM, with its checkpoints, token and TLS.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "Command.h"
#include "NumericOptions.h"
#include "dtrain/comm/TokenFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/services/ps/ShardServer.h"

namespace dtrain::cli {

namespace {

volatile std::sig_atomic_t g_stop_serving = 0;

// `dtrain ps serve`: one parameter-server shard until SIGINT or SIGTERM.
int serve_shard(services::ps::ShardServerOptions options, const std::string& shard_text,
                double report_s) {
  const auto slash = shard_text.find('/');
  int shard = -1, shards = -1;
  try {
    if (slash != std::string::npos) {
      size_t used = 0;
      shard = std::stoi(shard_text.substr(0, slash), &used);
      if (used != slash) shard = -1;
      shards = std::stoi(shard_text.substr(slash + 1), &used);
      if (used != shard_text.size() - slash - 1) shards = -1;
    }
  } catch (const std::exception&) {
    shard = shards = -1;
  }
  DTRAIN_CHECK_INPUT(shard >= 0 && shards >= 1 && shard < shards, "--shard '", shard_text,
                     "': expected I/N with 0 <= I < N (this shard's index and the shard count)");
  options.shard = shard;
  options.shards = shards;
  DTRAIN_CHECK_INPUT(report_s >= 0, "--report-every must be >= 0 seconds");
  DTRAIN_CHECK_INPUT(options.max_workers >= 1, "--max-workers must be >= 1, got ",
                     options.max_workers);
  services::ps::check_shard_optimizer(options.optimizer);
  dtrain::launch::tune_allocator();  // megabyte messages: no mmap/munmap per message
  services::ps::ShardServer server(options);
  std::signal(SIGINT, [](int) { g_stop_serving = 1; });
  std::signal(SIGTERM, [](int) { g_stop_serving = 1; });
  if (server.resumed_version() >= 0) {
    std::printf("parameter-server shard %d/%d resumed from %s at version %lld\n", shard, shards,
                services::ps::shard_checkpoint_file(options.checkpoint_dir, shard, shards).c_str(),
                static_cast<long long>(server.resumed_version()));
  }
  std::printf(
      "parameter-server shard %d/%d listening on %s (port %d), optimizer %s, lr %g (%s)%s%s\n",
      shard, shards, options.listen.c_str(), server.port(), options.optimizer.name.c_str(),
      options.optimizer.lr, options.optimizer.schedule.decay.c_str(),
      options.auth_token.empty() ? "" : ", token required",
      options.tls_cert.empty() ? "" : ", TLS");
  std::fflush(stdout);
  auto last_report = std::chrono::steady_clock::now();
  int64_t last_version = server.shard().version();
  while (!g_stop_serving) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto now = std::chrono::steady_clock::now();
    const double since = std::chrono::duration<double>(now - last_report).count();
    if (report_s > 0 && since >= report_s) {
      const int64_t version = server.shard().version();
      if (version != last_version) {
        std::printf("parameter-server shard %d/%d: version %lld, %.1f updates/s, lr %g\n", shard,
                    shards, static_cast<long long>(version), (version - last_version) / since,
                    server.shard().current_lr());
        std::fflush(stdout);
      }
      last_version = version;
      last_report = now;
    }
  }
  server.shutdown();
  std::printf("parameter-server shard %d/%d stopped at version %lld%s\n", shard, shards,
              static_cast<long long>(server.shard().version()),
              options.checkpoint_dir.empty() ? "" : " (checkpoint saved)");
  return 0;
}

class PsCommand final : public Command {
 public:
  explicit PsCommand(CLI::App& app) {
    options_.listen = "0.0.0.0:29600";
    auto* ps = app.add_subcommand("ps", "Parameter server (Downpour / Sandblaster)");
    ps->require_subcommand(1);
    serve_ = ps->add_subcommand("serve", "Serve one parameter-server shard until interrupted");
    serve_->add_option("--listen", options_.listen, "host:port to listen on (port 0: any free one)")
        ->capture_default_str();
    serve_->add_option("--shard", shard_text_, "I/N: this shard's index and the number of shards")
        ->capture_default_str();
    serve_
        ->add_option("--optimizer", options_.optimizer.name,
                     "Optimizer applied to pushed gradients: adagrad, sgd or adam")
        ->capture_default_str();
    add(*serve_, "--lr", options_.optimizer.lr, "Learning rate")->capture_default_str();
    add(*serve_, "--lr-decay", options_.optimizer.schedule.decay,
        "Schedule by version: constant, step or cosine")
        ->capture_default_str();
    add(*serve_, "--warmup-versions", options_.optimizer.schedule.warmup_steps,
        "Linear warmup over this many updates")
        ->capture_default_str();
    add(*serve_, "--total-versions", options_.optimizer.total_versions,
        "Updates the schedule spans (cosine decays to its end)")
        ->capture_default_str();
    add(*serve_, "--lr-step-size", options_.optimizer.schedule.step_size,
        "Step decay: updates between decays")
        ->capture_default_str();
    add(*serve_, "--lr-gamma", options_.optimizer.schedule.gamma, "Step decay factor")
        ->capture_default_str();
    add(*serve_, "--checkpoint-dir", options_.checkpoint_dir,
        "Save the shard (values, optimizer state, version) here every --checkpoint-interval "
        "seconds and at exit, atomically; resume from it at start");
    add(*serve_, "--checkpoint-interval", options_.checkpoint_interval_s,
        "Seconds between shard checkpoints")
        ->capture_default_str();
    add(*serve_, "--auth-token-file", token_file_,
        "Every call must carry the token in this file (UNAUTHENTICATED otherwise)");
    add(*serve_, "--tls-cert", options_.tls_cert, "PEM certificate chain: serve TLS");
    add(*serve_, "--tls-key", options_.tls_key, "PEM private key of --tls-cert");
    add(*serve_, "--max-workers", options_.max_workers,
        "Worker ids run from 0 to this - 1 (pushes from others are refused)")
        ->capture_default_str();
    add(*serve_, "--report-every", report_s_,
        "Seconds between the shard's traffic lines (0 = none)")
        ->capture_default_str();
  }
  bool parsed() const override { return serve_->parsed(); }
  int run(const std::vector<std::string>&) override {
    if (!token_file_.empty()) options_.auth_token = dtrain::comm::rpc::read_token_file(token_file_);
    return serve_shard(options_, shard_text_, report_s_);
  }

 private:
  CLI::App* serve_ = nullptr;
  services::ps::ShardServerOptions options_;
  std::string shard_text_ = "0/1";
  std::string token_file_;
  double report_s_ = 10;
};

}  // namespace

std::unique_ptr<Command> ps_command(CLI::App& app) { return std::make_unique<PsCommand>(app); }

}  // namespace dtrain::cli
