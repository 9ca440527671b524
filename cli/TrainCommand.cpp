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
#include "Help.h"
#include "NumericOptions.h"
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

void add_train_options(CLI::App& app, dtrain::train::JobConfig& job,
                       dtrain::FlagSet& strategy_flags) {
  auto& t = job.trainer;
  // A flag given twice (config file, then command line) keeps the last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_config_option(app);
  // From the registries, so that they cannot drift: the names, then (--help-all) each one's line.
  std::string models, described;
  for (const std::string& name : dtrain::models::model_names()) {
    models += (models.empty() ? "" : ", ") + name;
    described += "; " + name + ": " + dtrain::models::model_info(name).summary;
  }
  models += described;
  add_model_flags(
      app, job.model, job.hidden,
      models +
          ". Each trains with its own recipe unless flags say otherwise: the "
          "optimizer, lr, momentum, weight decay, lr decay, warmup, batch size and clipping shown "
          "here are the image models'; gpt's is adamw at 0.002, weight decay 0.1, batch 32, "
          "clipping 1.0. An optimizer other than the recipe's trains at its own lr and weight "
          "decay (PyTorch's: adam 0.001, adamw 0.001 and 0.01, sgd 0.001, adagrad 0.01) unless "
          "given. docs/guide/train.md describes each model",
      "256 256");
  add_decoder_flags(app, job.gpt);
  app.add_flag("--sequence-parallel", job.gpt.sequence_parallel,
               "gpt, llama with --tensor-parallel: split norm, dropout and residual activations "
               "along the sequence too (Megatron's sequence parallelism; --context a multiple "
               "of T)");
  app.add_flag("--tp-comm-overlap", job.gpt.tp_comm_overlap,
               "gpt, llama with --tensor-parallel: the column-parallel layers' backward overlaps "
               "the input gradient's allreduce (reduce-scatter) with the weight gradient "
               "(Megatron's asynchronous tensor-parallel communication)");
  std::string datasets = dtrain::data::dataset_names_where([](const auto&) { return true; });
  for (const auto& info : dtrain::data::datasets())
    datasets += "; " + info.name + ": " + info.summary;
  add_data_flags(app, job.dataset, job.data.data_dir, job.data.synthetic_examples, datasets);
  add(app, "--text-file", job.data.text_file,
      "--dataset text: a UTF-8 text file or a directory of them (default --data-dir, else "
      "Debian's fortunes in /usr/share/games/fortunes)");
  add(app, "--validation-fraction", job.data.validation_fraction,
      "--dataset text: share of the text (its end) held out for validation; tokens: share of "
      "each corpus's documents (its last ones)")
      ->capture_default_str();
  add(app, "--vocab-size", job.data.vocabulary,
      "--dataset tokens: the vocabulary (every id must be below it; default: the largest id "
      "in the files + 1)");
  add_image_flags(app, job.data.image_size, job.data.augment, job.data.max_bad_samples,
                  " (--augment's crop)");
  add(app, "--tokenizer", job.data.tokenizer,
      "--dataset tokens: the shards' tokenizer.json (default: the one beside them, as `dtrain "
      "data prepare` leaves it); a checkpoint keeps it for `dtrain generate`");
  std::string strategies;
  for (const auto& name : dtrain::parallel::strategy_names()) {
    strategies += (strategies.empty() ? "" : ", ") + name;
  }
  add(app, "--strategy", t.strategy, "Parallel strategy: " + strategies)->capture_default_str();
  add(app, "--pipeline-parallel", t.pipeline_parallel,
      "Pipeline stages: the model's stages are split over this many ranks (the rest of the "
      "world makes each stage data-parallel with --strategy ddp or zero1)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--stage-replicas",
         [&t](const std::string& text) {
           t.stage_replicas.clear();
           size_t begin = 0;
           while (begin <= text.size()) {
             const size_t end = std::min(text.find(',', begin), text.size());
             const std::string count = text.substr(begin, end - begin);
             int value = 0;
             char tail = 0;
             DTRAIN_CHECK_INPUT(
                 std::sscanf(count.c_str(), "%d%c", &value, &tail) == 1 && value >= 1,
                 "--stage-replicas '", text, "': expected replica counts R0,R1,... (each >= 1)");
             t.stage_replicas.push_back(value);
             begin = end + 1;
           }
         },
         "PipeDream's layouts: a pipeline whose stage s runs on R_s ranks (R0,R1,...; the world "
         "is their sum), each stage's replicas taking its micro-batches in turn and averaging "
         "their gradients (sets --pipeline-parallel; gpipe, 1f1b, zb-h1 or zb-h2, ddp; dtrain "
         "plan --search --stage-replicas prints them)")
      ->type_name("R0,R1,...");
  add(app, "--tensor-parallel", t.tensor_parallel,
      "Tensor-parallel ranks: each layer's matrices are split over this many ranks (Megatron-"
      "style; --model gpt). With --pipeline-parallel P the world is DP x P x T")
      ->capture_default_str();
  // Each strategy's own flags (Registry.h): --ps, --n-fetch, --schedule, --zero3-..., ...
  dtrain::parallel::declare_strategy_flags(strategy_flags, t.strategy_options);
  add_flags(app, strategy_flags);
  add(app, "--ps-shards", job.ps_shards,
      "--strategy downpour/sandblaster: start this many parameter-server shards here, in the "
      "launching "
      "process (instead of --ps)")
      ->capture_default_str();
  add(app, "--ps-optimizer", job.ps_optimizer,
      "--ps-shards: the shards' optimizer (adagrad, sgd or adam)")
      ->capture_default_str();
  add(app, "--ps-lr", job.ps_lr,
      "--ps-shards: the shards' learning rate (the job's decay and warmup become their "
      "schedule, by version)")
      ->capture_default_str();
  add(app, "--ps-auth-token-file", job.ps_auth_token_file,
      "--strategy downpour/sandblaster: file holding the shards' token (sent with every call; "
      "--ps-shards "
      "shards require it)");
  app.add_option_function<std::string>(
      "--simulate-slowdown",
      [&t](const std::string& text) {
        int rank = -1;
        double factor = 0;
        char tail = 0;
        std::string rate = text;
        const bool spin = text.size() > 5 && text.compare(text.size() - 5, 5, ":spin") == 0;
        if (spin) rate.resize(text.size() - 5);
        DTRAIN_CHECK_INPUT(std::sscanf(rate.c_str(), "%d:%lf%c", &rank, &factor, &tail) == 2 &&
                               rank >= 0 && factor >= 1 && std::isfinite(factor),
                           "--simulate-slowdown '", text,
                           "': expected RANK:FACTOR[:spin] with RANK >= 0 and FACTOR >= 1");
        t.slowdown_rank = rank;
        t.slowdown_factor = factor;
        t.slowdown_spin = spin;
      },
      "RANK:FACTOR[:spin]: rank RANK takes FACTOR times as long per step (a straggler, for "
      "testing): it sleeps the difference, or with :spin keeps its core busy (a slow "
      "machine's capacity is lost)");
  add(app, "--micro-batches", job.micro_batches,
      "Micro-batches per optimizer step (the pipeline's M; sets --accumulation)");
  add(app, "--trace", t.trace_file,
      "Write a Chrome/Perfetto trace of every rank (forward, backward, recv, sync, optimizer "
      "spans) to this file; scripts/plot-timeline draws it");
  add(app, "--nproc", job.nproc, "Local ranks to launch")->capture_default_str();
  add_threads_flag(app, job.threads, "cores / ranks");
  add(app, "--interface", job.interface,
      "Network interface for rank-to-rank traffic (default: the one that reaches MASTER_ADDR)");
  add(app, "--max-restarts", job.max_restarts,
      "With --nproc: restart the ranks this many times after a failure, resuming from the "
      "newest checkpoint")
      ->capture_default_str();
  add(app, "--backend", job.backend, "Communication backend: gloo, nccl")->capture_default_str();
  add(app, "--comm-timeout", job.comm_timeout_ms, "Timeout of every collective (ms)")
      ->capture_default_str();
  add(app, "--epochs", t.epochs, "Epochs")->capture_default_str();
  add(app, "--batch-size", t.batch_size, "Examples per rank per micro-batch")
      ->capture_default_str();
  add(app, "--accumulation", t.accumulation_steps,
      "Micro-batches per optimizer step (gradient accumulation)")
      ->capture_default_str();
  add(app, "--global-batch", t.global_batch,
      "Examples per optimizer step at any world size: sets --accumulation to this / "
      "(batch size x ranks); elastic jobs keep their step and data order across sizes "
      "(0 = batch size x accumulation x ranks)")
      ->capture_default_str();
  add(app, "--max-steps", t.max_steps, "Train this many steps (0 = all epochs)")
      ->capture_default_str();
  add(app, "--stop-at-step", t.stop_at_step,
      "Checkpoint and halt at this step, keeping the schedule (resume later)")
      ->capture_default_str();
  add(app, "--optimizer", t.optimizer.name, "sgd, adam, adamw, adagrad")->capture_default_str();
  add_sgd_flags(app, t.optimizer.lr, t.optimizer.momentum, t.optimizer.weight_decay, "");
  app.add_flag("--nesterov", t.optimizer.nesterov, "Nesterov momentum (SGD)");
  app.add_flag_callback(
      "--check-collectives",
      [] { setenv("DTRAIN_CHECK_COLLECTIVES", "1", 1); },  // every rank inherits it
      "Before each collective the ranks compare what they call (op, size, dtype, root): a "
      "mismatch is an error naming the group, the ranks and each one's call, not a hang or "
      "wrong numbers (as TORCH_DISTRIBUTED_DEBUG=DETAIL; Gloo; costs a small allgather per "
      "collective). Or set DTRAIN_CHECK_COLLECTIVES=1");
  add(app, "--freeze-variance-after", t.optimizer.freeze_variance_after,
      "adam, adamw: keep the second moment as it is after this many steps (1-bit Adam's "
      "freeze step: the rule turns linear in the gradients; 0 = never)")
      ->capture_default_str();
  add(app, "--lr-decay", t.schedule.decay, "constant, step, cosine")->capture_default_str();
  add(app, "--warmup-steps", t.schedule.warmup_steps, "Linear warmup steps")->capture_default_str();
  add(app, "--lr-step-size", t.schedule.step_size, "Steps between step decays")
      ->capture_default_str();
  add(app, "--lr-gamma", t.schedule.gamma, "Step decay factor")->capture_default_str();
  add(app, "--reference-batch", t.reference_batch,
      "Linear scaling rule: lr x global batch / this (0 = off)")
      ->capture_default_str();
  add(app, "--max-nonfinite-steps", t.max_nonfinite_steps,
      "Stop with an error after this many consecutive steps with a non-finite loss or gradient "
      "norm (0 = never)")
      ->capture_default_str();
  add(app, "--max-grad-norm", t.strategy_options.max_grad_norm,
      "Clip gradients to this global norm (0 = off)")
      ->capture_default_str();
  add(app, "--bucket-cap-mb", job.bucket_cap_mb, "Gradient bucket size in MiB")
      ->capture_default_str();
  add(app, "--grad-compression", t.strategy_options.grad_compression,
      "Gradient compression: none, fp16, bf16 (wire dtype), "
      "powersgd:RANK[:START_STEP[:MIN_RATE[:fp16|bf16]]] (low rank with error feedback, the "
      "factors optionally sent in 16 bits; ddp, zero1, pipelines)")
      ->capture_default_str();
  app.add_flag("--hierarchical-allreduce", t.strategy_options.hierarchical_allreduce,
               "Allreduce gradients inside each host first, then across hosts, then inside "
               "again (ddp, zero1, pipelines; not with powersgd)");
  add(app, "--ranks-per-host", t.strategy_options.ranks_per_host,
      "Ranks of one host for --hierarchical-allreduce (0 = the launcher's LOCAL_WORLD_SIZE)")
      ->capture_default_str();
  app.add_flag("--error-on-unused-parameters", t.strategy_options.error_on_unused_parameters,
               "Fail a step when a parameter gets no gradient (default: treat as zero)");
  add(app, "--device", t.strategy_options.device,
      "cpu, cuda (this rank's GPU: LOCAL_RANK modulo the GPUs) or cuda:N")
      ->capture_default_str();
  add(app, "--precision", t.strategy_options.precision,
      "fp32, bf16-mixed, fp16-mixed, bf16 or bf16-master. bf16-mixed: autocast over fp32 "
      "weights; fp16-mixed: the same in fp16 (CUDA only); bf16: everything, the optimizer state "
      "too; bf16-master (ddp, zero1, zero2: a bf16 model, gradients "
      "accumulated and reduced in fp32, fp32 master weights in the (sharded) optimizer, "
      "checkpoints of the master weights: Megatron's layout)")
      ->capture_default_str();
  add(app, "--loss-scaling", t.strategy_options.loss_scaling,
      "auto (dynamic for fp16-mixed), dynamic, none")
      ->capture_default_str();
  add(app, "--checkpointing", job.checkpointing,
      "Activation checkpointing: none, sqrt, a segment count, or selective (gpt, llama: "
      "recompute only attention's core, keeping the rest)")
      ->capture_default_str();
  add_seed_flag(app, t.seed, "model, data order");
  add_run_flags(app, t.checkpoint_dir, t.eval_every, t.progress, "Directory for checkpoints",
                "steps (0 = epoch ends only)");
  add(app, "--checkpoint-every", t.checkpoint_every,
      "Also checkpoint every N steps (0 = epoch ends only)")
      ->capture_default_str();
  add(app, "--keep-checkpoints", t.keep_checkpoints, "Checkpoints to keep")->capture_default_str();
  app.add_flag("--async-checkpoint", t.async_checkpoint,
               "Write checkpoints in the background: a save copies the state to host memory "
               "and training goes on while a thread writes, verifies and publishes it");
  app.add_flag("!--no-resume", t.resume, "Start fresh even if --checkpoint-dir has one");
  add(app, "--init-from", t.init_from,
      "Start from these weights: a checkpoint (directory or root) of any strategy and world "
      "size, a consolidated file (dtrain ckpt consolidate, dtrain fl --save-model), or "
      "safetensors (a file, or a folder as Hugging Face saves one: a Llama's config.json must "
      "agree with the model's flags; any tensor-parallel layout)");
  app.add_flag("--allow-non-finite-weights", t.allow_non_finite_weights,
               "Load --init-from's weights even where they hold NaN or Inf (refused otherwise)");
  add(app, "--metrics", t.metrics_file, "JSONL metrics file");
  add(app, "--run-dir", job.run_dir,
      "The run's folder: metrics.jsonl, config.toml (the options given), command.txt and "
      "checkpoints/ (unless --metrics or --checkpoint-dir say otherwise). Without it, and "
      "without --metrics or --checkpoint-dir, runs/MODEL-DATE-TIME gets the metrics, config and "
      "command");
  app.add_flag("--no-run-dir", job.no_run_dir, "No run folder by default");
  app.add_flag("--defer-eval", t.defer_eval,
               "Evaluate after training, on copies of the parameters taken at each evaluation "
               "point (recorded with their moment's clock: time to accuracy without the "
               "evaluations)");
  app.add_flag("--sync-batchnorm", t.sync_batchnorm,
               "BatchNorm statistics over the data-parallel ranks (as torch.nn.SyncBatchNorm: "
               "N ranks train as one process on the global batch; the ResNets)");
  add(app, "--log-every", t.log_every,
      "Steps between metrics records (and progress lines off a terminal)")
      ->capture_default_str();
  add(app, "--peak-tflops", t.peak_tflops,
      "One device's peak TFLOP/s at the run's precision (e.g. 989 for an H100 SXM in bf16): "
      "language models then report their model FLOPs utilization (MFU) beside their FLOP/s");
}

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
    const std::string base = "runs/" + job.model + "-" + stamp;
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
     {"--model", "--hidden", "--layers", "--heads", "--kv-heads", "--width", "--ffn-width",
      "--context", "--rope-theta", "--norm-eps", "--dropout", "--tied-embeddings", "--init-from",
      "--allow-non-finite-weights", "--seed"}},
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
      "--defer-eval", "--no-progress", "--trace", "--print-plan"}},
};

int run_train(dtrain::train::JobConfig job, const dtrain::train::RunPlan& plan,
              std::vector<std::string> args, const std::string& recipe) {
  const bool worker = std::getenv("RANK") != nullptr || std::getenv("SLURM_PROCID") != nullptr ||
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
  if (!worker) open_run_folder(job, plan, args);
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
    extras["config"] = options_as_toml(*app_, {}, {"print-plan"}, true);
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
    return run_train(job_, plan, args, recipe);
  }

 private:
  /// Every option with its value, as `--config` reads it back (not --print-plan or --config).
  std::string effective_options() const {
    return "# dtrain train's options, each with its value (commented: what the model's recipe "
           "sets): dtrain train --config FILE runs it again\n" +
           options_as_toml(*app_, dtrain::train::recipe_values(job_), {"print-plan"});
  }

  CLI::App* app_;
  dtrain::train::JobConfig job_;
  bool print_plan_ = false;
  dtrain::FlagSet strategy_flags_;  // bound into job_.trainer.strategy_options
};

}  // namespace

std::unique_ptr<Command> train_command(CLI::App& app) {
  return std::make_unique<TrainCommand>(app);
}

}  // namespace dtrain::cli
