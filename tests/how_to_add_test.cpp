// docs/ARCHITECTURE.md's "How to add" sections, followed from outside the library: each test
// adds a strategy, a federated aggregator, a model or a data set the way the document says, and
// checks it is reached by name, gets its options, obeys the combination rules and trains
// correctly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "Oracle.h"
#include "RankThreads.h"
#include "SmallModels.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Planner.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Aggregator.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "dtrain/train/Job.h"
#include "dtrain/train/Trainer.h"

using namespace dtrain;
using namespace std::chrono_literals;

namespace {

// What validate_job says of `job`: its InputError's text, or "accepted".
std::string job_refusal(const train::JobConfig& job) {
  try {
    train::validate_job(job);
  } catch (const InputError& e) {
    return std::string(e.what());
  }
  return "accepted";
}

}  // namespace

namespace {

// ---- A strategy ---------------------------------------------------------------------------
// The simplest data parallelism: a whole replica per rank, each gradient all-reduced on its own
// after backward. Its own options struct, flag and check, as a strategy in src/parallel/ has.

struct PlainOptions {
  /// "avg" (correct) or "sum" (each rank's gradient counted world-size times: a fault the
  /// oracle must notice).
  std::string reduce = "avg";
};

class PlainAllreduce : public parallel::Strategy {
 public:
  explicit PlainAllreduce(const parallel::StrategyOptions& options)
      : reduce_(options.of<PlainOptions>().reduce) {
    check(options.of<PlainOptions>());
  }
  static void check(const PlainOptions& o) {
    DTRAIN_CHECK_INPUT(o.reduce == "avg" || o.reduce == "sum", "--plain-reduce '", o.reduce,
                       "': avg or sum");
  }
  std::string name() const override { return "plain-allreduce"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override {
    model_ = std::move(model);
    world_ = grid->world();
    torch::NoGradGuard no_grad;
    for (auto& p : model_.module->parameters()) world_->broadcast(p, {0})->wait();
    optimizer_ = make_optimizer(model_.module->parameters());
  }
  parallel::StepResult train_step(const std::vector<data::Batch>& micro_batches,
                                  const parallel::LossFn& loss) override {
    optimizer_->zero_grad();
    parallel::StepResult result;
    for (const auto& batch : micro_batches) {
      at::Tensor l = loss(model_(batch.inputs), batch.targets) / double(micro_batches.size());
      l.backward();
      result.loss += l.item<double>();
      result.samples += batch.inputs.size(0);
    }
    for (auto& p : model_.module->parameters()) {
      world_->allreduce(p.mutable_grad())->wait();
      if (reduce_ == "avg") p.mutable_grad().div_(world_->size());
    }
    optimizer_->step();
    return result;
  }
  Model& model() override { return model_; }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  void save(const std::string& directory) override {
    if (world_->rank() == 0) torch::save(model_.module->parameters(), directory + "/plain.pt");
  }
  void load(const std::string& directory) override {
    std::vector<at::Tensor> saved;
    torch::load(saved, directory + "/plain.pt");
    torch::NoGradGuard no_grad;
    auto parameters = model_.module->parameters();
    for (size_t i = 0; i < parameters.size(); ++i) parameters[i].copy_(saved[i]);
  }
  parallel::MemoryReport memory_report() const override {
    parallel::MemoryReport report;
    for (const auto& p : model_.module->parameters()) {
      report.parameter_bytes += p.numel() * p.element_size();
    }
    report.gradient_bytes = report.parameter_bytes;
    return report;
  }

 private:
  std::string reduce_;
  Model model_;
  comm::CommunicatorPtr world_;
  optim::OptimizerPtr optimizer_;
};

// The one registry entry (a built-in strategy's is a line in src/parallel/Strategies.cpp).
parallel::StrategyInfo plain_allreduce() {
  parallel::StrategyInfo info;
  info.name = "plain-allreduce";
  info.summary = "each gradient all-reduced after backward (a test of the registry)";
  info.loop = parallel::Loop::kSteps;
  parallel::OptionGroup own;
  own.name = "plain-allreduce";
  own.declare = [](FlagSet& flags, parallel::StrategyOptions& options) {
    flags.add("--plain-reduce", options.of<PlainOptions>().reduce,
              "--strategy plain-allreduce: avg or sum");
  };
  own.check = [](const parallel::StrategyOptions& options) {
    PlainAllreduce::check(options.of<PlainOptions>());
  };
  info.options = {own};
  info.check_layout = [](const parallel::StrategyOptions&, const parallel::Layout& layout) {
    DTRAIN_CHECK_INPUT(layout.tensor_parallel == 1,
                       "--strategy plain-allreduce replicates the "
                       "whole model: no --tensor-parallel");
  };
  info.make = [](const parallel::StrategyOptions& options) -> parallel::StrategyPtr {
    return std::make_unique<PlainAllreduce>(options);
  };
  return info;
}

void register_plain_allreduce_once() {
  static const bool registered = [] {
    parallel::register_strategy(plain_allreduce());
    return true;
  }();
  (void)registered;
}

// Final weights of a Trainer run on `world` rank threads (float64 model and data), as rank
// `rank` holds them (a pipeline rank: its stages' trained).
std::vector<at::Tensor> train_with(const train::TrainerOptions& options, int world, int rank = 0) {
  const auto synthetic = data::make_synthetic(128, {12}, 3, 4);
  const data::TensorDataset dataset(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  std::vector<Model> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(5 + r);  // different on each rank: setup must broadcast rank 0's
    models.push_back(models::make_model(test::small_mlp(12, 16, 3)));
    models.back().module->to(at::kDouble);
  }
  std::vector<at::Tensor> weights;
  test::run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        train::Trainer trainer(options, comm);
        trainer.fit(models[comm->rank()], dataset);
        if (comm->rank() == rank) weights = test::snapshot(trainer.strategy().model());
      },
      60s);
  return weights;
}

}  // namespace

