// Train your own LibTorch module with data parallelism. Run it as 1 process, or as N ranks:
//   dtrain launch --nproc-per-node 2 -- ./consumer
#include <dtrain/dtrain.h>
#include <torch/torch.h>

#include <cstdio>

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(784, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
};

int main() {
  auto world = dtrain::launch::init_from_env();  // RANK, WORLD_SIZE, ... or a 1-rank world
  dtrain::train::TrainerOptions options;         // strategy "ddp" by default
  options.epochs = 2;
  options.optimizer.lr = 0.1;
  dtrain::train::Trainer trainer(options, world);
  auto data = dtrain::data::make_synthetic(4096, {1, 28, 28}, 10, /*seed=*/0);
  auto result = trainer.fit(std::make_shared<Net>(), data, &data);
  if (world->rank() == 0) {
    std::printf("consumer: %d rank(s), accuracy %.3f\n", world->size(),
                result.validation->accuracy);
  }
  return result.validation->accuracy > 0.3 ? 0 : 1;  // it must learn (chance is 0.1)
}
