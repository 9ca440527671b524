// Tensor-parallel test runs shared by tests/tensor_parallel_test.cpp, sequence_parallel_test.cpp
// and llama_test.cpp: a tiny GPT (or Llama) built from one seed, parameters compared block by block
// with the serial model's, and training on a DP x PP x TP grid against one process.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/tensor/Split.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "parallel/StrategySupport.h"

namespace dtrain::test {

namespace tp = dtrain::nn::tensor;

using Named = std::map<std::string, at::Tensor>;

// `llama`: Llama's architecture with grouped-query attention (2 key/value heads for 4 query
// heads) and a SwiGLU MLP of 24; `qwen`: and Qwen3's per-head query/key norms, heads 6 wide
// (not width / heads).
inline models::GptConfig tiny_gpt(bool tied = false, bool llama = false, bool qwen = false) {
  models::GptConfig c;
  c.vocab = 11;  // not a multiple of 2 or 4: uneven vocabulary blocks
  c.layers = 2;
  c.heads = 4;
  c.width = 16;
  c.context = 6;
  c.tied_embeddings = tied;
  if (llama) {
    models::llama_preset(c);
    c.kv_heads = 2;
    c.ffn_width = 24;
  }
  if (qwen) {
    c.qk_norm = true;
    c.head_dim = 6;
  }
  return c;
}

// Rank threads share LibTorch's global generator: each builds its model alone, from one seed.
// `deferred`: as placeholders (nn/DeferredInit.h), the strategy draws what the rank keeps.
inline Model build_gpt(const models::GptConfig& config, const comm::CommunicatorPtr& group,
                       bool deferred = false) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(11);
  Model model = models::make_gpt(config, group, deferred);
  nn::module_to(*model.module, at::TensorOptions().dtype(at::kDouble));
  return model;
}

// The bytes of a model's parameters that have memory (placeholders have none).
inline int64_t built_parameter_bytes(const Model& model) {
  int64_t bytes = 0;
  for (const auto& p : model.module->parameters()) {
    if (!nn::is_placeholder(p)) bytes += p.numel() * p.element_size();
  }
  return bytes;
}

inline Named named_parameters(const Model& model) {
  Named out;
  for (const auto& item : model.module->named_parameters()) out[item.key()] = item.value();
  return out;
}

inline Named named_values(const Model& model) {
  Named out;
  for (const auto& [name, p] : named_parameters(model)) out[name] = p.detach().clone();
  return out;
}

// The block of the full tensor `full` that `name` is on this rank (all of it when replicated).
inline at::Tensor block_of(const at::Tensor& full, const tp::ParameterSplits& splits,
                           const std::string& name) {
  const auto it = splits.find(name);
  return it == splits.end() ? full
                            : full.narrow(it->second.dim, it->second.start, it->second.length);
}

// Largest difference between a rank's parameters (or their gradients) and the serial ones.
inline double max_block_diff(const Named& local, const Named& serial,
                             const tp::ParameterSplits& splits) {
  double worst = 0;
  for (const auto& [name, value] : local) {
    EXPECT_TRUE(serial.count(name)) << name;
    if (!serial.count(name)) return 1e9;
    const at::Tensor expected = block_of(serial.at(name), splits, name);
    EXPECT_EQ(value.sizes(), expected.sizes()) << name;
    if (value.sizes() != expected.sizes()) return 1e9;
    worst = std::max(worst, (value - expected).abs().max().item<double>());
  }
  return worst;
}

// The serial model's logits on `ids`, and its gradients (of the loss on `targets`) and values.
// This rank's gradients by name, those that are partial sums over the TP group (sequence
// parallelism's norms, the head norms, shared key/value heads) summed over it first.
inline Named summed_gradients(const Model& model, const parallel::TensorParallelLayout& layout) {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& [name, p] : named_parameters(model)) {
    params.push_back(p);
    names.push_back(name);
  }
  layout.sum_partial_gradients(params, names);
  Named grads;
  for (size_t i = 0; i < params.size(); ++i) grads[names[i]] = params[i].grad();
  return grads;
}

