// `dtrain train`: trains a reference model (the job's options are its flags, or a TOML file's
// keys); with --nproc N it starts N local ranks of itself, with --ps-shards N the shards.
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "Command.h"
#include "CommonFlags.h"
#include "ConfigFile.h"
#include "DryRun.h"
#include "Help.h"
#include "NumericOptions.h"
#include "TrainFlags.h"
#include "dtrain/comm/TokenFile.h"
#include "dtrain/common/Blas.h"
#include "dtrain/common/Error.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/launch/Launcher.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "dtrain/parallel/ps/PsOptions.h"
#ifdef DTRAIN_SERVICES
#include "dtrain/services/ps/LocalShards.h"
#endif
#include "dtrain/train/Job.h"
#include "dtrain/train/RunPlan.h"
#include "dtrain/train/Stop.h"

namespace dtrain::cli {

namespace {

#ifdef DTRAIN_SERVICES
// The ranks' arguments once the shards run here: they connect to `addresses` (--ps) instead of
// starting shards of their own.
std::vector<std::string> with_local_shards(const std::vector<std::string>& args,
                                           const std::string& addresses) {
  std::vector<std::string> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    bool dropped = false;
    for (const char* flag : {"--ps-shards", "--ps-optimizer", "--ps-lr"}) {
      if (args[i] == flag) {
        ++i;
        dropped = true;
      } else if (args[i].rfind(std::string(flag) + "=", 0) == 0) {
        dropped = true;
      }
    }
    if (!dropped) kept.push_back(args[i]);
  }
  kept.push_back("--ps");
  kept.push_back(addresses);
  return kept;
}
#endif

void write_run_files(const dtrain::train::JobConfig& job, const dtrain::train::RunPlan& plan);

// The run's folder (--run-dir DIR, or runs/MODEL-DATE-TIME when nothing says where the run's
// outputs go): its metrics, the options given (config.toml: `--config` reads it back; the model's
// recipe fills the rest as it did), the command line, and with --run-dir its checkpoints. The
// ranks are told the paths (`args`).
void open_run_folder(dtrain::train::JobConfig& job, const dtrain::train::RunPlan& plan,
                     std::vector<std::string>& args) {
  auto& t = job.trainer;
  const bool defaulted =
      job.run_dir.empty() && t.metrics_file.empty() && t.checkpoint_dir.empty() && !job.no_run_dir;
  std::error_code error;
  if (defaulted) {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &local);
    const std::string base = "runs/" + job.model.name + "-" + stamp;
    std::filesystem::create_directories("runs", error);
    for (int i = 1; i < 1000 && job.run_dir.empty(); ++i) {
      const std::string dir = i == 1 ? base : base + "-" + std::to_string(i);
      if (std::filesystem::create_directory(dir, error)) job.run_dir = dir;
      if (error) break;
    }
    if (job.run_dir.empty()) {
      std::fprintf(stderr,
                   "dtrain: warning: no run folder under runs/ (%s); going on without one "
                   "(--no-run-dir says so)\n",
                   error ? error.message().c_str() : "taken");
      return;
    }
  }
  if (job.run_dir.empty()) return;
  std::filesystem::create_directories(job.run_dir, error);
  DTRAIN_CHECK_INPUT(!error, "--run-dir ", job.run_dir, ": cannot create it (", error.message(),
                     ")");
  if (t.metrics_file.empty()) {
    t.metrics_file = job.run_dir + "/metrics.jsonl";
    args.push_back("--metrics");
    args.push_back(t.metrics_file);
  }
  if (!defaulted && t.checkpoint_dir.empty()) {
    t.checkpoint_dir = job.run_dir + "/checkpoints";
    args.push_back("--checkpoint-dir");
    args.push_back(t.checkpoint_dir);
  }
  write_run_files(job, plan);
}

