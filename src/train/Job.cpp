// Builds data, model and Trainer for a JobConfig and runs it.
#include "dtrain/train/Job.h"

#include <torch/torch.h>

#include <cmath>
#include <csignal>

#include "dtrain/common/Error.h"
#include "dtrain/common/Printed.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ps/PsOptions.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/RunPlan.h"
#include "dtrain/train/Stop.h"
#include "dtrain/train/Weights.h"

namespace dtrain::train {

namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string joined(const std::vector<std::string>& names, const char* separator = ", ") {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : separator) + n;
  return out;
}

// The model for the job's data set: a classifier of its examples into its classes, or a
// language model over `vocabulary` tokens (known once the data is read).
models::ModelSpec model_spec(const RunPlan& plan, int64_t vocabulary = 2) {
  const JobConfig& job = plan.job;
  const data::DatasetInfo dataset = data::dataset_info_for(job.dataset, plan.data);
  models::ModelSpec spec = job.model;
  spec.gpt.vocab = vocabulary;
  if (!dataset.language) {
    spec.input_shape = dataset.input_shape;
    spec.classes = dataset.classes;
  }
  return spec;
}

}  // namespace

models::ModelSpec run_model_spec(const RunPlan& plan) {
  int64_t vocabulary = 2;
  if (data::dataset_info(plan.job.dataset).language) {
    vocabulary = data::load_dataset(plan.job.dataset, plan.data).vocabulary;
  }
  return model_spec(plan, vocabulary);
}

namespace {

// The strategy's rules against the job's layout (ranks, pipeline, tensor parallelism, the
// model), named before any rank starts; the strategy's constructor checks the rest.
void validate_strategy(const RunPlan& plan) {
  parallel::Layout layout = plan.layout;
  if (plan.trainer.pipeline_parallel > 1) {
    models::ModelSpec spec = model_spec(plan);
    spec.deferred = true;  // its stages are what counts, not its values
    layout.model_stages = static_cast<int>(models::make_model(spec).stages.size());
  }
  auto options = plan.trainer.strategy_options;
  parallel::make_strategy(parallel::resolve_strategy(layout, options), options);
}

}  // namespace

JobConfig::JobConfig() {
  trainer.epochs = 5;
  // The default model's recipe (the main job: configs/fashion-mnist-ddp.toml).
  const models::TrainingRecipe recipe = models::training_recipe(model.name);
  trainer.optimizer = recipe.optimizer;
  trainer.schedule = recipe.schedule;
  trainer.batch_size = recipe.batch_size;
  trainer.strategy_options.max_grad_norm = recipe.max_grad_norm;
}

std::string apply_model_recipe(JobConfig& job, const std::vector<std::string>& given) {
  if (!contains(models::model_names(), job.model.name)) return "";  // validate_job names it
  const models::TrainingRecipe recipe = models::training_recipe(job.model.name);
  auto& t = job.trainer;
  std::string set, own;
  auto take = [&](const char* flag, auto& field, const auto& value, std::string& said) {
    if (contains(given, flag)) return;
    if (field != value) said += concat(said.empty() ? "" : ", ", "--", flag, " ", value);
    field = value;
  };
  take("optimizer", t.optimizer.name, recipe.optimizer.name, set);
  // Another optimizer than the recipe's trains at its own defaults (PyTorch's), not at a rate
  // and decay chosen for the recipe's (Adam at SGD's 0.05 diverges).
  const bool another = t.optimizer.name != recipe.optimizer.name;
  const optim::OptimizerSpec rates =
      another ? optim::optimizer_defaults(t.optimizer.name) : recipe.optimizer;
  std::string& rates_said = another ? own : set;
  take("lr", t.optimizer.lr, rates.lr, rates_said);
  take("momentum", t.optimizer.momentum, rates.momentum, rates_said);
  take("weight-decay", t.optimizer.weight_decay, rates.weight_decay, rates_said);
  take("lr-decay", t.schedule.decay, recipe.schedule.decay, set);
  take("warmup-steps", t.schedule.warmup_steps, recipe.schedule.warmup_steps, set);
  take("batch-size", t.batch_size, recipe.batch_size, set);
  take("max-grad-norm", t.strategy_options.max_grad_norm, recipe.max_grad_norm, set);
  std::string said;
  if (!set.empty()) {
    said = concat("model ", job.model.name, ": its training recipe sets ", set,
                  " (a flag or config key overrides each)");
  }
  if (!own.empty()) {
    said += concat(said.empty() ? "" : "\n", "--optimizer ", t.optimizer.name, " (model ",
                   job.model.name, "'s recipe trains with ", recipe.optimizer.name,
                   "): ", t.optimizer.name, "'s own defaults, as PyTorch's, set ", own);
  }
  return said;
}

