// A training job as the CLI describes it (model, data set, trainer options, ranks), and running
// it in one rank process. Kept out of cli/ so it is testable and the CLI only parses arguments.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/data/Datasets.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/train/Trainer.h"

namespace dtrain::train {

/// `dtrain train`'s defaults are those of the main job (configs/fashion-mnist-ddp.toml), so a
/// first command with no flags trains a good model.
struct JobConfig {
  JobConfig();
  /// The run's folder (`dtrain train --run-dir`; the command line's, which writes it), and
  /// whether none is made by default (--no-run-dir).
  std::string run_dir;
  bool no_run_dir = false;
  /// The model: its name (a model of the registry, models/Zoo.h), its hyper-parameters as its
  /// flags set them (the MLP's --hidden, the decoder's --layers ...; each default written once,
  /// in models::ModelSpec) and --checkpointing; plan_run adds what the data decides (the
  /// examples' shape, the classes, the vocabulary).
  models::ModelSpec model;
  /// A data set of the registry (data/Datasets.h): "fashion-mnist", "synthetic", "text", ...
  std::string dataset = "fashion-mnist";
  /// What the data set reads, as the data flags set it (--data-dir, --text-file,
  /// --validation-fraction, --synthetic-examples, --vocab-size, --tokenizer, --image-size,
  /// --max-bad-samples, --augment), each default written once, in data::DataSource; plan_run
  /// adds what the run decides (the set's argument, epochs, the decoder's context, the seed,
  /// --max-steps' examples).
  data::DataSource data;
  TrainerOptions trainer;
  /// > 0: micro-batches per step (the pipeline's M); sets trainer.accumulation_steps.
  int64_t micro_batches = 0;
  /// Packed sequences (--reset-attention-mask): a language model's attention kept inside each
  /// document of a window, positions restarting after each end-of-document token: --eod-token,
  /// else the data's tokenizer's end-of-text token (models::GptConfig::document_end).
  bool reset_attention_mask = false;
  int64_t eod_token = -1;
  /// Gradient bucket size (sets trainer.strategy_options.bucket_cap_bytes in run_job).
  double bucket_cap_mb = 25;
  /// Local ranks to launch (1 = run in this process).
  int nproc = 1;
  /// Threads per rank (0 = cores / local ranks).
  int threads = 0;
  std::string backend = "gloo";
  /// Network interface for the data plane ("" = $GLOO_SOCKET_IFNAME, else the route to
  /// MASTER_ADDR).
  std::string interface;
  /// --nproc > 1: restart the local ranks this many times after a failure (dtrain launch's
  /// --max-restarts); the run resumes from its newest checkpoint.
  int max_restarts = 0;
  int64_t comm_timeout_ms = 120000;
  /// --strategy downpour without --ps: parameter-server shards to start in the launching
  /// process, with this optimizer at ps_lr (the job's --lr-decay and --warmup-steps become the
  /// shards' schedule by version).
  int ps_shards = 0;
  std::string ps_optimizer = "adagrad";
  double ps_lr = 0.01;
  /// The shards' token file ("" = none): workers send it, --ps-shards shards require it.
  std::string ps_auth_token_file;
};

/// --strategy downpour or sandblaster: the job trains against parameter-server shards.
bool uses_parameter_server(const JobConfig& job);

struct RunPlan;

/// Checks everything that can be checked before any rank starts: names, ranges, the data set's
/// files, the checkpoint directory. InputError naming the flag or file. (The first: of the
/// job's plan on its --nproc ranks.)
void validate_job(const JobConfig& job);
void validate_job(const RunPlan& plan);
/// The model the run builds: the job's, with the data set's examples' shape and classes, or a
/// language data set's vocabulary (which reads the data set).
models::ModelSpec run_model_spec(const RunPlan& plan);

/// Sets every field of the job's model's training recipe (models::training_recipe: optimizer,
/// learning rate, momentum, weight decay, schedule, warmup, batch size, clipping) whose flag
/// is not in `given` (long flag names without dashes, e.g. "lr": what the command line or a
/// config file set). Returns a line saying what it set ("" when nothing).
std::string apply_model_recipe(JobConfig& job, const std::vector<std::string>& given);

/// The flags a model's training recipe sets (optimizer, lr, momentum, weight-decay, lr-decay,
/// warmup-steps, batch-size, max-grad-norm) with their values in `job`, as flag values.
std::vector<std::pair<std::string, std::string>> recipe_values(const JobConfig& job);

/// The optimizer steps the job will make (its epochs over the training set at its global batch,
/// or --max-steps when fewer), as the Trainer counts them; loads the training set to count it.
int64_t planned_steps(const JobConfig& job);

struct JobResult {
  FitResult fit;
  int rank = 0;
  int world_size = 1;
  /// The model's parameters (all of them, not this rank's share).
  int64_t parameters = 0;
};

/// Runs the job in this process as the rank the environment describes (see Environment.h).
JobResult run_job(const JobConfig& job);

/// What `dtrain train` prints when the job is done (rank 0): steps, global batch, ranks and
/// layout, time and throughput; the validation figures (a language set's in nats and bits per
/// character). Each line ends in a newline.
std::string summary(const JobConfig& job, const JobResult& result);

}  // namespace dtrain::train