// A rank started by a launcher (srun, `dtrain launch`, a Kubernetes operator, torchrun) with
// --run-dir: the run folder's paths, unless given (`dtrain train --nproc` gives them); rank 0
// writes its files where no one has.
void adopt_run_folder(dtrain::train::JobConfig& job, const dtrain::train::RunPlan& plan) {
  if (job.run_dir.empty()) return;
  std::error_code error;
  std::filesystem::create_directories(job.run_dir, error);
  DTRAIN_CHECK_INPUT(!error, "--run-dir ", job.run_dir, ": cannot create it (", error.message(),
                     ")");
  auto& t = job.trainer;
  if (t.metrics_file.empty()) t.metrics_file = job.run_dir + "/metrics.jsonl";
  if (t.checkpoint_dir.empty()) t.checkpoint_dir = job.run_dir + "/checkpoints";
  const char* rank = std::getenv("RANK") ? std::getenv("RANK") : std::getenv("SLURM_PROCID");
  if (rank != nullptr && std::string(rank) == "0" &&
      !std::filesystem::exists(job.run_dir + "/command.txt")) {
    write_run_files(job, plan);
  }
}

// command.txt, plan.toml and config.toml in the run folder.
void write_run_files(const dtrain::train::JobConfig& job, const dtrain::train::RunPlan& plan) {
  const auto& t = job.trainer;
  const auto extra = [&](const char* key) {
    const auto found = t.checkpoint_extras.find(key);
    return found == t.checkpoint_extras.end() ? std::string() : found->second;
  };
  std::ofstream(job.run_dir + "/command.txt") << command_line() << "\n";
  std::ofstream(job.run_dir + "/plan.toml") << extra("plan") << plan.describe();
  std::ofstream config(job.run_dir + "/config.toml");
  config << "# dtrain train's options as given (" << command_line() << ")\n";
  if (!extra("recipe").empty()) config << "# " << extra("recipe") << "\n";
  config << extra("config");
}

// --tensorboard DIR: made and written to before this process joins the world (a folder it
// cannot write is one error on every rank a scheduler started, exit 2, not rank 0's alone
// mid-start while the others wait); `say`: print the command that shows it.
void check_tensorboard_folder(const std::string& dir, bool say) {
  if (dir.empty()) return;
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  DTRAIN_CHECK_INPUT(!error, "--tensorboard ", dir, ": cannot create it (", error.message(), ")");
  const std::string probe = dir + "/.dtrain-write-test." + std::to_string(::getpid());
  const bool writable = static_cast<bool>(std::ofstream(probe) << "");
  std::filesystem::remove(probe, error);
  DTRAIN_CHECK_INPUT(writable, "--tensorboard ", dir, ": cannot write in it");
  if (say) std::printf("TensorBoard: tensorboard --logdir %s\n", dir.c_str());
}

// At the end: where the run's outputs are.
void print_run_folder(const dtrain::train::JobConfig& job) {
  if (job.run_dir.empty()) return;
  std::printf(
      "run folder: %s (metrics.jsonl: draw it with scripts/plot-metrics; config.toml, "
      "plan.toml, command.txt%s)\n",
      job.run_dir.c_str(),
      job.trainer.checkpoint_dir.rfind(job.run_dir, 0) == 0 ? ", checkpoints/" : "");
}

// After a stop on request: the command that resumes the run (the same one: a run resumes from
// the newest checkpoint in its --checkpoint-dir).
void print_resume(const dtrain::train::JobConfig& job) {
  std::fflush(stdout);
  if (job.trainer.checkpoint_dir.empty()) {
    std::fprintf(stderr,
                 "dtrain: stopped on request; nothing was saved (no --checkpoint-dir): give "
                 "--run-dir DIR or --checkpoint-dir DIR to make a run that can stop and "
                 "resume\n");
  } else if (!job.trainer.resume) {
    std::fprintf(stderr,
                 "dtrain: stopped on request; to resume from its checkpoint in %s, run the same "
                 "command without --no-resume\n",
                 job.trainer.checkpoint_dir.c_str());
  } else {
    std::fprintf(stderr, "dtrain: stopped on request; resume with:\n  %s\n",
                 command_line().c_str());
  }
}

