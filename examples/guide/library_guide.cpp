// The examples of docs/guide/library.md, compiled and run by the tests (ctest -R LibraryGuide):
//   library_guide dataset|loss|metric|hooks|loop
// Each trains a small model on 1 process, or on N ranks under `dtrain launch --nproc-per-node N
// -- library_guide MODE`, and exits 0 when it learned.
#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(16, 32))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(32, 4))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

// [dataset]
// A data set of your own: examples made (or read from your files) on demand. The Trainer asks
// for the examples of each batch by index; every rank reads only its share.
class Quadrants : public dtrain::data::SampleSource {
 public:
  explicit Quadrants(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  std::vector<int64_t> input_shape() const override { return {16}; }
  dtrain::data::Batch get(const std::vector<int64_t>& indices) const override {
    auto inputs = torch::empty({static_cast<int64_t>(indices.size()), 16});
    auto targets = torch::empty({static_cast<int64_t>(indices.size())}, torch::kLong);
    for (size_t i = 0; i < indices.size(); ++i) {
      // Example k is the same on every rank and in every epoch: seeded by its index.
      auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(indices[i]));
      auto x = at::randn({16}, generator);
      inputs[static_cast<int64_t>(i)] = x;
      targets[static_cast<int64_t>(i)] =
          (x[0].item<float>() > 0 ? 1 : 0) + (x[1].item<float>() > 0 ? 2 : 0);
    }
    return {inputs, targets};
  }

 private:
  int64_t size_;
};
// [dataset]

dtrain::data::TensorDataset quadrants(int64_t size) {
  return dtrain::data::TensorDataset::from_source(std::make_shared<Quadrants>(size),
                                                  /*presampled=*/false);
}

dtrain::train::TrainerOptions small_run() {
  dtrain::train::TrainerOptions options;  // strategy "ddp"
  options.epochs = 3;
  options.batch_size = 32;
  options.optimizer.lr = 0.1;
  options.schedule.warmup_steps = 5;
  return options;
}

int dataset_example(const dtrain::comm::CommunicatorPtr& world) {
  dtrain::train::Trainer trainer(small_run(), world);
  const auto train = quadrants(4096);
  const auto validation = quadrants(512);
  const auto result = trainer.fit(std::make_shared<Net>(), train, &validation);
  if (world->rank() == 0) std::printf("dataset: accuracy %.3f\n", result.validation->accuracy);
  return result.validation->accuracy > 0.8 ? 0 : 1;
}

int loss_example(const dtrain::comm::CommunicatorPtr& world) {
  // [loss]
  // A loss of your own: any function of the model's output and the batch's targets. Here
  // cross-entropy with label smoothing; the strategy averages it over the ranks' examples.
  auto options = small_run();
  options.loss = [](const at::Tensor& logits, const at::Tensor& targets) {
    return torch::nn::functional::cross_entropy(
        logits, targets, torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(0.1));
  };
  // [loss]
  dtrain::train::Trainer trainer(options, world);
  const auto train = quadrants(4096);
  const auto validation = quadrants(512);
  const auto result = trainer.fit(std::make_shared<Net>(), train, &validation);
  if (world->rank() == 0) std::printf("loss: accuracy %.3f\n", result.validation->accuracy);
  return result.validation->accuracy > 0.8 ? 0 : 1;
}

int metric_example(const dtrain::comm::CommunicatorPtr& world) {
  dtrain::train::Trainer trainer(small_run(), world);
  const auto train = quadrants(4096);
  const auto validation = quadrants(512);
  // [metric]
  // A metric of your own, after each evaluation: the worst class's recall on the validation
  // set, computed with the model as the strategy holds it (rank 0 alone here; every rank that
  // takes part in the evaluation calls the hook).
  double worst_recall = 0;
  dtrain::train::TrainCallbacks callbacks;
  callbacks.on_evaluation = [&](int64_t step, const dtrain::train::EvalResult&) {
    if (world->rank() != 0) return;
    torch::NoGradGuard no_grad;
    auto& model = trainer.strategy().model();
    const auto batch = validation.slice(0, validation.size());
    const auto predicted = model.forward(batch.inputs).argmax(1);
    worst_recall = 1.0;
    for (int64_t c = 0; c < 4; ++c) {
      const auto in_class = batch.targets == c;
      const double recall = (predicted.eq(c) & in_class).sum().item<double>() /
                            std::max(1.0, in_class.sum().item<double>());
      worst_recall = std::min(worst_recall, recall);
    }
    std::printf("metric: step %lld, worst class recall %.3f\n", static_cast<long long>(step),
                worst_recall);
  };
  trainer.set_callbacks(callbacks);
  // [metric]
  trainer.fit(std::make_shared<Net>(), train, &validation);
  return world->rank() != 0 || worst_recall > 0.6 ? 0 : 1;
}

