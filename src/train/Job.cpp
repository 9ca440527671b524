// Builds data, model and Trainer for a JobConfig and runs it.
#include "dtrain/train/Job.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/memory/Checkpoint.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::train {

namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

JobConfig::JobConfig() {
  trainer.epochs = 5;
  trainer.optimizer.name = "sgd";
  trainer.optimizer.lr = 0.05;
  trainer.optimizer.momentum = 0.9;
  trainer.optimizer.weight_decay = 5e-4;
  trainer.schedule.decay = "cosine";
  trainer.schedule.warmup_steps = 100;
}

void validate_job(const JobConfig& job) {
  DTRAIN_CHECK_INPUT(contains(models::model_names(), job.model), "--model: unknown model '",
                     job.model, "' (expected ", joined(models::model_names()), ")");
  DTRAIN_CHECK_INPUT(contains(parallel::strategy_names(), job.trainer.strategy),
                     "--strategy: unknown strategy '", job.trainer.strategy, "' (available: ",
                     joined(parallel::strategy_names()), ")");
  DTRAIN_CHECK_INPUT(job.dataset == "fashion-mnist" || job.dataset == "synthetic",
                     "--dataset: unknown data set '", job.dataset,
                     "' (expected fashion-mnist or synthetic)");
  DTRAIN_CHECK_INPUT(job.nproc >= 1, "--nproc must be >= 1, got ", job.nproc);
  DTRAIN_CHECK_INPUT(job.threads >= 0, "--threads must be >= 1, got ", job.threads);
  DTRAIN_CHECK_INPUT(job.comm_timeout_ms > 0, "--comm-timeout must be > 0");
  DTRAIN_CHECK_INPUT(job.synthetic_examples >= 1, "--synthetic-examples must be >= 1");
  for (auto width : job.hidden) DTRAIN_CHECK_INPUT(width >= 1, "--hidden widths must be >= 1");
  DTRAIN_CHECK_INPUT(job.bucket_cap_mb > 0 && job.bucket_cap_mb <= 1 << 20,
                     "--bucket-cap-mb must be in (0, 1048576], got ", job.bucket_cap_mb);
  DTRAIN_CHECK_INPUT(job.trainer.strategy_options.zero3_min_unit_params >= 0,
                     "--zero3-min-unit-params must be >= 0, got ",
                     job.trainer.strategy_options.zero3_min_unit_params);
  validate(job.trainer);
  memory::parse_segments(job.checkpointing, 1);
  // Build throwaway objects to validate their options with their own messages.
  optim::LrSchedule(job.trainer.optimizer.lr, 1, job.trainer.schedule);
  optim::make_optimizer({torch::zeros({1}, torch::requires_grad())}, job.trainer.optimizer);
  parallel::make_strategy(job.trainer.strategy, job.trainer.strategy_options);
  if (job.dataset == "fashion-mnist") {
    data::load_fashion_mnist(job.data_dir, data::Split::Test);  // checks the files
  }
  if (!job.trainer.checkpoint_dir.empty()) ensure_writable(job.trainer.checkpoint_dir);
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
  if (job.dataset == "fashion-mnist") {
    train_set = data::load_fashion_mnist(job.data_dir, data::Split::Train);
    test_set = data::load_fashion_mnist(job.data_dir, data::Split::Test);
  } else {
    const std::vector<int64_t> shape{1, 28, 28};
    train_set = data::make_synthetic(job.synthetic_examples, shape, 10, job.trainer.seed);
    test_set = data::make_synthetic(std::max<int64_t>(job.synthetic_examples / 8, 1), shape, 10,
                                    job.trainer.seed + 1);
  }
  TrainerOptions options = job.trainer;
  options.strategy_options.bucket_cap_bytes =
      static_cast<int64_t>(job.bucket_cap_mb * 1024 * 1024);
  Trainer trainer(options, world);
  models::ModelSpec spec;
  spec.name = job.model;
  spec.hidden = job.hidden;
  spec.checkpointing = job.checkpointing;
  spec.input_shape = train_set.input_shape();
  spec.classes = 10;
  JobResult result;
  result.fit = trainer.fit(models::make_model(spec), train_set, &test_set);
  result.rank = trainer.grid()->world()->rank();
  result.world_size = trainer.grid()->world()->size();
  return result;
}

}  // namespace dtrain::train