// --help's groups, in order (flags of strategies registered elsewhere stay in "Options").
const std::vector<std::pair<std::string, std::vector<std::string>>> kTrainGroups = {
    {"Model",
     {"--model",
      "--hidden",
      "--layers",
      "--heads",
      "--kv-heads",
      "--width",
      "--head-dim",
      "--qk-norm",
      "--ffn-width",
      "--context",
      "--rope-theta",
      "--norm-eps",
      "--dropout",
      "--tied-embeddings",
      "--moe-experts",
      "--moe-top-k",
      "--moe-shared-experts",
      "--moe-every",
      "--moe-first-dense",
      "--moe-capacity",
      "--moe-score",
      "--no-moe-normalize",
      "--moe-ffn-width",
      "--moe-aux-loss",
      "--moe-z-loss",
      "--init-from",
      "--allow-non-finite-weights",
      "--seed"}},
    {"Data",
     {"--dataset", "--data-dir", "--synthetic-examples", "--text-file", "--validation-fraction",
      "--vocab-size", "--image-size", "--augment", "--max-bad-samples", "--tokenizer"}},
    {"Batch, optimizer and schedule",
     {"--epochs",
      "--batch-size",
      "--accumulation",
      "--global-batch",
      "--micro-batches",
      "--max-steps",
      "--stop-at-step",
      "--optimizer",
      "--lr",
      "--momentum",
      "--weight-decay",
      "--nesterov",
      "--freeze-variance-after",
      "--offload",
      "--offload-bucket-mb",
      "--lr-decay",
      "--warmup-steps",
      "--lr-step-size",
      "--lr-gamma",
      "--reference-batch",
      "--max-grad-norm",
      "--max-nonfinite-steps"}},
    {"Processes",
     {"--nproc", "--threads", "--device", "--backend", "--interface", "--comm-timeout"}},
    {"Parallelism",
     {"--strategy",
      "--pipeline-parallel",
      "--stage-replicas",
      "--tensor-parallel",
      "--sequence-parallel",
      "--tp-comm-overlap",
      "--context-parallel",
      "--cp-method",
      "--cp-split",
      "--reset-attention-mask",
      "--eod-token",
      "--overlap-param-gather",
      "--zero-quantized",
      "--zero-quantized-block",
      "--zero3-min-unit-params",
      "--no-zero3-prefetch",
      "--schedule",
      "--virtual-stages",
      "--pipeline-balance",
      "--pipeline-sync",
      "--weight-prediction",
      "--pipeline-transport",
      "--bucket-cap-mb",
      "--grad-compression",
      "--hierarchical-allreduce",
      "--ranks-per-host",
      "--error-on-unused-parameters",
      "--sync-batchnorm",
      "--check-collectives",
      "--simulate-slowdown"}},
    {"DiLoCo (--strategy diloco)",
     {"--inner-strategy", "--island-size", "--outer-steps", "--outer-optimizer", "--outer-lr",
      "--outer-momentum", "--outer-compression", "--streaming-fragments", "--overlap-steps",
      "--merge-alpha"}},
    {"Parameter server (--strategy downpour, sandblaster)",
     {"--ps", "--ps-timeout-ms", "--ps-retry-ms", "--ps-tls", "--ps-tls-ca", "--n-fetch",
      "--n-push", "--max-staleness", "--work-units", "--no-backup-tasks", "--work-unit-sizing",
      "--lbfgs-history", "--ps-shards", "--ps-optimizer", "--ps-lr", "--ps-auth-token-file"}},
    {"Precision and memory", {"--precision", "--loss-scaling", "--checkpointing"}},
    {"Failures",
     {"--max-restarts", "--fault-tolerance", "--max-replacements", "--replica-shards",
      "--shard-across-replicas", "--replica-heartbeat-timeout"}},
    {"Checkpoints",
     {"--checkpoint-dir", "--checkpoint-every", "--keep-checkpoints", "--async-checkpoint",
      "--no-resume"}},
    {"Output",
     {"--run-dir", "--no-run-dir", "--metrics", "--log-every", "--peak-tflops", "--eval-every",
      "--eval-batch-size", "--tensorboard", "--defer-eval", "--no-progress", "--trace",
      "--print-plan", "--dry-run"}},
};

