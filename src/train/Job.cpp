// Builds data, model and Trainer for a JobConfig and runs it.
#include "dtrain/train/Job.h"

#include <torch/torch.h>

#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/data/Text.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/memory/Checkpoint.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Registry.h"
#include "dtrain/parallel/ps/PsOptions.h"
#include "dtrain/train/Checkpoint.h"

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

models::ModelSpec model_spec(const JobConfig& job, std::vector<int64_t> input_shape,
                             int64_t vocabulary = 2) {
  models::ModelSpec spec;
  spec.name = job.model;
  spec.gpt = job.gpt;
  spec.gpt.vocab = vocabulary;
  spec.hidden = job.hidden;
  spec.checkpointing = job.checkpointing;
  spec.input_shape = std::move(input_shape);
  spec.classes = 10;
  return spec;
}

// The strategy's rules against the job's layout (ranks, pipeline, tensor parallelism, the
// model), named before any rank starts; the strategy's constructor checks the rest.
void validate_strategy(const JobConfig& job, const TrainerOptions& trainer) {
  parallel::Layout layout;
  layout.strategy = trainer.strategy;
  layout.ranks = job.nproc;
  layout.pipeline_parallel = trainer.pipeline_parallel;
  layout.tensor_parallel = trainer.tensor_parallel;
  const bool language_model = models::model_info(job.model).language_model;
  layout.sequence_parallel = language_model && job.gpt.sequence_parallel;
  layout.tied_parameters = language_model && job.gpt.tied_embeddings;
  layout.defer_eval = trainer.defer_eval;
  layout.model = job.model;
  layout.micro_batches = trainer.accumulation_steps;
  const int pp = std::max(1, trainer.pipeline_parallel);
  const int tp = std::max(1, trainer.tensor_parallel);
  if (trainer.global_batch > 0) {
    const int64_t replicas = std::max(1, job.nproc / (pp * tp));
    layout.micro_batches = trainer.global_batch / (trainer.batch_size * replicas);
  }
  if (pp > 1) {
    layout.model_stages =
        static_cast<int>(models::make_model(model_spec(job, {1, 28, 28})).stages.size());
  }
  auto options = trainer.strategy_options;
  parallel::make_strategy(parallel::resolve_strategy(layout, options), options);
}

}  // namespace

JobConfig::JobConfig() {
  trainer.epochs = 5;
  // The default model's recipe (the main job: configs/fashion-mnist-ddp.toml).
  const models::TrainingRecipe recipe = models::training_recipe(model);
  trainer.optimizer = recipe.optimizer;
  trainer.schedule = recipe.schedule;
  trainer.batch_size = recipe.batch_size;
  trainer.strategy_options.max_grad_norm = recipe.max_grad_norm;
}

std::string apply_model_recipe(JobConfig& job, const std::vector<std::string>& given) {
  if (!contains(models::model_names(), job.model)) return "";  // validate_job names it
  const models::TrainingRecipe recipe = models::training_recipe(job.model);
  auto& t = job.trainer;
  std::string set;
  auto take = [&](const char* flag, auto& field, const auto& value) {
    if (contains(given, flag)) return;
    if (field != value) set += concat(set.empty() ? "" : ", ", "--", flag, " ", value);
    field = value;
  };
  take("optimizer", t.optimizer.name, recipe.optimizer.name);
  take("lr", t.optimizer.lr, recipe.optimizer.lr);
  take("momentum", t.optimizer.momentum, recipe.optimizer.momentum);
  take("weight-decay", t.optimizer.weight_decay, recipe.optimizer.weight_decay);
  take("lr-decay", t.schedule.decay, recipe.schedule.decay);
  take("warmup-steps", t.schedule.warmup_steps, recipe.schedule.warmup_steps);
  take("batch-size", t.batch_size, recipe.batch_size);
  take("max-grad-norm", t.strategy_options.max_grad_norm, recipe.max_grad_norm);
  if (set.empty()) return "";
  return concat("model ", job.model, ": its training recipe sets ", set,
                " (a flag or config key overrides each)");
}

