// The correctness oracle of every synchronous strategy: plain single-process training on global
// batch B, against a strategy on N ranks whose per-rank batches together make up B.
//
// It runs in float64 by default (models and inputs converted): the two sides sum the same
// gradients in a different order, and in float32 that difference, amplified by Adam over a few
// steps, depends on which GEMM and convolution kernels the CPU picks (3.7e-5 on one AMD EPYC,
// under 1e-5 elsewhere). In float64 it stays at rounding level (epsilon 2.2e-16, a few hundred
// operations deep), so kTightBound holds on any CPU and is still orders of magnitude below what
// a lost gradient, micro-batch or shard costs (tests check that too, with the faults below).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>

#include "RankThreads.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/parallel/Strategy.h"

namespace dtrain::test {

inline std::vector<at::Tensor> snapshot(const Model& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model.module->parameters()) out.push_back(p.detach().clone());
  return out;
}

inline void restore(Model& model, const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto params = model.module->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

/// A model's trainable parameters and their names, in registration order.
inline std::pair<std::vector<at::Tensor>, std::vector<std::string>> parameters_of(
    const Model& model) {
  std::pair<std::vector<at::Tensor>, std::vector<std::string>> out;
  for (const auto& item : model.module->named_parameters()) {
    out.first.push_back(item.value());
    out.second.push_back(item.key());
  }
  return out;
}

inline double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

/// The optimizer of the equivalence tests: Adam amplifies any difference in the gradients.
inline optim::OptimizerSpec adam() {
  optim::OptimizerSpec spec;
  spec.name = "adam";
  spec.lr = 0.01;
  spec.weight_decay = 1e-4;
  return spec;
}

/// The bound for float64 equivalence tests.
constexpr double kTightBound = 1e-10;

/// Builds the spec's model in `dtype` (parameters and buffers).
inline Model make_model_as(const models::ModelSpec& spec, at::ScalarType dtype) {
  Model model = models::make_model(spec);
  if (model.deferred && model.deferred->pending()) {  // placeholders (spec.deferred)
    model.deferred->to(at::TensorOptions().dtype(dtype));
  } else {
    model.module->to(dtype);
  }
  return model;
}

/// A loss that leaves rank `dropped_rank`'s gradient out (multiplied by zero), to check that an
/// equivalence test notices a missing contribution.
inline parallel::LossFn drop_rank_gradient(int dropped_rank, const comm::CommunicatorPtr& comm) {
  return [dropped_rank, comm](const at::Tensor& output, const at::Tensor& target) {
    auto loss = parallel::cross_entropy(output, target);
    return comm->rank() == dropped_rank ? loss * 0.0 : loss;
  };
}

struct Fixture {
  models::ModelSpec spec;
  /// float64 unless a test is about a 16-bit or float32 path.
  at::ScalarType dtype = at::kDouble;
  data::TensorDataset dataset;
  std::vector<at::Tensor> initial;
  int64_t global_batch = 32;
  optim::OptimizerSpec optimizer;
};

inline Fixture make_fixture(const models::ModelSpec& spec, const optim::OptimizerSpec& optimizer,
                            int steps, int64_t global_batch = 32,
                            at::ScalarType dtype = at::kDouble) {
  Fixture f;
  f.spec = spec;
  f.optimizer = optimizer;
  f.global_batch = global_batch;
  f.dtype = dtype;
  std::vector<int64_t> shape = spec.input_shape;
  auto synthetic = data::make_synthetic(global_batch * steps, shape, spec.classes, 3);
  f.dataset = data::TensorDataset(synthetic.raw_inputs().to(dtype), synthetic.targets());
  torch::manual_seed(11);
  f.initial = snapshot(make_model_as(spec, dtype));
  return f;
}

/// Single-process training on the global batches (`max_grad_norm` > 0: clipped as
/// torch.nn.utils.clip_grad_norm_).
inline std::vector<at::Tensor> train_single(const Fixture& f, int steps, double max_grad_norm = 0) {
  Model model = make_model_as(f.spec, f.dtype);
  restore(model, f.initial);
  auto optimizer = optim::make_optimizer(model.module->parameters(), f.optimizer);
  auto order = data::DistributedSampler(f.dataset.size(), 1, 0, {true, 5, true}).indices();
  for (int step = 0; step < steps; ++step) {
    auto batch = f.dataset.get(std::vector<int64_t>(order.begin() + step * f.global_batch,
                                                    order.begin() + (step + 1) * f.global_batch));
    optimizer->zero_grad();
    parallel::cross_entropy(model(batch.inputs), batch.targets).backward();
    if (max_grad_norm > 0)
      torch::nn::utils::clip_grad_norm_(model.module->parameters(), max_grad_norm);
    optimizer->step();
  }
  return snapshot(model);
}

/// `model`'s values by name after `steps` steps of f's data whose loss is the mean over `shares`
/// data-parallel shares and `micro` micro-batches of the model's loss on each (a mixture of
/// experts' balance losses computed per micro-batch, as a data-parallel rank computes them).
inline std::map<std::string, at::Tensor> trained_in_pieces(const Fixture& f, Model model, int steps,
                                                           int shares, int micro) {
  auto optimizer = optim::make_optimizer(model.module->parameters(), f.optimizer);
  const int64_t local = f.global_batch / shares, each = local / micro;
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    for (int r = 0; r < shares; ++r) {
      auto order = data::DistributedSampler(f.dataset.size(), shares, r, {true, 5, true}).indices();
      for (int m = 0; m < micro; ++m) {
        const int64_t begin = step * local + m * each;
        const auto batch = f.dataset.get(
            std::vector<int64_t>(order.begin() + begin, order.begin() + begin + each));
        const at::Tensor output = model(batch.inputs);
        const at::Tensor loss = model.loss ? model.loss(output, batch.targets)
                                           : parallel::cross_entropy(output, batch.targets);
        (loss / static_cast<double>(shares * micro)).backward();
      }
    }
    optimizer->step();
  }
  std::map<std::string, at::Tensor> named;
  for (const auto& item : model.module->named_parameters()) named[item.key()] = item.value();
  return named;
}

