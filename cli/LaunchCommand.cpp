// `dtrain launch`: starts ranks of any program with torchrun's environment (RANK, WORLD_SIZE,
// MASTER_ADDR, ...), on one node or several, static or elastic, with restarts.
#include <cstdio>
#include <sstream>

#include "Command.h"
#include "ConfigFile.h"
#include "NumericOptions.h"
#include "dtrain/common/Error.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/launch/Launcher.h"

namespace dtrain::cli {

namespace {

class LaunchCommand final : public Command {
 public:
  explicit LaunchCommand(CLI::App& app)
      : app_(app.add_subcommand(
            "launch",
            "Start ranks of a program with torchrun's environment (RANK, WORLD_SIZE, ...)")) {
    app_->add_option("--nproc-per-node", nproc_,
                     "Ranks on this node: N, auto (the CUDA devices, else the cores), cpu or gpu")
        ->capture_default_str();
    app_->add_option("--nnodes", nnodes_,
                     "Nodes: N, or MIN:MAX for an elastic job (it starts with MIN..MAX nodes and "
                     "restarts at the new size when a node leaves or joins)")
        ->capture_default_str();
    add(*app_, "--node-rank", launch_.node_rank,
        "This node's index (required with --nnodes N > 1; elastic: 0 on the host at "
        "--master-addr, left out elsewhere)");
    add(*app_, "--master-addr", launch_.master_addr, "Rendezvous address")->capture_default_str();
    add(*app_, "--master-port", launch_.master_port,
        "Rendezvous port (default: a free port on one node; 29500 with several, as torchrun)");
    app_->add_flag("--standalone", standalone_,
                   "One node, its rendezvous on 127.0.0.1 at a free port (torchrun's "
                   "--standalone; what one node does without it too)");
    add(*app_, "--threads", launch_.threads, "Threads per rank (default cores/ranks)");
    add(*app_, "--interface", launch_.interface,
        "Network interface for the ranks' traffic (default: the one that reaches --master-addr; "
        "sets GLOO_SOCKET_IFNAME)");
    add(*app_, "--max-restarts", launch_.max_restarts,
        "Restart the job this many times after a failure (training resumes from its newest "
        "checkpoint)")
        ->capture_default_str();
    app_->add_flag("--tolerate-failures", launch_.tolerate_failures,
                   "A rank other than 0 failing does not stop the others (independent "
                   "workers: --strategy downpour or sandblaster; --fault-tolerance replicas)");
    add(*app_, "--max-replacements", launch_.max_replacements,
        "With --tolerate-failures: start a failed rank again up to this many times, as a "
        "replacement that joins the running ranks (--fault-tolerance replicas only)")
        ->capture_default_str();
    add(*app_, "--replica-size", launch_.replica_size,
        "With --tolerate-failures: ranks fail and are started again in replicas of this many "
        "consecutive ranks (--fault-tolerance replicas with --tensor-parallel K: K); a replica's "
        "ranks are on one node")
        ->capture_default_str();
    app_->add_flag("--replace-first-replica", launch_.replace_first_replica,
                   "With --tolerate-failures: rank 0 (its replica) failing does not stop the job "
                   "either; it is left out and started again like the others (--fault-tolerance "
                   "replicas, where the next replica present leads)");
    add(*app_, "--rdzv-timeout", launch_.rendezvous_timeout_seconds,
        "Seconds for every node to join (and to reach the store)")
        ->capture_default_str();
    add(*app_, "--rdzv-last-call", launch_.last_call_seconds,
        "Elastic: seconds the host waits for more nodes once MIN have joined")
        ->capture_default_str();
    add(*app_, "--heartbeat-timeout", launch_.heartbeat_timeout_seconds,
        "Seconds without a heartbeat before another node counts as failed")
        ->capture_default_str();
    add(*app_, "--grace", launch_.grace_seconds,
        "Seconds between SIGTERM and SIGKILL when stopping ranks")
        ->capture_default_str();
    add(*app_, "--stop-timeout", launch_.stop_timeout_seconds,
        "On SIGINT, SIGTERM or SIGUSR1 (forwarded to the ranks: dtrain's finish their step and "
        "save), seconds the ranks have to exit before they are killed; a second signal stops "
        "them at once")
        ->capture_default_str();
    app_->add_flag("!--no-prefix", launch_.prefix_output, "Do not prefix lines with the rank");
    app_->add_option("command", launch_.command, "-- PROGRAM [ARGS...]")->required();
    add_config_option(*app_);
  }
  std::vector<std::string> expand(const std::vector<std::string>& args) override {
    return expand_config(args, *app_, {"launch"});
  }
  bool parsed() const override { return app_->parsed(); }
  int run(const std::vector<std::string>&) override {
    from_scheduler();
    launch_.nproc_per_node = dtrain::launch::parse_nproc_per_node(nproc_, "--nproc-per-node");
    dtrain::launch::parse_nnodes(nnodes_, launch_);
    if (standalone_) {
      DTRAIN_CHECK_INPUT(launch_.nnodes == 1 && launch_.min_nodes == 0,
                         "--standalone is one node; it cannot be given with --nnodes ", nnodes_);
      launch_.master_addr = "127.0.0.1";
      launch_.master_port = 0;
    } else if ((launch_.nnodes > 1 || launch_.min_nodes > 0) && launch_.master_port == 0) {
      launch_.master_port = kTorchrunPort;
    }
    return dtrain::launch::launch(launch_);
  }

 private:
  // The flags not given, from what Kubernetes' operators or Slurm set (torchrun's PET_*
  // variables first; dtrain/launch/Environment.h), said in one line.
  void from_scheduler() {
    const auto env = dtrain::launch::launch_environment();
    if (env.source.empty()) return;
    std::string took;
    const auto fill = [&](const char* flag, const auto& value, auto& target) {
      if (!value || app_->count(flag) > 0) return;
      target = *value;
      std::ostringstream line;
      line << " " << flag << " " << *value;
      took += line.str();
    };
    fill("--nnodes", env.nnodes, nnodes_);
    fill("--nproc-per-node", env.nproc_per_node, nproc_);
    fill("--node-rank", env.node_rank, launch_.node_rank);
    fill("--master-addr", env.master_addr, launch_.master_addr);
    fill("--master-port", env.master_port, launch_.master_port);
    fill("--max-restarts", env.max_restarts, launch_.max_restarts);
    if (!took.empty())
      std::fprintf(stderr, "dtrain launch: from %s:%s\n", env.source.c_str(), took.c_str());
  }

  CLI::App* app_;
  dtrain::launch::LaunchOptions launch_;
  std::string nproc_ = "1";
  std::string nnodes_ = "1";
  bool standalone_ = false;
  static constexpr int kTorchrunPort = 29500;  // torchrun's default --master-port
};

}  // namespace

std::unique_ptr<Command> launch_command(CLI::App& app) {
  return std::make_unique<LaunchCommand>(app);
}

}  // namespace dtrain::cli