std::vector<std::pair<std::string, std::string>> recipe_values(const JobConfig& job) {
  const auto& t = job.trainer;
  return {{"optimizer", t.optimizer.name},
          {"lr", concat(t.optimizer.lr)},
          {"momentum", concat(t.optimizer.momentum)},
          {"weight-decay", concat(t.optimizer.weight_decay)},
          {"lr-decay", concat(t.schedule.decay)},
          {"warmup-steps", concat(t.schedule.warmup_steps)},
          {"batch-size", concat(t.batch_size)},
          {"max-grad-norm", concat(t.strategy_options.max_grad_norm)}};
}

bool uses_parameter_server(const JobConfig& job) {
  return parallel::strategy_info(job.trainer.strategy).parameter_server;
}

void validate_job(const JobConfig& job) { validate_job(plan_run(job, job.nproc)); }

void validate_job(const RunPlan& plan) {
  const JobConfig& job = plan.job;
  DTRAIN_CHECK_INPUT(contains(models::model_names(), job.model.name), "--model: unknown model '",
                     job.model.name, "' (expected ", joined(models::model_names()), ")");
  const parallel::StrategyInfo& strategy = parallel::strategy_info(job.trainer.strategy);
  const auto& addresses = job.trainer.strategy_options.of<parallel::ps::PsOptions>().addresses;
  if (strategy.parameter_server) {
    DTRAIN_CHECK_INPUT(!addresses.empty() || job.ps_shards > 0, "--strategy ", strategy.name,
                       " needs the parameter-server shards: --ps "
                       "HOST:PORT,... (servers started with dtrain ps serve) or --ps-shards N "
                       "(started by this command)");
    DTRAIN_CHECK_INPUT(addresses.empty() || job.ps_shards == 0,
                       "--ps and --ps-shards both given: use --ps for servers that are already "
                       "running, --ps-shards to start them here");
    DTRAIN_CHECK_INPUT(optim::has_flat_rule(job.ps_optimizer),
                       "--ps-optimizer: unknown parameter-server optimizer '", job.ps_optimizer,
                       "' (", optim::flat_rule_names(), ")");
    DTRAIN_CHECK_INPUT(job.ps_lr > 0 && std::isfinite(job.ps_lr), "--ps-lr must be > 0, got ",
                       job.ps_lr);
  } else {
    std::vector<std::string> ps_strategies;
    for (const auto& info : parallel::strategies()) {
      if (info.parameter_server) ps_strategies.push_back(info.name);
    }
    DTRAIN_CHECK_INPUT(job.ps_shards == 0 && addresses.empty(),
                       "--ps and --ps-shards are for "
                       "--strategy ",
                       joined(ps_strategies, " or "), " (not ", strategy.name, ")");
  }
  DTRAIN_CHECK_INPUT(job.trainer.slowdown_rank < std::max(1, job.nproc),
                     "--simulate-slowdown: rank ", job.trainer.slowdown_rank, " is not one of the ",
                     std::max(1, job.nproc), " ranks");
  const data::DatasetInfo& dataset = data::dataset_info(job.dataset);
  const models::ModelInfo& model = models::model_info(job.model.name);
  if (model.language_model) {
    DTRAIN_CHECK_INPUT(dataset.language, "--model ", job.model.name,
                       " is a language model: use it with --dataset ",
                       data::dataset_names_where([](const auto& d) { return d.language; }));
  } else {
    DTRAIN_CHECK_INPUT(!dataset.language, "--dataset ", job.dataset,
                       " needs --model gpt or another language model (not ", job.model.name, ")");
  }
  DTRAIN_CHECK_INPUT(job.nproc >= 1, "--nproc must be >= 1, got ", job.nproc);
  if (job.trainer.sync_batchnorm) {
    // (The Trainer checks the built model's layers; a registry entry says whether it has any.)
    std::vector<std::string> with;
    for (const auto& name : models::model_names()) {
      if (!models::model_info(name).parameters_only) with.push_back(name);
    }
    DTRAIN_CHECK_INPUT(!model.parameters_only, "--sync-batchnorm: model ", job.model.name,
                       " has no BatchNorm layers (", joined(with), " have)");
    DTRAIN_CHECK_INPUT(strategy.loop == parallel::Loop::kSteps, "--sync-batchnorm: strategy ",
                       strategy.name, " has no data-parallel group that steps together");
  }
  const int tp = job.trainer.tensor_parallel;
  DTRAIN_CHECK_INPUT(tp >= 1, "--tensor-parallel must be >= 1, got ", tp);
  DTRAIN_CHECK_INPUT(tp == 1 || model.tensor_parallel, "--tensor-parallel ", tp,
                     " needs --model gpt or another model with tensor-parallel layers, not ",
                     job.model.name);
  const int cp = job.trainer.context_parallel;
  DTRAIN_CHECK_INPUT(cp >= 1, "--context-parallel must be >= 1, got ", cp);
  if (cp > 1) {
    DTRAIN_CHECK_INPUT(model.language_model, "--context-parallel ", cp,
                       " splits each sequence: ", job.model.name,
                       " has no sequence to split (use a model with attention: --model gpt or "
                       "llama)");
    const int stages = std::max(1, job.trainer.pipeline_parallel) * std::max(1, tp);
    DTRAIN_CHECK_INPUT(job.trainer.stage_replicas.empty(),
                       "--context-parallel with --stage-replicas: not built");
    DTRAIN_CHECK_INPUT(job.nproc % (stages * cp) == 0, "--context-parallel ", cp,
                       " must divide the data-parallel size ", job.nproc / stages, " (--nproc ",
                       job.nproc, " / --tensor-parallel ", tp, " / --pipeline-parallel ",
                       job.trainer.pipeline_parallel, ")");
  }
  if (model.check_layout) {
    models::ModelLayout layout;
    layout.tensor_parallel = tp;
    layout.pipeline_parallel = plan.trainer.pipeline_parallel;
    layout.sequence_parallel = job.model.gpt.sequence_parallel;
    layout.context_parallel = job.trainer.context_parallel;
    model.check_layout(model_spec(plan), layout);
  } else {
    DTRAIN_CHECK_INPUT(!job.model.gpt.sequence_parallel,
                       "--sequence-parallel is for models with "
                       "tensor-parallel layers and a sequence (--model gpt), not ",
                       job.model.name);
  }
  DTRAIN_CHECK_INPUT(!job.model.gpt.tp_comm_overlap || (tp > 1 && model.tensor_parallel),
                     "--tp-comm-overlap overlaps tensor parallelism's communication: it needs "
                     "--tensor-parallel > 1 and a model with tensor-parallel layers (gpt, llama)");
  if (tp > 1 && job.trainer.stage_replicas.empty()) {
    DTRAIN_CHECK_INPUT(job.nproc % (tp * std::max(1, job.trainer.pipeline_parallel)) == 0,
                       "--nproc ", job.nproc, " is not a multiple of --tensor-parallel ", tp,
                       " x --pipeline-parallel ", job.trainer.pipeline_parallel,
                       " (ranks = data-parallel x pipeline x tensor-parallel)");
  }
  DTRAIN_CHECK_INPUT(job.trainer.moe_bias_rate == 0 || job.model.gpt.moe_experts > 0,
                     "--moe-bias-rate balances a mixture of experts: it needs --moe-experts");
  const int ep = job.trainer.expert_parallel;
  DTRAIN_CHECK_INPUT(ep >= 1, "--expert-parallel must be >= 1, got ", ep);
  if (ep > 1) {
    DTRAIN_CHECK_INPUT(model.language_model && job.model.gpt.moe_experts > 0, "--expert-parallel ",
                       ep, " splits a mixture of experts: it needs --model llama --moe-experts E");
    DTRAIN_CHECK_INPUT(job.model.gpt.moe_experts % ep == 0, "--moe-experts (",
                       job.model.gpt.moe_experts, ") must be a multiple of --expert-parallel (", ep,
                       ")");
    DTRAIN_CHECK_INPUT(plan.data_parallel % ep == 0, "--expert-parallel ", ep,
                       " must divide the data-parallel size ", plan.data_parallel, " (--nproc ",
                       job.nproc, ")");
  }
  if (job.reset_attention_mask || job.eod_token >= 0) {
    DTRAIN_CHECK_INPUT(model.language_model,
                       "--reset-attention-mask packs documents into a "
                       "language model's sequences, not ",
                       job.model.name, "'s examples");
    DTRAIN_CHECK_INPUT(job.reset_attention_mask,
                       "--eod-token is --reset-attention-mask's "
                       "end-of-document token: give both");
  }
  DTRAIN_CHECK_INPUT(job.threads >= 0, "--threads must be >= 1, got ", job.threads);
  DTRAIN_CHECK_INPUT(job.comm_timeout_ms > 0, "--comm-timeout must be > 0");
  for (auto width : job.model.hidden)
    DTRAIN_CHECK_INPUT(width >= 1, "--hidden widths must be >= 1");
  DTRAIN_CHECK_INPUT(job.bucket_cap_mb > 0 && job.bucket_cap_mb <= 1 << 20,
                     "--bucket-cap-mb must be in (0, 1048576], got ", job.bucket_cap_mb);
  validate(plan.trainer);
  // Selective recomputation is the transformers' (their attention's core); the others' models
  // refuse it with the usual message.
  if (job.model.checkpointing != "selective" ||
      !models::model_info(job.model.name).language_model) {
    memory::parse_segments(job.model.checkpointing, 1);
  }
  validate_strategy(plan);
  // Build throwaway objects to validate their options with their own messages.
  optim::LrSchedule(job.trainer.optimizer.lr, 1, job.trainer.schedule);
  optim::make_optimizer({torch::zeros({1}, torch::requires_grad())}, job.trainer.optimizer);
  if (dataset.check) dataset.check(plan.data);
  if (!job.trainer.checkpoint_dir.empty()) ensure_writable(job.trainer.checkpoint_dir);
}