bool uses_parameter_server(const JobConfig& job) {
  return parallel::strategy_info(job.trainer.strategy).parameter_server;
}

void validate_job(const JobConfig& job) {
  DTRAIN_CHECK_INPUT(contains(models::model_names(), job.model), "--model: unknown model '",
                     job.model, "' (expected ", joined(models::model_names()), ")");
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
  DTRAIN_CHECK_INPUT(
      job.dataset == "fashion-mnist" || job.dataset == "synthetic" || job.dataset == "text",
      "--dataset: unknown data set '", job.dataset,
      "' (expected fashion-mnist, synthetic or text)");
  const models::ModelInfo model = models::model_info(job.model);
  DTRAIN_CHECK_INPUT(model.language_model == (job.dataset == "text"),
                     model.language_model
                         ? concat("--model ", job.model,
                                  " is a language model: use it with "
                                  "--dataset text")
                         : concat("--dataset text needs --model gpt or another language "
                                  "model (not ",
                                  job.model, ")"));
  if (model.language_model) {
    models::GptConfig config = job.gpt;
    config.vocab = 2;  // from the text, checked when it is read
    models::validate(config);
  }
  DTRAIN_CHECK_INPUT(job.nproc >= 1, "--nproc must be >= 1, got ", job.nproc);
  const int tp = job.trainer.tensor_parallel;
  DTRAIN_CHECK_INPUT(tp >= 1, "--tensor-parallel must be >= 1, got ", tp);
  DTRAIN_CHECK_INPUT(!job.gpt.sequence_parallel || tp > 1,
                     "--sequence-parallel splits the sequence over the tensor-parallel ranks: "
                     "it needs --tensor-parallel 2 or more");
  if (tp > 1) {
    DTRAIN_CHECK_INPUT(model.tensor_parallel, "--tensor-parallel ", tp,
                       " needs --model gpt or "
                       "another model with tensor-parallel layers, not ",
                       job.model);
    DTRAIN_CHECK_INPUT(job.gpt.heads % tp == 0, "--tensor-parallel ", tp, " must divide --heads (",
                       job.gpt.heads, "): each rank takes whole heads");
    DTRAIN_CHECK_INPUT(!job.gpt.sequence_parallel || job.gpt.context % tp == 0,
                       "--sequence-parallel splits the --context of ", job.gpt.context,
                       " tokens over --tensor-parallel ", tp, ": it must be a multiple of it");
    DTRAIN_CHECK_INPUT(job.nproc % (tp * std::max(1, job.trainer.pipeline_parallel)) == 0,
                       "--nproc ", job.nproc, " is not a multiple of --tensor-parallel ", tp,
                       " x --pipeline-parallel ", job.trainer.pipeline_parallel,
                       " (ranks = data-parallel x pipeline x tensor-parallel)");
  }
  DTRAIN_CHECK_INPUT(job.threads >= 0, "--threads must be >= 1, got ", job.threads);
  DTRAIN_CHECK_INPUT(job.comm_timeout_ms > 0, "--comm-timeout must be > 0");
  DTRAIN_CHECK_INPUT(job.synthetic_examples >= 1, "--synthetic-examples must be >= 1");
  for (auto width : job.hidden) DTRAIN_CHECK_INPUT(width >= 1, "--hidden widths must be >= 1");
  DTRAIN_CHECK_INPUT(job.bucket_cap_mb > 0 && job.bucket_cap_mb <= 1 << 20,
                     "--bucket-cap-mb must be in (0, 1048576], got ", job.bucket_cap_mb);
  const TrainerOptions trainer = trainer_options(job);
  validate(trainer);
  memory::parse_segments(job.checkpointing, 1);
  validate_strategy(job, trainer);
  // Build throwaway objects to validate their options with their own messages.
  optim::LrSchedule(job.trainer.optimizer.lr, 1, job.trainer.schedule);
  optim::make_optimizer({torch::zeros({1}, torch::requires_grad())}, job.trainer.optimizer);
  if (job.dataset == "fashion-mnist") {
    data::load_fashion_mnist(job.data_dir, data::Split::Test);  // checks the files
  }
  if (job.dataset == "text") {
    DTRAIN_CHECK_INPUT(job.validation_fraction > 0 && job.validation_fraction < 1,
                       "--validation-fraction must be in (0, 1), got ", job.validation_fraction);
    data::load_text(text_path(job), job.gpt.context, job.validation_fraction);  // checks it
  }
  if (!job.trainer.checkpoint_dir.empty()) ensure_writable(job.trainer.checkpoint_dir);
}

