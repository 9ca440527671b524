// Training runs for the tests: `world` rank threads train a float64 model on synthetic data
// (160 examples of 16 features, 4 classes; 40 held out) through the Trainer, so runs that reduce
// in different orders (strategies, world sizes) agree to ~1e-13 on any CPU.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "RankThreads.h"
#include "dtrain/data/Dataset.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/train/Trainer.h"

namespace dtrain::test {

struct RunOutput {
  std::vector<double> losses;
  std::vector<at::Tensor> weights;
  int64_t start_step = 0;
  std::optional<train::EvalResult> validation;
};

inline RunOutput run_training(int world, const train::TrainerOptions& options, uint64_t init_seed,
                              const models::ModelSpec& spec, bool validate = false) {
  const auto synthetic = data::make_synthetic(160, {16}, 4, 2);
  const data::TensorDataset dataset(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  const auto held_out = data::make_synthetic(40, {16}, 4, 3);
  const data::TensorDataset validation(held_out.raw_inputs().to(at::kDouble), held_out.targets());
  RunOutput out;
  // Rank threads share LibTorch's global generator: initialize before they start.
  std::vector<Model> models;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(init_seed + r);
    models.push_back(models::make_model(spec));
    models.back().module->to(at::kDouble);
  }
  run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        train::Trainer trainer(options, comm);
        auto result = trainer.fit(models[comm->rank()], dataset, validate ? &validation : nullptr);
        trainer.strategy().materialize();  // zero3, pipeline: gather the full parameters
        if (comm->rank() == 0) {
          out.validation = result.validation;
          out.losses = result.losses;
          out.start_step = result.start_step;
          for (const auto& p : trainer.strategy().model().module->parameters()) {
            out.weights.push_back(p.detach().clone());
          }
        }
      },
      std::chrono::seconds(60));
  return out;
}

}  // namespace dtrain::test