int hooks_example(const dtrain::comm::CommunicatorPtr& world) {
  auto options = small_run();
  options.epochs = 50;  // early stopping ends it long before
  dtrain::train::Trainer trainer(options, world);
  const auto train = quadrants(4096);
  const auto validation = quadrants(512);
  // [hooks]
  // Hooks on every step, evaluation and checkpoint; early stopping from one: request_stop()
  // makes every rank stop after the next step (and save a checkpoint with checkpoint_dir).
  int64_t steps_seen = 0;
  dtrain::train::TrainCallbacks callbacks;
  callbacks.on_step = [&](const dtrain::train::StepEvent& step) {
    ++steps_seen;
    if (world->rank() == 0 && step.step % 50 == 0) {
      std::printf("hooks: step %lld/%lld loss %.4f lr %.4f\n", static_cast<long long>(step.step),
                  static_cast<long long>(step.total_steps), step.loss, step.lr);
    }
  };
  callbacks.on_evaluation = [&](int64_t step, const dtrain::train::EvalResult& eval) {
    if (eval.accuracy > 0.85) {
      if (world->rank() == 0) {
        std::printf("hooks: %.3f at step %lld: stopping early\n", eval.accuracy,
                    static_cast<long long>(step));
      }
      dtrain::train::request_stop(SIGTERM);
    }
  };
  trainer.set_callbacks(callbacks);
  const auto result = trainer.fit(std::make_shared<Net>(), train, &validation);
  // [hooks]
  if (world->rank() == 0) {
    std::printf("hooks: %lld steps of %lld, stopped by signal %d\n",
                static_cast<long long>(result.steps), static_cast<long long>(result.total_steps),
                result.stopped_by);
  }
  const bool ok = result.stopped_by == SIGTERM && result.steps < result.total_steps &&
                  steps_seen == result.steps;
  return ok ? 0 : 1;
}

int loop_example(const dtrain::comm::CommunicatorPtr& world) {
  const auto train = quadrants(4096);
  const auto validation = quadrants(512);
  // [loop]
  // Your own loop with dtrain's strategy (here zero2: gradients and optimizer state sharded):
  // prepare() sets the strategy up; each rank trains on its share of every batch.
  auto options = small_run();
  options.strategy = "zero2";
  dtrain::train::Trainer trainer(options, world);
  auto& strategy = trainer.prepare(std::make_shared<Net>(), train.slice(0, 32));
  const auto& grid = *trainer.grid();
  dtrain::data::DistributedSampler sampler(train.size(), grid.data_parallel_size(),
                                           grid.data_parallel_rank(), {true, 0, true});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    sampler.set_epoch(epoch);
    const std::vector<int64_t> mine = sampler.indices();
    for (size_t begin = 0; begin + 32 <= mine.size(); begin += 32) {
      const std::vector<int64_t> indices(mine.begin() + begin, mine.begin() + begin + 32);
      dtrain::optim::set_learning_rate(strategy.optimizer(), 0.1);
      strategy.train_step({train.get(indices)}, dtrain::parallel::cross_entropy);
    }
  }
  const auto eval = trainer.evaluate(validation);  // collective: every rank a share
  // [loop]
  if (world->rank() == 0) std::printf("loop: accuracy %.3f\n", eval.accuracy);
  return eval.accuracy > 0.8 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  auto world = dtrain::launch::init_from_env();  // RANK, WORLD_SIZE, ... or a 1-rank world
  if (mode == "dataset") return dataset_example(world);
  if (mode == "loss") return loss_example(world);
  if (mode == "metric") return metric_example(world);
  if (mode == "hooks") return hooks_example(world);
  if (mode == "loop") return loop_example(world);
  std::fprintf(stderr, "usage: library_guide dataset|loss|metric|hooks|loop\n");
  return 2;
}