int run_train(dtrain::train::JobConfig job, const dtrain::train::RunPlan& plan,
              std::vector<std::string> args, const std::string& recipe) {
  const bool worker = std::getenv("RANK") != nullptr || std::getenv("SLURM_STEP_ID") != nullptr ||
                      std::getenv("OMPI_COMM_WORLD_RANK") != nullptr;
  // One process here (the launcher sets it for its ranks): started again with the OpenBLAS kernel
  // the CPU's instructions guarantee where OpenBLAS chose its generic one (issue 77).
  if (!worker && job.nproc <= 1) {
    const std::string core = dtrain::openblas_core_to_set();
    if (!core.empty()) {
      std::fprintf(stderr,
                   "dtrain: OpenBLAS chose its generic %s kernel on this CPU (%s); running with "
                   "OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to choose)\n",
                   dtrain::blas_info().core.c_str(), dtrain::cpu_info().vector_summary().c_str(),
                   core.c_str());
      std::fflush(stderr);
      ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
      const std::string self = dtrain::launch::self_executable();
      std::vector<char*> argv{const_cast<char*>(self.c_str())};
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(self.c_str(), argv.data());
      std::fprintf(stderr, "dtrain: warning: could not start %s again (%s); going on\n",
                   self.c_str(), std::strerror(errno));
    }
  }
  // The run checked once, before any rank starts; ranks (already checked by their launcher, or
  // started by Slurm / mpirun) get the same named errors from run_job itself.
  if (!worker) dtrain::train::validate_job(plan);
  check_tensorboard_folder(job.trainer.tensorboard_dir, /*say=*/!worker);
  if (!worker) {
    open_run_folder(job, plan, args);
  } else {
    adopt_run_folder(job, plan);
  }
  if (!worker && !recipe.empty()) std::printf("%s\n", recipe.c_str());
#ifdef DTRAIN_SERVICES
  if (!job.ps_auth_token_file.empty()) {
    job.trainer.strategy_options.of<dtrain::parallel::ps::PsOptions>().auth_token =
        dtrain::comm::rpc::read_token_file(job.ps_auth_token_file);
  }
  // Shards started here live until the run ends.
  const services::ps::LocalShards shards =
      worker ? services::ps::LocalShards{} : services::ps::start_local_shards(job);
  if (!shards.servers.empty()) args = with_local_shards(args, shards.addresses);
#endif
  if (job.nproc > 1 && !worker) {
    // The plan's policy: parameter-server workers are independent (one that fails leaves the
    // others running); a fault-tolerant replica that fails is started again and joins the
    // others, its ranks failing and starting again as one.
    dtrain::launch::LaunchOptions launch;
    launch.nproc_per_node = plan.launch.ranks;
    launch.threads = job.threads;
    launch.max_restarts = plan.launch.max_restarts;
    launch.interface = job.interface;
    launch.tolerate_failures = plan.launch.tolerate_failures;
    launch.max_replacements = plan.launch.max_replacements;
    launch.replica_size = plan.launch.replica_size;
    launch.replace_first_replica = plan.launch.replace_first_replica;
    launch.command.push_back(dtrain::launch::self_executable());
    launch.command.insert(launch.command.end(), args.begin(), args.end());
    launch.name = "dtrain train";
    launch.stop_signal = SIGUSR2;  // a request the ranks never take for a second one
    launch.failure_hint =
        job.trainer.checkpoint_dir.empty()
            ? "to go on after a failure: --fault-tolerance replicas (the other replicas go on at "
              "once), or --checkpoint-dir with --max-restarts N (a restart resumes from the "
              "newest checkpoint)"
            : "to go on after a failure: --max-restarts N (a restart resumes from the newest "
              "checkpoint in --checkpoint-dir), or --fault-tolerance replicas (the other replicas "
              "go on at once)";
    const int code = dtrain::launch::launch(launch);
    if (code == 0 || dtrain::is_stopped_exit_code(code)) print_run_folder(job);
    if (dtrain::is_stopped_exit_code(code)) print_resume(job);
    return code;
  }
  // Ctrl-C, SIGTERM, SIGUSR1: the ranks finish their step and save a checkpoint; a second
  // signal stops at once.
  dtrain::train::stop_on_signals();
  const auto result = dtrain::train::run_job(job);
  if (result.fit.leader) std::printf("%s", dtrain::train::summary(job, result).c_str());
  if (!worker) print_run_folder(job);
  if (result.fit.stopped_by == 0) return 0;
  if (!worker) print_resume(job);
  return dtrain::stopped_exit_code(result.fit.stopped_by);
}