TEST(HowToAdd, AStrategyIsReachedByNameGetsItsFlagsAndObeysTheOracle) {
  register_plain_allreduce_once();
  const auto names = parallel::strategy_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "plain-allreduce"), names.end());
  EXPECT_THROW(parallel::register_strategy(plain_allreduce()), InputError);  // the name is taken

  // Its flag is declared with every strategy's, once, bound into its own options struct.
  parallel::StrategyOptions options;
  FlagSet flags;
  parallel::declare_strategy_flags(flags, options);
  int declared = 0;
  for (const Flag& flag : flags.flags()) {
    if (flag.name != "--plain-reduce") continue;
    ++declared;
    *std::get<std::string*>(flag.target) = "sum";  // what the parser does with the flag
  }
  EXPECT_EQ(declared, 1);
  EXPECT_EQ(options.of<PlainOptions>().reduce, "sum");

  // Its checks and combination rules run before any rank starts.
  parallel::Layout layout;
  layout.strategy = "plain-allreduce";
  EXPECT_EQ(parallel::resolve_strategy(layout, options), "plain-allreduce");
  options.of<PlainOptions>().reduce = "median";
  EXPECT_THROW(parallel::resolve_strategy(layout, options), InputError);
  options.of<PlainOptions>().reduce = "avg";
  layout.tensor_parallel = 2;
  EXPECT_THROW(parallel::resolve_strategy(layout, options), InputError);
  layout.tensor_parallel = 1;
  layout.pipeline_parallel = 2;  // not declared a pipeline's stage strategy
  try {
    parallel::resolve_strategy(layout, options);
    ADD_FAILURE() << "a pipeline of plain-allreduce stages was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--pipeline-parallel combines with --strategy ddp"),
              std::string::npos)
        << e.what();
  }

  // The oracle: on 2 ranks it equals single-process training on the same global batch.
  train::TrainerOptions o;
  o.batch_size = 8;
  o.epochs = 2;
  o.optimizer.name = "sgd";  // scale-sensitive, so a gradient counted twice shows
  o.optimizer.lr = 0.1;
  o.progress = false;
  o.seed = 3;
  train::TrainerOptions single = o;
  single.strategy = "ddp";
  single.batch_size = 16;
  const auto expected = train_with(single, 1);
  o.strategy = "plain-allreduce";
  const auto got = train_with(o, 2);
  EXPECT_LE(test::max_abs_diff(expected, got), test::kTightBound);
  // ... and the bound notices a fault: gradients summed instead of averaged.
  o.strategy_options.of<PlainOptions>().reduce = "sum";
  EXPECT_GT(test::max_abs_diff(expected, train_with(o, 2)), 1e-4);
}