/// A Llama of 3 blocks, the first dense, the others 4 experts (top-2) and a shared one, in
/// float64 with Adam, on random tokens (vocabulary 11, windows of 6) for 3 steps of 8: the
/// mixture-of-experts oracles' model (f.initial left to the caller).
inline Fixture llama_with_experts() {
  Fixture f;
  f.spec.name = "llama";
  models::GptConfig& c = f.spec.gpt;
  c.vocab = 11;
  c.layers = 3;
  c.heads = 2;
  c.width = 8;
  c.context = 6;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_shared_experts = 1;
  c.moe_first_dense = 1;
  c.moe_ffn_width = 6;
  c.moe_aux_loss = 0;
  f.optimizer = adam();
  f.global_batch = 8;
  at::Generator generator = at::detail::createCPUGenerator(5);
  const at::Tensor tokens = at::randint(11, {f.global_batch * 3 + 8}, generator, at::kLong);
  f.dataset = data::TensorDataset::windows(tokens, 6, 1);
  return f;
}

/// The same on `world` rank threads with the strategy `make` builds, `micro` micro-batches per
/// step. Returns the last rank's final weights. `loss_for` (optional) gives each rank its loss
/// function, for fault injection.
inline std::vector<at::Tensor> train_distributed(
    const Fixture& f, int world, int steps, const std::function<parallel::StrategyPtr()>& make,
    int micro = 1,
    const std::function<parallel::LossFn(const comm::CommunicatorPtr&)>& loss_for = nullptr,
    const std::function<Model()>& build = nullptr) {
  std::vector<at::Tensor> result;
  // Rank threads share LibTorch's RNG: build the replicas before they start. `build` (optional)
  // builds each rank's own (a model of placeholders each rank draws its part of); else rank 0
  // starts from f.initial and the others get it by broadcast.
  std::vector<Model> replicas;
  for (int r = 0; r < world; ++r) {
    replicas.push_back(build ? build() : make_model_as(f.spec, f.dtype));
    if (r == 0 && !build) restore(replicas.back(), f.initial);
  }
  run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        auto strategy = make();
        strategy->setup(replicas[comm->rank()], optim::optimizer_factory(f.optimizer),
                        std::make_shared<comm::ProcessGrid>(comm));
        auto order =
            data::DistributedSampler(f.dataset.size(), world, comm->rank(), {true, 5, true})
                .indices();
        const int64_t local = f.global_batch / world;
        for (int step = 0; step < steps; ++step) {
          std::vector<data::Batch> micro_batches;
          for (int m = 0; m < micro; ++m) {
            const int64_t begin = step * local + m * (local / micro);
            micro_batches.push_back(f.dataset.get(std::vector<int64_t>(
                order.begin() + begin, order.begin() + begin + local / micro)));
          }
          strategy->train_step(micro_batches, loss_for ? loss_for(comm) : parallel::cross_entropy);
        }
        strategy->materialize();  // ZeRO-3: gather the full parameters
        if (comm->rank() == world - 1) result = snapshot(strategy->model());
      },
      std::chrono::seconds(60));
  return result;
}

}  // namespace dtrain::test