struct SerialPass {
  at::Tensor logits;
  Named grads, values;
};

inline SerialPass serial_pass(const models::GptConfig& config, const at::Tensor& ids,
                              const at::Tensor& targets) {
  Model serial = build_gpt(config, nullptr);
  SerialPass out;
  out.logits = serial(ids);
  parallel::cross_entropy(out.logits, targets).backward();
  for (const auto& [name, p] : named_parameters(serial)) out.grads[name] = p.grad().clone();
  out.values = named_values(serial);
  return out;
}

inline at::Tensor random_tokens(int64_t rows, int64_t columns, uint64_t seed, int64_t vocab = 11) {
  at::Generator generator = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, {rows, columns}, generator, at::kLong);
}

struct GridRun {
  int world = 1, tp = 1, pp = 1;
  std::string strategy = "ddp";  // ddp, zero1 (pipeline: its data-parallel side)
  int micro = 1;
  double max_grad_norm = 0.0;
  bool tied = false;
  bool drop_tp_rank_gradient = false;
  bool sequence_parallel = false;
  bool tp_comm_overlap = false;
  bool llama = false;  // tiny_gpt's Llama
  bool qwen = false;   // and its Qwen3 attention
  /// With a dynamic loss scaler: one element of every split parameter's gradient on TP rank 1
  /// is set to inf in this step (-1 = never), an overflow only that rank sees.
  int overflow_step = -1;
  /// Trains steps [first_step, steps) after loading `load_from` (if set); saves to `save_to`.
  int first_step = 0;
  std::string load_from = {}, save_to = {};
  std::string schedule = "1f1b";  // pipeline
  std::string precision = "fp32";
  /// When set: world rank 0's parameter values after training.
  Named* final_values = nullptr;
  /// When set: the collectives world rank 0's data-parallel group ran (by op: how many).
  std::map<std::string, int64_t>* dp_collectives = nullptr;
  /// Each rank builds its model as placeholders (a pipeline rank draws only its stages).
  bool deferred = false;
  /// When set: each world rank's parameter bytes with memory once set up, and the bytes of the
  /// parameters it trains (Strategy::memory_report), by world rank.
  std::vector<std::pair<int64_t, int64_t>>* built = nullptr;
};

struct GptData {
  data::TensorDataset dataset;
  int64_t global_batch = 8;
};

inline GptData gpt_data(int steps) {
  GptData d;
  at::Tensor tokens = random_tokens(1, d.global_batch * steps + 8, 5).view({-1});
  d.dataset = data::TensorDataset::windows(tokens, 6, 1);
  return d;
}

// Plain single-process training of the serial model (Adam, optional clipping); the optimizer
// step of `skipped_step` is left out (its batch is still consumed).
inline Named train_serial(const GptData& d, int steps, double max_grad_norm, bool tied,
                          int skipped_step = -1, bool llama = false, bool qwen = false) {
  Model model = build_gpt(tiny_gpt(tied, llama, qwen), nullptr);
  auto optimizer = optim::make_optimizer(model.module->parameters(), test::adam());
  auto order = data::DistributedSampler(d.dataset.size(), 1, 0, {true, 5, true}).indices();
  for (int step = 0; step < steps; ++step) {
    auto batch = d.dataset.get(std::vector<int64_t>(order.begin() + step * d.global_batch,
                                                    order.begin() + (step + 1) * d.global_batch));
    optimizer->zero_grad();
    parallel::cross_entropy(model(batch.inputs), batch.targets).backward();
    if (max_grad_norm > 0)
      torch::nn::utils::clip_grad_norm_(model.module->parameters(), max_grad_norm);
    if (step != skipped_step) optimizer->step();
  }
  return named_values(model);
}