// ---- A federated aggregator --------------------------------------------------------------
// The coordinate-wise lower median of the updates (the built-in "median" averages the two
// middle values of an even count): it needs each client's update, so secure aggregation and
// differential privacy refuse it.

namespace {

class Median : public services::federated::Aggregator {
 public:
  std::string name() const override { return "lower-median"; }
  bool needs_individual_updates() const override { return true; }
  void aggregate(at::Tensor& global, const services::federated::RoundUpdates& round) override {
    std::vector<at::Tensor> deltas;
    for (const auto& update : round.updates) deltas.push_back(update.delta);
    // torch's median of an even count is the lower middle value.
    global.add_(std::get<0>(at::stack(deltas).median(0)));
  }
};

void register_median_once() {
  static const bool registered = [] {
    services::federated::register_aggregator(
        {"lower-median", "coordinate-wise lower median of the updates (a test of the registry)",
         [](const services::federated::AggregatorOptions&) -> services::federated::AggregatorPtr {
           return std::make_unique<Median>();
         }});
    return true;
  }();
  (void)registered;
}

}  // namespace

TEST(HowToAdd, AFederatedAggregatorGetsEachUpdateAndIsRefusedWhereOnlySumsAreSeen) {
  register_median_once();
  const auto names = services::federated::aggregator_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "lower-median"), names.end());

  // A round: three clients, one an outlier; the median ignores it, the mean would not.
  services::federated::RoundServerOptions options;
  options.aggregator.algorithm = "lower-median";
  options.clients_per_round = 3;
  const at::Tensor start = at::zeros({3}, at::kDouble);
  services::federated::RoundServer server(start, options);
  ASSERT_EQ(server.select({"a", "b", "c"}).size(), 3u);
  EXPECT_EQ(server.submit("a", at::tensor({1.0, 2.0, 3.0}, at::kDouble), 10), "");
  EXPECT_EQ(server.submit("b", at::tensor({2.0, 3.0, 4.0}, at::kDouble), 10), "");
  EXPECT_EQ(server.submit("c", at::tensor({1e6, -1e6, 1e6}, at::kDouble), 10), "");
  EXPECT_TRUE(server.close().applied);
  EXPECT_TRUE(server.global().equal(at::tensor({2.0, 2.0, 4.0}, at::kDouble)));
  // Its updates only arrive one by one: a secure sum is refused (nothing changes).
  server.select({"a", "b"});
  EXPECT_NE(server.submit_sum(at::ones({3}, at::kDouble), 2, {"a", "b"}, 0.0), "");

  // Where the server sees only the (noised) sum, a clear error before the first round.
  for (int privacy = 0; privacy < 2; ++privacy) {
    services::federated::RoundServerOptions refused = options;
    refused.secure_aggregation = privacy == 0;
    if (privacy == 1) refused.dp.clip = 1.0;
    try {
      services::federated::RoundServer bad(start, refused);
      ADD_FAILURE() << "lower-median accepted with "
                    << (privacy ? "differential privacy" : "secagg");
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--algorithm lower-median needs each client's update"),
                std::string::npos)
          << e.what();
    }
  }

  // And it runs a simulation end to end, reached by name like the built-in ones.
  at::set_num_threads(1);
  const auto synthetic = data::make_synthetic(240, {12}, 4, 6);
  const data::TensorDataset train(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  const auto held_out = data::make_synthetic(60, {12}, 4, 7);
  const data::TensorDataset test(held_out.raw_inputs().to(at::kDouble), held_out.targets());
  services::federated::SimulationOptions simulation;
  simulation.round.aggregator.algorithm = "lower-median";
  simulation.clients = 6;
  simulation.fraction = 0.5;
  simulation.rounds = 3;
  simulation.round.local.epochs = 1;
  simulation.round.local.batch = 8;
  simulation.threads = 1;
  simulation.progress = false;
  const auto result =
      services::federated::simulate(test::small_mlp(12, 16, 4), train, test, simulation);
  EXPECT_EQ(result.rounds_done, 3);
  EXPECT_TRUE(at::isfinite(result.global).all().item<bool>());
}