int64_t planned_steps(const JobConfig& job) {
  const RunPlan plan = plan_run(job, job.nproc);
  const TrainerOptions& options = plan.trainer;
  data::DataSource source = plan.data;
  source.test = false;  // only the training examples are counted
  const data::TensorDataset train = data::load_dataset(job.dataset, source).train;
  const int64_t examples = train.size();
  const int64_t per_epoch =
      std::max<int64_t>(1, examples / plan.data_parallel / plan.batches.local_step_batch());
  // A presampled set (tokens) already holds every epoch.
  int64_t steps = per_epoch * (train.presampled() ? 1 : options.epochs);
  if (options.max_steps > 0) steps = std::min(steps, options.max_steps);
  return steps;
}

JobResult run_job(const JobConfig& job) {
  const launch::RankInfo info = launch::discover_rank();
  launch::set_threads(job.threads > 0 ? job.threads
                                      : launch::default_threads(info.local_world_size));
  launch::tune_allocator();
  comm::InitOptions init = launch::init_options(info);
  init.backend = job.backend;
  init.timeout = std::chrono::milliseconds(job.comm_timeout_ms);
  init.interface = job.interface;
  auto world = comm::init(init);

  const RunPlan plan = plan_run(job, world->size());
  TrainerOptions options = plan.trainer;
  // The checkpoints keep the options (the CLI's, when it gave them) and the plan of this world
  // (a rank started by Slurm or an operator knows it; the command line's --nproc may not).
  auto kept = options.checkpoint_extras.find("plan");
  if (kept != options.checkpoint_extras.end()) kept->second += plan.describe();
  const data::LoadedData data = data::load_dataset(job.dataset, plan.data);
  int64_t vocabulary = 2;
  if (data::dataset_info(job.dataset).language) {
    vocabulary = data.vocabulary;
    options.token_loss = true;
    options.flops_per_token =
        models::gpt_training_flops_per_token(models::decoder_config(model_spec(plan, vocabulary)));
    options.checkpoint_extras["model"] =
        models::to_json(models::decoder_config(model_spec(plan, vocabulary)));
    if (!data.tokenizer_json.empty()) {
      options.checkpoint_extras["tokenizer"] = data.tokenizer_json;
    } else {
      options.checkpoint_extras["vocabulary"] = data.vocabulary_utf8;
    }
  }
  if (world->rank() == 0 && !data.description.empty()) {
    std::string line = data.description;
    if (models::model_info(job.model.name).language_model) {
      line +=
          concat("; ", job.model.name, " of ",
                 models::gpt_parameter_count(models::decoder_config(model_spec(plan, vocabulary))),
                 " parameters");
    }
    std::printf("%s\n", line.c_str());
  }
  // safetensors weights load here, where the model's spec is known (Hugging Face's names, any
  // tensor-parallel layout); checkpoints and consolidated files in the Trainer.
  const std::string safetensors_init =
      !options.init_from.empty() && is_safetensors(options.init_from) ? options.init_from : "";
  if (!safetensors_init.empty()) options.init_from.clear();
  Trainer trainer(options, world);
  models::ModelSpec spec = model_spec(plan, vocabulary);
  if (job.reset_attention_mask) {
    int64_t end = job.eod_token;
    if (end < 0 && !data.tokenizer_json.empty()) {
      end = data::tokenizer::BpeTokenizer::from_json(data.tokenizer_json, job.dataset + " data")
                .end_of_text();
    }
    DTRAIN_CHECK_INPUT(end >= 0,
                       "--reset-attention-mask needs the end-of-document token: the data's "
                       "tokenizer names none; give --eod-token ID");
    spec.gpt.document_end = end;
  }
  // A strategy that keeps part of the model draws only that part (ZeRO-3 its shards, a pipeline
  // rank its stages; the Trainer gives the others the whole model). The strategy that runs: the
  // pipeline where --pipeline-parallel wraps --strategy.
  spec.deferred = parallel::strategy_info(trainer.options().strategy).draws_deferred;
  spec.expert_parallel = trainer.grid()->ep();
  spec.context_parallel = trainer.grid()->cp();
  Model model = models::make_model(spec, trainer.grid()->tp());
  if (!safetensors_init.empty()) {
    const std::string origin = "--init-from " + safetensors_init;
    const models::WeightSource source = open_weights(spec, safetensors_init);
    if (parallel::strategy_info(options.strategy).shards_parameters) {
      // Each rank reads the rows of its shards once they are cut, nothing else of the file.
      const bool allow_non_finite = options.allow_non_finite_weights;
      trainer.set_after_setup([source, origin, allow_non_finite](parallel::Strategy& strategy) {
        load_weight_pieces(strategy.parameter_pieces(), *strategy.model().module, source, origin);
        if (!allow_non_finite) check_finite_weights(strategy.parameter_pieces(), origin);
      });
    } else if (model.deferred) {
      // A pipeline rank builds only its stages: each parameter takes its values from the file
      // as the rank builds it, and nothing else of the file is read (its names and shapes are
      // checked now, before any rank starts training).
      models::load_weights(*model.module, source, origin);
      model.deferred->set_source(models::weights_source(*model.module, source, origin));
      if (!options.allow_non_finite_weights) {
        trainer.set_after_setup([origin](parallel::Strategy& strategy) {
          check_finite_weights(*strategy.model().module, origin);
        });
      }
    } else {
      models::load_weights(*model.module, source, origin);
      if (!options.allow_non_finite_weights) check_finite_weights(*model.module, origin);
    }
  }
  JobResult result;
  // The whole model's parameters: a decoder's from its shape (a tensor-parallel rank builds a
  // block of it), any other model's counted.
  if (models::model_info(job.model.name).language_model) {
    result.parameters =
        models::gpt_parameter_count(models::decoder_config(model_spec(plan, vocabulary)));
  } else {
    for (const auto& parameter : model.module->parameters()) result.parameters += parameter.numel();
  }
  result.fit = trainer.fit(std::move(model), data.train, &data.test);
  result.rank = trainer.grid()->world()->rank();
  result.world_size = trainer.grid()->world()->size();
  return result;
}