inline parallel::StrategyPtr make_strategy(const GridRun& run) {
  parallel::StrategyOptions options;
  options.max_grad_norm = run.max_grad_norm;
  options.precision = run.precision;
  if (run.overflow_step >= 0) options.loss_scaling = "dynamic";
  if (run.pp > 1) {
    options.of<dtrain::parallel::pipeline::PipelineOptions>().data_parallel = run.strategy;
    options.of<dtrain::parallel::pipeline::PipelineOptions>().schedule = run.schedule;
    return parallel::make_strategy("pipeline", options);
  }
  return parallel::make_strategy(run.strategy, options);
}

// Trains on the grid; returns the worst difference of any rank's parameters from `serial`.
// `skipped` (optional) gets each rank's count of steps the loss scaler skipped.
inline double train_on_grid(const GptData& d, int steps, const GridRun& run, const Named& serial,
                            std::vector<double>* skipped = nullptr) {
  std::vector<double> worst(run.world, 0.0);
  if (skipped) skipped->assign(run.world, -1.0);
  test::run_ranks(
      run.world,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, run.tp, run.pp);
        auto config = tiny_gpt(run.tied, run.llama, run.qwen);
        config.sequence_parallel = run.sequence_parallel;
        config.tp_comm_overlap = run.tp_comm_overlap;
        Model model = build_gpt(config, grid->tp(), run.deferred);
        parallel::LossFn loss = model.loss ? parallel::LossFn(model.loss) : parallel::cross_entropy;
        if (run.drop_tp_rank_gradient && grid->coordinates().tp == 1) {
          loss = [inner = loss](const at::Tensor& o, const at::Tensor& t) {
            return inner(o, t) * 0.0;
          };
        }
        int current_step = 0;
        if (run.overflow_step >= 0 && grid->coordinates().tp == 1) {
          const auto splits = tp::parameter_splits(*model.module);
          for (const auto& item : model.module->named_parameters()) {
            if (!splits.count(item.key())) continue;
            item.value().register_hook([&current_step, &run](const at::Tensor& grad) {
              if (current_step != run.overflow_step) return at::Tensor();
              at::Tensor poisoned = grad.clone();
              poisoned.view({-1})[0] = std::numeric_limits<double>::infinity();
              return poisoned;
            });
          }
        }
        auto strategy = make_strategy(run);
        strategy->setup(model, optim::optimizer_factory(test::adam()), grid);
        if (run.built) {
          (*run.built)[world->rank()] = {built_parameter_bytes(strategy->model()),
                                         strategy->memory_report().parameter_bytes};
        }
        if (!run.load_from.empty()) strategy->load(run.load_from);
        const int dp = grid->dp_size();
        auto order =
            data::DistributedSampler(d.dataset.size(), dp, grid->coordinates().dp, {true, 5, true})
                .indices();
        const int64_t local = d.global_batch / dp;
        for (int step = run.first_step; step < steps; ++step) {
          current_step = step;
          std::vector<data::Batch> micro_batches;
          for (int m = 0; m < run.micro; ++m) {
            const int64_t begin = step * local + m * (local / run.micro);
            micro_batches.push_back(d.dataset.get(std::vector<int64_t>(
                order.begin() + begin, order.begin() + begin + local / run.micro)));
          }
          const auto result = strategy->train_step(micro_batches, loss);
          if (skipped && result.metrics.count("skipped_steps")) {
            (*skipped)[world->rank()] = result.metrics.at("skipped_steps");
          }
        }
        if (!run.save_to.empty()) {
          world->barrier()->wait();
          strategy->save(run.save_to);
          world->barrier()->wait();
        }
        strategy->materialize();
        const Named values = named_values(strategy->model());
        if (run.final_values && world->rank() == 0) *run.final_values = values;
        if (run.dp_collectives && world->rank() == 0) {
          for (const auto& [op, tally] : grid->dp()->tally()) (*run.dp_collectives)[op] = tally.count;
        }
        Named compared;  // (in the serial model's dtype)
        for (const auto& [name, value] : values) compared[name] = value.to(at::kDouble);
        worst[world->rank()] =
            max_block_diff(compared, serial, tp::parameter_splits(*strategy->model().module));
      },
      std::chrono::seconds(90));
  return *std::max_element(worst.begin(), worst.end());
}

}  // namespace dtrain::test