// ---- A model -----------------------------------------------------------------------------
// A two-layer perceptron described as stages, registered with its own recipe: reached by name,
// cut into units by zero3 (which then equals single-process training), refused where it lacks
// a capability.

namespace {

// Its own hyper-parameter, set by its own flag (declared with the model).
struct TwoLayerOptions {
  int64_t width = 24;
};

models::ModelInfo two_layer() {
  models::ModelInfo info;
  info.name = "two-layer";
  info.summary = "Linear-Tanh-Linear (a test of the model registry)";
  info.build = [](const models::ModelSpec& spec, const comm::CommunicatorPtr&) {
    int64_t inputs = 1;
    for (int64_t d : spec.input_shape) inputs *= d;
    const int64_t width = spec.own.of<TwoLayerOptions>().width;
    return sequential_model(
        torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(inputs, width),
                              torch::nn::Tanh(), torch::nn::Linear(width, spec.classes)));
  };
  info.flags = {{"two-layer", [](FlagSet& flags, models::ModelSpec& spec) {
                   flags.add("--two-layer-width", spec.own.of<TwoLayerOptions>().width,
                             "--model two-layer: the hidden layer's width");
                 }}};
  info.recipe.optimizer.name = "adam";
  info.recipe.optimizer.lr = 0.02;
  info.recipe.batch_size = 16;
  return info;
}

void register_two_layer_once() {
  static const bool registered = [] {
    models::register_model(two_layer());
    return true;
  }();
  (void)registered;
}

}  // namespace

TEST(HowToAdd, AModelIsBuiltByNameCutIntoStagesAndRefusedWhereItCannotGo) {
  register_two_layer_once();
  const auto names = models::model_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "two-layer"), names.end());
  EXPECT_EQ(models::training_recipe("two-layer").optimizer.name, "adam");
  EXPECT_EQ(models::training_recipe("two-layer").batch_size, 16);
  EXPECT_THROW(models::register_model(two_layer()), InputError);

  models::ModelSpec spec;
  spec.name = "two-layer";
  spec.input_shape = {12};
  spec.classes = 3;
  EXPECT_EQ(models::make_model(spec).stages.size(), 4u);  // flatten, linear, tanh, linear

  // Its flag is declared with the other models' (once), and sets the width it builds.
  {
    models::ModelSpec wide = spec;
    FlagSet flags;
    models::declare_model_flags(flags, wide, [](const models::ModelInfo&) { return true; });
    Flag* width = flags.find("--two-layer-width");
    ASSERT_NE(width, nullptr);
    EXPECT_NE(flags.find("--hidden"), nullptr);  // the MLP's, declared beside it
    *std::get<int64_t*>(width->target) = 40;     // what the parser does with the flag
    const Model built = models::make_model(wide);
    EXPECT_EQ(built.module->parameters()[0].size(0), 40);
    EXPECT_EQ(models::make_model(spec).module->parameters()[0].size(0), 24);
  }

  // zero3 gathers it unit by unit (its stages) and still equals single-process training.
  train::TrainerOptions o;
  o.batch_size = 8;
  o.epochs = 2;
  o.optimizer.name = "adam";
  o.optimizer.lr = 0.02;
  o.progress = false;
  o.seed = 4;
  o.strategy = "zero3";
  train::TrainerOptions single = o;
  single.strategy = "ddp";
  single.batch_size = 16;
  const auto synthetic = data::make_synthetic(128, {12}, 3, 4);
  const data::TensorDataset dataset(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  auto run = [&](const train::TrainerOptions& options, int world) {
    std::vector<Model> replicas;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(8);
      replicas.push_back(models::make_model(spec));
      replicas.back().module->to(at::kDouble);
    }
    std::vector<at::Tensor> weights;
    test::run_ranks(
        world,
        [&](const comm::CommunicatorPtr& comm) {
          train::Trainer trainer(options, comm);
          trainer.fit(replicas[comm->rank()], dataset);
          trainer.strategy().materialize();
          if (comm->rank() == 0) weights = test::snapshot(trainer.strategy().model());
        },
        60s);
    return weights;
  };
  EXPECT_LE(test::max_abs_diff(run(single, 1), run(o, 2)), test::kTightBound);

  // It has no tensor-parallel layers and is no language model: the job says so by name.
  train::JobConfig job;
  job.model.name = "two-layer";
  job.dataset = "synthetic";
  job.nproc = 2;
  auto refusal = [&] { return job_refusal(job); };
  job.trainer.tensor_parallel = 2;
  EXPECT_NE(refusal().find("--tensor-parallel 2 needs --model gpt or another model with "
                           "tensor-parallel layers, not two-layer"),
            std::string::npos)
      << refusal();
  job.trainer.tensor_parallel = 1;
  EXPECT_EQ(refusal(), "accepted");
  job.dataset = "text";
  EXPECT_NE(refusal().find("--dataset text needs --model gpt or another language model"),
            std::string::npos)
      << refusal();
}