// 1234567 -> "1,234,567".
static std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(i, ",");
  return digits;
}

std::string summary(const JobConfig& job, const JobResult& result) {
  std::string out;
  const auto& fit = result.fit;
  // A resumed run: the steps it made, and where they lie in the whole run.
  const int64_t made = fit.steps - fit.start_step;
  const std::string span =
      fit.start_step > 0 ? concat(" (steps ", fit.start_step + 1, "-", fit.steps, " of ",
                                  fit.total_steps, ", resumed from step ", fit.start_step, ")")
                         : std::string();
  // The steps' time; the whole fit's beside it where evaluations and checkpoints took a share.
  const bool more = fit.train_seconds > 0 && fit.seconds > 1.2 * fit.train_seconds + 1.0;
  const std::string took =
      more ? concat(printed("%.1f s", fit.train_seconds), " (", printed("%.1f s", fit.seconds),
                    " with evaluations and checkpoints)")
           : printed("%.1f s", fit.seconds);
  out += printed(
      "trained %lld steps%s (global batch %lld, %d rank%s, %s) in %s, %.0f samples/s%s\n",
      static_cast<long long>(made), span.c_str(), static_cast<long long>(fit.global_batch),
      result.world_size, result.world_size == 1 ? "" : "s",
      concat(job.trainer.pipeline_parallel > 1
                 ? concat(job.trainer.pipeline_parallel, "-stage pipeline x ")
                 : std::string(),
             job.trainer.strategy,
             job.trainer.tensor_parallel > 1
                 ? concat(" x tensor-parallel ", job.trainer.tensor_parallel)
                 : std::string(),
             job.trainer.context_parallel > 1
                 ? concat(" x context-parallel ", job.trainer.context_parallel)
                 : std::string(),
             job.trainer.expert_parallel > 1
                 ? concat(", experts over ", job.trainer.expert_parallel, " ranks")
                 : std::string())
          .c_str(),
      took.c_str(), fit.samples_per_second,
      result.parameters > 0
          ? concat("; ", job.model.name, " of ", with_thousands(result.parameters), " parameters")
                .c_str()
          : "");
  if (fit.validation && data::dataset_info(job.dataset).language) {
    const std::string& unit = data::dataset_info(job.dataset).token_unit;
    out += printed(
        "validation loss: %.4f nats/%s (%.3f bits/%s) over %lld windows, next-%s accuracy "
        "%.2f%%\n",
        fit.validation->loss, unit.c_str(), fit.validation->loss / std::log(2.0), unit.c_str(),
        static_cast<long long>(fit.validation->examples), unit.c_str(),
        fit.validation->accuracy * 100);
  } else if (fit.validation) {
    out += printed("test accuracy: %.2f%% (%lld examples), test loss %.4f\n",
                   fit.validation->accuracy * 100, static_cast<long long>(fit.validation->examples),
                   fit.validation->loss);
  }
  if (fit.stopped_by != 0) {
    const std::string& dir = job.trainer.checkpoint_dir;
    // SIGUSR2: the launcher's request, on a signal it names itself.
    out += printed(
        "stopped on request%s after step %lld of %lld: %s\n",
        fit.stopped_by == SIGUSR2 ? "" : concat(" (", signal_name(fit.stopped_by), ")").c_str(),
        static_cast<long long>(fit.steps), static_cast<long long>(fit.total_steps),
        dir.empty() ? "nothing saved (no --checkpoint-dir; give one to resume a stopped run)"
                    : concat("checkpoint saved in ", dir).c_str());
  }
  return out;
}

}  // namespace dtrain::train