std::string text_path(const JobConfig& job) {
  if (!job.text_file.empty()) return job.text_file;
  if (!job.data_dir.empty()) return job.data_dir;
  return data::kFortunesDir;
}

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
  options.strategy_options.bucket_cap_bytes = static_cast<int64_t>(job.bucket_cap_mb * 1024 * 1024);
  return options;
}

int64_t planned_steps(const JobConfig& job) {
  const TrainerOptions options = trainer_options(job);
  int64_t examples = job.synthetic_examples;
  if (job.dataset == "text") {
    examples =
        data::load_text(text_path(job), job.gpt.context, job.validation_fraction).train.size();
  } else if (job.dataset == "fashion-mnist") {
    examples = data::load_fashion_mnist(job.data_dir, data::Split::Train).size();
  }
  const int64_t dp = std::max<int64_t>(
      1, job.nproc / std::max(1, options.pipeline_parallel * options.tensor_parallel));
  const int64_t accumulation =
      options.global_batch > 0
          ? std::max<int64_t>(1, options.global_batch / (options.batch_size * dp))
          : options.accumulation_steps;
  const int64_t per_epoch =
      std::max<int64_t>(1, examples / dp / (options.batch_size * accumulation));
  int64_t steps = per_epoch * options.epochs;
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

  data::TensorDataset train_set, test_set;
  TrainerOptions options = trainer_options(job);
  int64_t vocabulary = 2;
  if (job.dataset == "text") {
    data::TextData text = data::load_text(text_path(job), job.gpt.context, job.validation_fraction);
    train_set = text.train;
    test_set = text.validation;
    vocabulary = text.tokenizer.size();
    options.token_loss = true;
    models::GptConfig config = job.gpt;
    config.vocab = vocabulary;
    options.checkpoint_extras["model"] = models::to_json(config);
    options.checkpoint_extras["vocabulary"] = text.tokenizer.vocabulary_utf8();
    if (world->rank() == 0) {
      std::printf(
          "text: %s, %lld characters (%lld for training, %lld for validation), "
          "vocabulary of %lld; GPT of %lld parameters\n",
          text.origin.c_str(), static_cast<long long>(text.train_tokens + text.validation_tokens),
          static_cast<long long>(text.train_tokens), static_cast<long long>(text.validation_tokens),
          static_cast<long long>(vocabulary),
          static_cast<long long>(models::gpt_parameter_count(config)));
    }
  } else if (job.dataset == "fashion-mnist") {
    train_set = data::load_fashion_mnist(job.data_dir, data::Split::Train);
    test_set = data::load_fashion_mnist(job.data_dir, data::Split::Test);
  } else {
    const std::vector<int64_t> shape{1, 28, 28};
    train_set = data::make_synthetic(job.synthetic_examples, shape, 10, job.trainer.seed);
    test_set = data::make_synthetic(std::max<int64_t>(job.synthetic_examples / 8, 1), shape, 10,
                                    job.trainer.seed + 1);
  }
  Trainer trainer(options, world);
  JobResult result;
  result.fit = trainer.fit(models::make_model(model_spec(job, train_set.input_shape(), vocabulary),
                                              trainer.grid()->tp()),
                           train_set, &test_set);
  result.rank = trainer.grid()->world()->rank();
  result.world_size = trainer.grid()->world()->size();
  return result;
}

}  // namespace dtrain::train