// ---- A pipeline schedule ------------------------------------------------------------------
// GPipe with its backwards in reverse micro-batch order (the last forward's first, while its
// activations are freshest): a builder of each rank's list and one register_schedule call (a
// built-in schedule's is a line in src/parallel/pipeline/Schedules.cpp). The simulator checks
// it, the pipeline runs it, the planner predicts it.
std::vector<parallel::pipeline::Action> reversed_gpipe(const parallel::pipeline::ScheduleSpec& spec,
                                                       int) {
  using parallel::pipeline::Action;
  std::vector<Action> actions;
  for (int m = 0; m < spec.micro_batches; ++m) actions.push_back({Action::Forward, m, 0});
  for (int m = spec.micro_batches; m-- > 0;) actions.push_back({Action::Backward, m, 0});
  return actions;
}

void register_reversed_gpipe_once() {
  static const bool registered = [] {
    parallel::pipeline::ScheduleInfo info;
    info.name = "gpipe-reversed";
    info.summary = "all forwards, then the backwards last first";
    info.build = reversed_gpipe;
    parallel::pipeline::register_schedule(info);
    // A list that cannot run: every rank's backwards before its forwards.
    info.name = "backward-first";
    info.build = [](const parallel::pipeline::ScheduleSpec& spec, int rank) {
      auto actions = reversed_gpipe(spec, rank);
      std::rotate(actions.begin(), actions.begin() + spec.micro_batches, actions.end());
      return actions;
    };
    parallel::pipeline::register_schedule(info);
    return true;
  }();
  (void)registered;
}

