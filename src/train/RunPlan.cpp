// The run worked out once (RunPlan.h).
#include "dtrain/train/RunPlan.h"

#include <algorithm>

#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::train {

namespace {

/// The Trainer's options of the job: --micro-batches as the accumulation steps, the bucket cap,
/// --stage-replicas' pipeline.
TrainerOptions trainer_options(const JobConfig& job) {
  TrainerOptions options = job.trainer;
  DTRAIN_CHECK_INPUT(job.micro_batches >= 0, "--micro-batches must be >= 1, got ",
                     job.micro_batches);
  if (job.micro_batches > 0) {
    DTRAIN_CHECK_INPUT(options.accumulation_steps == 1 && options.global_batch == 0,
                       "give --micro-batches, --accumulation or --global-batch, not two of them "
                       "(each sets the micro-batches per step)");
    options.accumulation_steps = job.micro_batches;
  }
  fold_stage_replicas(options);
  options.strategy_options.bucket_cap_bytes = static_cast<int64_t>(job.bucket_cap_mb * 1024 * 1024);
  return options;
}

/// What the job's data set reads: its flags, the decoder's context, the seed, and with
/// --max-steps the examples those steps take.
data::DataSource data_source(const JobConfig& job, const BatchPlan& batches) {
  data::DataSource source = job.data;
  source.argument = data::dataset_argument(job.dataset);
  source.epochs = job.trainer.epochs;
  if (job.trainer.max_steps > 0)
    source.train_samples = job.trainer.max_steps * batches.global_batch;
  source.context = job.model.gpt.context;
  source.seed = job.trainer.seed;
  return source;
}

LaunchPolicy launch_policy(const JobConfig& job, const TrainerOptions& trainer,
                           const parallel::Layout& layout) {
  LaunchPolicy launch;
  launch.ranks = job.nproc;
  launch.max_restarts = job.max_restarts;
  const auto& fault_tolerance = trainer.strategy_options.of<parallel::ft::FaultToleranceOptions>();
  launch.tolerate_failures =
      parallel::strategy_info(trainer.strategy).parameter_server || fault_tolerance.replicas();
  if (fault_tolerance.replicas()) {
    launch.max_replacements = fault_tolerance.max_replacements;
    launch.replica_size = parallel::replica_ranks(trainer.strategy_options, layout);
    launch.replace_first_replica = true;  // the next replica present leads
  }
  return launch;
}

}  // namespace

void fold_stage_replicas(TrainerOptions& options) {
  // (A --pipeline-parallel that disagrees stays, for validate to name.)
  if (!options.stage_replicas.empty() && options.pipeline_parallel == 1) {
    options.pipeline_parallel = static_cast<int>(options.stage_replicas.size());
  }
}

parallel::Layout layout_of(const TrainerOptions& options, int64_t data_parallel) {
  parallel::Layout layout;
  layout.strategy = options.strategy;
  layout.pipeline_parallel = options.pipeline_parallel;
  layout.tensor_parallel = options.tensor_parallel;
  layout.expert_parallel = options.expert_parallel;
  layout.context_parallel = options.context_parallel;
  layout.stage_replicas = options.stage_replicas;
  layout.defer_eval = options.defer_eval;
  layout.micro_batches = plan_batches(options, data_parallel).micro_batches;
  return layout;
}

RunPlan plan_run(const JobConfig& job, int ranks) {
  RunPlan plan;
  plan.job = job;
  plan.ranks = ranks;
  plan.trainer = trainer_options(job);
  const TrainerOptions& t = plan.trainer;
  // One pipeline whose stages are replicated, or dp replicas of pipeline x tensor parallelism.
  // A context-parallel group's ranks read the same examples.
  plan.data_parallel =
      !t.stage_replicas.empty()
          ? 1
          : std::max(1, ranks / (std::max(1, t.pipeline_parallel) * std::max(1, t.tensor_parallel) *
                                 std::max(1, t.context_parallel)));
  plan.batches = plan_batches(t, plan.data_parallel);
  plan.layout = layout_of(t, plan.data_parallel);
  plan.layout.ranks = ranks;
  const std::vector<std::string> names = models::model_names();
  const bool language_model =
      std::find(names.begin(), names.end(), job.model.name) != names.end() &&
      models::model_info(job.model.name).language_model;
  plan.layout.sequence_parallel = language_model && job.model.gpt.sequence_parallel;
  plan.layout.tied_parameters = language_model && job.model.gpt.tied_embeddings;
  const bool whole_blocks = !job.model.checkpointing.empty() && job.model.checkpointing != "none" &&
                            job.model.checkpointing != "selective";
  plan.layout.recomputes_forward_state =
      whole_blocks && ((language_model && job.model.gpt.dropout > 0) || job.reset_attention_mask);
  plan.layout.model = job.model.name;
  plan.data = data_source(job, plan.batches);
  plan.launch = launch_policy(job, t, plan.layout);
  return plan;
}

std::string RunPlan::describe() const {
  const parallel::Layout& l = layout;
  std::string text =
      concat("# the plan: ", ranks, " rank", ranks == 1 ? "" : "s", ", strategy ", l.strategy, ", ",
             data_parallel, " data-parallel replica", data_parallel == 1 ? "" : "s");
  if (!l.stage_replicas.empty()) {
    std::string counts;
    for (int r : l.stage_replicas) counts += (counts.empty() ? "" : ",") + std::to_string(r);
    text += concat(" x a pipeline of ", l.pipeline_parallel, " stages on ", counts, " ranks");
  } else if (l.pipeline_parallel > 1) {
    text += concat(" x ", l.pipeline_parallel, " pipeline stages");
  }
  if (l.tensor_parallel > 1) {
    text += concat(" x tensor-parallel ", l.tensor_parallel,
                   l.sequence_parallel ? " (sequence parallel)" : "");
  }
  if (l.context_parallel > 1) {
    text += concat(" x context-parallel ", l.context_parallel, " (each sequence split over ",
                   l.context_parallel, " ranks)");
  }
  if (l.expert_parallel > 1) {
    text += concat(" (experts split over ", l.expert_parallel, " of them)");
  }
  text += concat("\n# batches: ", batches.micro_batch, " examples a micro-batch x ",
                 batches.micro_batches, " micro-batches a step = ", batches.local_step_batch(),
                 " a replica, ", batches.global_batch, " a step (global batch)");
  if (trainer.max_steps > 0) text += concat(", at most ", trainer.max_steps, " steps");
  text += concat("\n# data: ", job.dataset,
                 data.train_samples > 0 ? concat(", ", data.train_samples, " training examples")
                                        : std::string());
  text += concat("\n# launch: ", launch.ranks, " local rank", launch.ranks == 1 ? "" : "s");
  if (launch.max_restarts > 0) text += concat(", up to ", launch.max_restarts, " restarts");
  if (launch.tolerate_failures) {
    text +=
        concat(", a failed rank ", launch.max_replacements > 0
                                       ? concat("started again (up to ", launch.max_replacements,
                                                " times) in replicas of ", launch.replica_size,
                                                " rank", launch.replica_size == 1 ? "" : "s")
                                       : std::string("leaves the others running"));
  }
  return text + "\n";
}

}  // namespace dtrain::train