class TrainCommand final : public Command {
 public:
  explicit TrainCommand(CLI::App& app)
      : app_(app.add_subcommand("train", "Train a model, on --nproc local ranks")) {
    add_train_options(*app_, job_, strategy_flags_);
    app_->add_flag("--print-plan", print_plan_,
                   "Print the run's plan (every option's value, as TOML that --config reads "
                   "back, and the layout, batches, data and launch worked out from them) and "
                   "exit; every run folder keeps it as plan.toml and every checkpoint in its "
                   "metadata");
    app_->add_flag("--dry-run", dry_run_,
                   "Work the run out and print each rank's memory (setup, step, what --offload "
                   "moves out) against this machine's, without building the model; exit 2 when "
                   "it does not fit");
    group_options(*app_, kTrainGroups);
  }
  std::vector<std::string> expand(const std::vector<std::string>& args) override {
    return expand_config(args, *app_, {"train"});
  }
  bool parsed() const override { return app_->parsed(); }
  int run(const std::vector<std::string>& args) override {
    // The model's training recipe fills what neither the command line nor --config set.
    std::vector<std::string> given;
    for (const CLI::Option* option : app_->get_options()) {
      if (option->count() == 0) continue;
      for (const std::string& name : option->get_lnames()) given.push_back(name);
    }
    const std::string recipe = dtrain::train::apply_model_recipe(job_, given);
    // Every checkpoint says how it was made: the command line, the options given and what the
    // model's recipe set (dtrain ckpt inspect shows them).
    auto& extras = job_.trainer.checkpoint_extras;
    extras["command"] = command_line();
    extras["config"] = options_as_toml(*app_, {}, {"print-plan", "dry-run"}, true);
    if (!recipe.empty()) extras["recipe"] = recipe;
    // The plan: every option's value (the defaults and the recipe's included) as TOML that
    // --config reads back, and what the run makes of them.
    const dtrain::train::RunPlan plan = dtrain::train::plan_run(job_, job_.nproc);
    // (run_job adds the plan its world makes to what its checkpoints keep.)
    extras["plan"] = effective_options();
    if (print_plan_) {
      dtrain::train::validate_job(plan);
      std::printf("%s%s", extras["plan"].c_str(), plan.describe().c_str());
      return 0;
    }
    if (dry_run_) {
      dtrain::train::validate_job(plan);
      return dtrain::cli::dry_run(plan);
    }
    return run_train(job_, plan, args, recipe);
  }

 private:
  /// Every option with its value, as `--config` reads it back (not --print-plan or --config).
  std::string effective_options() const {
    return "# dtrain train's options, each with its value (commented: what the model's recipe "
           "sets): dtrain train --config FILE runs it again\n" +
           options_as_toml(*app_, dtrain::train::recipe_values(job_), {"print-plan", "dry-run"});
  }

  CLI::App* app_;
  dtrain::train::JobConfig job_;
  bool print_plan_ = false;
  bool dry_run_ = false;
  dtrain::FlagSet strategy_flags_;  // bound into job_.trainer.strategy_options
};

}  // namespace

std::unique_ptr<Command> train_command(CLI::App& app) {
  return std::make_unique<TrainCommand>(app);
}

}  // namespace dtrain::cli