TEST(HowToAdd, APipelineScheduleIsOneBuilderTheSimulatorChecksAndTheStagesRun) {
  namespace pp = parallel::pipeline;
  register_reversed_gpipe_once();
  const auto names = pp::schedule_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "gpipe-reversed"), names.end());
  pp::ScheduleInfo taken;
  taken.name = "gpipe-reversed";
  taken.build = reversed_gpipe;
  EXPECT_THROW(pp::register_schedule(taken), InputError);  // the name is taken
  taken.name = "no-builder";
  taken.build = nullptr;
  EXPECT_THROW(pp::register_schedule(taken), InputError);

  // The simulator runs every rank's list: GPipe's bubble and memory with equal stages.
  const pp::ScheduleSpec spec{"gpipe-reversed", 3, 4, 1};
  std::vector<std::vector<pp::Action>> lists;
  for (int r = 0; r < 3; ++r) lists.push_back(pp::build_schedule(spec, r));
  const pp::Simulation timeline = pp::simulate(spec, lists);
  EXPECT_NEAR(timeline.bubble(), pp::bubble_formula(spec), 1e-12);
  EXPECT_EQ(timeline.peak_live[0], 4);
  // ... and names a list that cannot run.
  const pp::ScheduleSpec stuck{"backward-first", 2, 2, 1};
  std::vector<std::vector<pp::Action>> stuck_lists;
  for (int r = 0; r < 2; ++r) stuck_lists.push_back(pp::build_schedule(stuck, r));
  try {
    pp::simulate(stuck, stuck_lists);
    ADD_FAILURE() << "a deadlocking schedule was simulated";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("the backward-first schedule deadlocks"),
              std::string::npos)
        << e.what();
  }

  // The pipeline runs it by name: each stage's weights are GPipe's (whose equality with one
  // process the pipeline tests check), and they trained.
  train::TrainerOptions o;
  o.batch_size = 4;
  o.accumulation_steps = 4;
  o.epochs = 2;
  o.optimizer.name = "sgd";
  o.optimizer.lr = 0.1;
  o.progress = false;
  o.seed = 3;
  o.pipeline_parallel = 2;
  train::TrainerOptions reversed = o;
  reversed.strategy_options.of<pp::PipelineOptions>().schedule = "gpipe-reversed";
  o.strategy_options.of<pp::PipelineOptions>().schedule = "gpipe";
  for (int stage : {0, 1}) {
    const auto expected = train_with(o, 2, stage);
    EXPECT_LE(test::max_abs_diff(expected, train_with(reversed, 2, stage)), test::kTightBound);
  }
  train::TrainerOptions shorter = reversed;
  shorter.epochs = 1;  // (an epoch more moves the last stage's weights)
  EXPECT_GT(test::max_abs_diff(train_with(shorter, 2, 1), train_with(reversed, 2, 1)), 1e-3);

  // The planner predicts it: GPipe's step with equal costs.
  plan::Cluster cluster;
  cluster.hardware = plan::load_hardware("a100-selene", {DTRAIN_SOURCE_DIR "/configs/hardware"});
  cluster.gpus_per_node = 2;
  plan::Layout layout;
  layout.pp = 2;
  layout.micro_batches = 4;
  layout.schedule = "gpipe-reversed";
  const plan::ModelCost model = plan::model_named("gpt-1.7b");
  const double reversed_step = plan::predict(model, cluster, layout).step_s;
  layout.schedule = "gpipe";
  EXPECT_NEAR(reversed_step, plan::predict(model, cluster, layout).step_s, 1e-9 * reversed_step);
}

// ---- A data set ---------------------------------------------------------------------------
// Three noisy clusters of 6-feature points: one DatasetInfo (its shape, classes and loader)
// and one register_dataset call. The job builds the model for its shape and classes, checks
// its source, and trains on it by name.

namespace {

// Its own option, set by its own flag (declared with the set: dtrain train and dtrain fl then
// have it, and a config file's key of the same name).
struct ClusterOptions {
  double separation = 4;
};

data::DatasetInfo clusters() {
  data::DatasetInfo info;
  info.name = "clusters";
  info.summary = "three Gaussian clusters in 6 dimensions";
  info.input_shape = {6};
  info.classes = 3;
  info.flags = {{"clusters", [](FlagSet& flags, data::DataSource& source) {
                   flags.add("--cluster-separation", source.own.of<ClusterOptions>().separation,
                             "--dataset clusters: the distance of each centre from the origin");
                 }}};
  info.check = [](const data::DataSource& source) {
    DTRAIN_CHECK_INPUT(source.synthetic_examples >= 30,
                       "clusters: --synthetic-examples must be "
                       ">= 30, got ",
                       source.synthetic_examples);
    DTRAIN_CHECK_INPUT(source.own.of<ClusterOptions>().separation >= 0,
                       "clusters: --cluster-separation must be >= 0");
  };
  info.load = [](const data::DataSource& source) {
    auto make = [separation = source.own.of<ClusterOptions>().separation](int64_t n,
                                                                          uint64_t seed) {
      at::Generator generator = at::detail::createCPUGenerator(seed);
      at::Tensor targets = at::arange(n, at::kLong).remainder(3);
      at::Tensor centres = at::eye(3, 6, at::kFloat) * separation;
      at::Tensor inputs = centres.index_select(0, targets) +
                          at::randn({n, 6}, generator, at::TensorOptions(at::kFloat));
      return data::TensorDataset(inputs, targets);
    };
    data::LoadedData data;
    data.train = make(source.synthetic_examples, source.seed);
    data.test = make(300, source.seed + 1);
    return data;
  };
  return info;
}

}  // namespace

TEST(HowToAdd, ADataSetIsOneRegistryEntryTheJobBuildsTheModelForAndTrainsOn) {
  static const bool registered = [] {
    data::register_dataset(clusters());
    return true;
  }();
  ASSERT_TRUE(registered);
  const auto names = data::dataset_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "clusters"), names.end());
  EXPECT_THROW(data::register_dataset(clusters()), InputError);  // the name is taken
  EXPECT_EQ(data::dataset_info("clusters").classes, 3);
  try {
    data::dataset_info("clustres");
    ADD_FAILURE() << "an unknown data set was accepted";
  } catch (const InputError& e) {
    // The built-in sets, those registered at load (images, where the build has it), then ours.
    EXPECT_NE(std::string(e.what()).find("--dataset: unknown data set 'clustres' (available: "
                                         "fashion-mnist, synthetic, text, tokens"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(" or clusters)"), std::string::npos) << e.what();
  }

  train::JobConfig job;
  job.dataset = "clusters";
  job.model.name = "mlp";
  job.model.hidden = {16};
  job.data.synthetic_examples = 600;
  job.threads = 1;
  job.trainer.batch_size = 20;
  job.trainer.epochs = 3;
  job.trainer.progress = false;
  auto refusal = [&] { return job_refusal(job); };
  EXPECT_EQ(refusal(), "accepted");
  // Its flag is declared with the data flags, once, bound into its own options.
  FlagSet flags;
  data::declare_data_flags(flags, job.data, [](const data::DatasetInfo&) { return true; });
  int declared = 0;
  for (const Flag& flag : flags.flags()) declared += flag.name == "--cluster-separation";
  EXPECT_EQ(declared, 1);
  Flag* separation = flags.find("--cluster-separation");
  ASSERT_NE(separation, nullptr);
  *std::get<double*>(separation->target) = -1;  // what the parser does with the flag
  EXPECT_NE(refusal().find("clusters: --cluster-separation must be >= 0"), std::string::npos)
      << refusal();
  *std::get<double*>(separation->target) = 0;  // no separation: the classes are noise
  data::DataSource source = job.data;
  source.test = false;
  at::Tensor inputs = data::load_dataset("clusters", source).train.raw_inputs();
  EXPECT_LT(inputs.mean().item<double>(), 0.2);
  *std::get<double*>(separation->target) = 4;
  source = job.data;
  source.test = false;
  EXPECT_GT(data::load_dataset("clusters", source).train.raw_inputs().mean().item<double>(),
            4.0 / 6 - 0.2);  // each point's centre adds 4 to one of its 6 features
  // Its own check runs before any rank starts; a language model is refused by name.
  job.data.synthetic_examples = 10;
  EXPECT_NE(refusal().find("clusters: --synthetic-examples must be >= 30, got 10"),
            std::string::npos)
      << refusal();
  job.data.synthetic_examples = 600;
  job.model.name = "gpt";
  EXPECT_NE(refusal().find("--model gpt is a language model: use it with --dataset text"),
            std::string::npos)
      << refusal();
  job.model.name = "mlp";

  // Trained by name: the MLP was built for 6 inputs and 3 classes, and it separates them.
  const auto result = train::run_job(job);
  ASSERT_TRUE(result.fit.validation.has_value());
  EXPECT_EQ(result.fit.validation->examples, 300);
  EXPECT_GT(result.fit.validation->accuracy, 0.9);
}
