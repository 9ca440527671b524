// Tensor parallelism: the paired communication functions, the parallel layers and the GPT model
// built from them against their serial versions (float64, so the bounds hold on any CPU), the
// collectives a block issues, dropout masks, training under DP x PP x TP against one process,
// and checkpoints that resume at other tensor-parallel sizes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/nn/tensor/CrossEntropy.h"
#include "dtrain/nn/tensor/Layers.h"
#include "dtrain/nn/tensor/Mappings.h"
#include "dtrain/nn/tensor/Random.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Generate.h"
#include "parallel/StrategySupport.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/zero/ZeroStrategy.h"

namespace fs = std::filesystem;
using namespace dtrain;
namespace tp = dtrain::nn::tensor;

namespace {

using Named = std::map<std::string, at::Tensor>;

// `llama`: Llama's architecture with grouped-query attention (2 key/value heads for 4 query
// heads) and a SwiGLU MLP of 24.
models::GptConfig tiny_gpt(bool tied = false, bool llama = false) {
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
  return c;
}

// Rank threads share LibTorch's global generator: each builds its model alone, from one seed.
Model build_gpt(const models::GptConfig& config, const comm::CommunicatorPtr& group) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  torch::manual_seed(11);
  Model model = models::make_gpt(config, group);
  model.module->to(at::kDouble);
  return model;
}

Named named_parameters(const Model& model) {
  Named out;
  for (const auto& item : model.module->named_parameters()) out[item.key()] = item.value();
  return out;
}

Named named_values(const Model& model) {
  Named out;
  for (const auto& [name, p] : named_parameters(model)) out[name] = p.detach().clone();
  return out;
}

// The block of the full tensor `full` that `name` is on this rank (all of it when replicated).
at::Tensor block_of(const at::Tensor& full, const tp::ParameterSplits& splits,
                    const std::string& name) {
  const auto it = splits.find(name);
  return it == splits.end() ? full
                            : full.narrow(it->second.dim, it->second.start, it->second.length);
}

// Largest difference between a rank's parameters (or their gradients) and the serial ones.
double max_block_diff(const Named& local, const Named& serial, const tp::ParameterSplits& splits) {
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

at::Tensor random_tokens(int64_t rows, int64_t columns, uint64_t seed, int64_t vocab = 11) {
  at::Generator generator = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, {rows, columns}, generator, at::kLong);
}

}  // namespace

TEST(TensorParallel, MappingsArePairedAndTheIdentityForOneRank) {
  const at::Tensor x = at::arange(12, at::kDouble).view({2, 3, 2});
  for (auto* f : {+[](const at::Tensor& t) { return tp::copy_to_group(t, nullptr); },
                  +[](const at::Tensor& t) { return tp::reduce_from_group(t, nullptr); },
                  +[](const at::Tensor& t) { return tp::gather_from_sequence(t, nullptr); }}) {
    EXPECT_TRUE(f(x).is_same(x));
  }
  test::run_ranks(2, [&](const comm::CommunicatorPtr& group) {
    const int r = group->rank();
    // copy: identity forward, gradients summed backward.
    at::Tensor a = (x + r).requires_grad_();
    at::Tensor y = tp::copy_to_group(a, group);
    EXPECT_TRUE(at::equal(y, x + r));
    (y * (r + 1)).sum().backward();
    EXPECT_TRUE(at::allclose(a.grad(), at::full_like(x, 3.0)));
    // reduce: summed forward, identity backward.
    at::Tensor b = (x * (r + 1)).requires_grad_();
    at::Tensor z = tp::reduce_from_group(b, group);
    EXPECT_TRUE(at::allclose(z, x * 3));
    z.sum().backward();
    EXPECT_TRUE(at::allclose(b.grad(), at::ones_like(x)));
    // scatter <-> gather along the last dimension, with uneven blocks (5 = 3 + 2).
    const at::Tensor full = at::arange(10, at::kDouble).view({2, 5});
    at::Tensor c = full.clone().requires_grad_();
    at::Tensor mine = tp::scatter_to_group(c, group, -1);
    EXPECT_EQ(mine.size(1), r == 0 ? 3 : 2);
    at::Tensor back = tp::gather_from_group(mine, group, -1, 5);
    EXPECT_TRUE(at::equal(back, full));
    (back * back).sum().backward();  // each rank's block of 2c, gathered
    EXPECT_TRUE(at::allclose(c.grad(), 2 * full));
    // Sequence parallelism: gather along dim 1 forward, reduce-scatter backward, and back.
    at::Tensor d = (x.narrow(1, 0, 2) + 10 * r).requires_grad_();  // [2, 2, 2] per rank
    at::Tensor seq = tp::gather_from_sequence(d, group);
    ASSERT_EQ(seq.sizes(), (std::vector<int64_t>{2, 4, 2}));
    EXPECT_TRUE(at::equal(seq.narrow(1, 2 * r, 2), d));
    seq.sum().backward();
    EXPECT_TRUE(at::allclose(d.grad(), at::full_like(d, 2.0)));  // each rank's ones, summed
    at::Tensor e = (x.narrow(1, 0, 2) * (r + 1)).requires_grad_();
    at::Tensor scattered = tp::reduce_scatter_to_sequence(e, group);
    EXPECT_TRUE(at::allclose(scattered, 3 * x.narrow(1, 0, 2).narrow(1, r, 1)));
    scattered.sum().backward();
    EXPECT_TRUE(at::allclose(e.grad(), at::ones_like(e)));
  });
}

TEST(TensorParallel, LayersAndTheLossEqualTheSerialOnesInFloat64) {
  torch::manual_seed(3);
  const at::Tensor input = at::randn({3, 4, 6}, at::kDouble);
  const at::Tensor w1 = at::randn({5, 6}, at::kDouble), b1 = at::randn({5}, at::kDouble);
  const at::Tensor w2 = at::randn({7, 5}, at::kDouble), b2 = at::randn({7}, at::kDouble);
  const at::Tensor table = at::randn({7, 6}, at::kDouble);
  const at::Tensor ids = random_tokens(3, 4, 9, 7);
  const at::Tensor targets = random_tokens(3, 4, 10, 7);
  // Serial: embedding + input -> linear 1 -> gelu -> linear 2 (logits over 7) -> loss.
  auto serial = [&](const at::Tensor& x, const at::Tensor& wa, const at::Tensor& ba,
                    const at::Tensor& wb, const at::Tensor& bb, const at::Tensor& emb) {
    at::Tensor h = x + at::embedding(emb, ids);
    return at::linear(at::gelu(at::linear(h, wa, ba)), wb, bb);
  };
  std::vector<at::Tensor> leaves;
  for (const auto& t : {input, w1, b1, w2, b2, table}) leaves.push_back(t.clone().requires_grad_());
  const at::Tensor logits =
      serial(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5]);
  const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, 7}), targets.reshape({-1}));
  loss.backward();

  for (int ranks : {2, 3}) {
    test::run_ranks(ranks, [&](const comm::CommunicatorPtr& group) {
      tp::ColumnParallelLinear first(tp::ColumnParallelLinearOptions(6, 5), group);
      tp::RowParallelLinear second(tp::RowParallelLinearOptions(5, 7), group);
      tp::ColumnParallelLinear gathered(tp::ColumnParallelLinearOptions(6, 5).gather_output(true),
                                        group);
      tp::RowParallelLinear unsplit_input(
          tp::RowParallelLinearOptions(5, 7).input_is_parallel(false), group);
      tp::VocabParallelEmbedding embedding(tp::VocabParallelEmbeddingOptions(7, 6), group);
      tp::ColumnParallelLinear head(tp::ColumnParallelLinearOptions(5, 7), group);
      for (auto* m : std::initializer_list<torch::nn::Module*>{first.get(), second.get(),
                                                               gathered.get(), unsplit_input.get(),
                                                               embedding.get(), head.get()}) {
        m->to(at::kDouble);
      }
      first->copy_from_full(w1, b1);
      second->copy_from_full(w2, b2);
      gathered->copy_from_full(w1, b1);
      unsplit_input->copy_from_full(w2, b2);
      embedding->copy_from_full(table);
      head->copy_from_full(w2, b2);
      at::Tensor x = input.clone().requires_grad_();
      const at::Tensor h = x + embedding(ids);
      // Column -> row: the replicated logits.
      const at::Tensor out = second(at::gelu(first(h)));
      EXPECT_LT((out - logits).abs().max().item<double>(), 1e-12);
      // gather_output and input_is_parallel(false): the same.
      const at::Tensor out2 = unsplit_input(at::gelu(gathered(h)));
      EXPECT_LT((out2 - logits).abs().max().item<double>(), 1e-12);
      // Vocab-parallel logits (column-parallel head over the hidden layer) and their loss.
      const at::Tensor block = head(at::gelu(gathered(h)));
      const at::Tensor parallel_loss =
          tp::vocab_parallel_cross_entropy(block, targets, group, head->output_start());
      EXPECT_LT(std::abs(parallel_loss.item<double>() - loss.item<double>()), 1e-12);
      EXPECT_TRUE(at::equal(tp::vocab_parallel_argmax(block, group, head->output_start()),
                            logits.argmax(-1)));
      parallel_loss.backward();
      EXPECT_LT((x.grad() - leaves[0].grad()).abs().max().item<double>(), 1e-12);
      const int64_t s = head->output_start(), n = head->output_length();
      EXPECT_LT((head->weight.grad() - leaves[3].grad().narrow(0, s, n)).abs().max().item<double>(),
                1e-12);
      EXPECT_LT((head->bias.grad() - leaves[4].grad().narrow(0, s, n)).abs().max().item<double>(),
                1e-12);
      const int64_t es = embedding->vocab_start(), en = embedding->vocab_length();
      EXPECT_LT((embedding->weight.grad() - leaves[5].grad().narrow(0, es, en))
                    .abs()
                    .max()
                    .item<double>(),
                1e-12);
      const int64_t gs = gathered->output_start(), gn = gathered->output_length();
      EXPECT_LT(
          (gathered->weight.grad() - leaves[1].grad().narrow(0, gs, gn)).abs().max().item<double>(),
          1e-12);
    });
  }
}

TEST(TensorParallel, GptEqualsTheSerialModelForTwoAndFourRanks) {
  const at::Tensor ids = random_tokens(3, 6, 21);
  const at::Tensor targets = random_tokens(3, 6, 22);
  for (bool tied : {false, true}) {
    const auto config = tiny_gpt(tied);
    Model serial = build_gpt(config, nullptr);
    const at::Tensor logits = serial(ids);
    parallel::cross_entropy(logits, targets).backward();
    Named serial_grads;
    for (const auto& [name, p] : named_parameters(serial)) serial_grads[name] = p.grad().clone();
    const Named serial_values = named_values(serial);

    for (int ranks : {2, 4}) {
      test::run_ranks(ranks, [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, ranks, 1);
        Model model = build_gpt(config, grid->tp());
        const auto splits = tp::parameter_splits(*model.module);
        EXPECT_FALSE(splits.empty());
        // Split from the full initialization: every block is the serial tensor's.
        EXPECT_EQ(max_block_diff(named_values(model), serial_values, splits), 0.0);
        const at::Tensor block = model(ids);
        const auto& head = splits.count("head.out.weight") ? splits.at("head.out.weight")
                                                           : splits.at("embedding.token.weight");
        EXPECT_LT((block - logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
                  1e-12);
        ASSERT_TRUE(model.loss);
        model.loss(block, targets).backward();
        Named grads;
        for (const auto& [name, p] : named_parameters(model)) grads[name] = p.grad();
        EXPECT_LT(max_block_diff(grads, serial_grads, splits), 1e-12)
            << "tied " << tied << " T " << ranks;
      });
    }
  }
}

TEST(TensorParallel, ABlockAllreducesTwiceForwardAndTwiceBackward) {
  const int64_t b = 2, s = 6, h = 16;
  test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
    Model model = build_gpt(tiny_gpt(), grid->tp());
    const Stage& block = model.stages[1];
    ASSERT_EQ(block.name, "blocks.0");
    const at::Tensor x = at::randn({b, s, h}, at::kDouble).requires_grad_();
    grid->tp()->reset_tally();
    const at::Tensor y = block.forward(x);
    auto tally = grid->tp()->tally();
    ASSERT_EQ(tally.size(), 1u);  // allreduces only
    EXPECT_EQ(tally["allreduce"].count, 2);
    EXPECT_EQ(tally["allreduce"].elements, 2 * b * s * h);
    y.sum().backward();
    tally = grid->tp()->tally();
    EXPECT_EQ(tally.size(), 1u);
    EXPECT_EQ(tally["allreduce"].count, 4);
    EXPECT_EQ(tally["allreduce"].elements, 4 * b * s * h);
  });
}

TEST(TensorParallel, DropoutMasksAgreeWhereReplicatedAndDifferWhereSplit) {
  std::vector<at::Tensor> replicated(2), split(2);
  for (int r = 0; r < 2; ++r) {
    tp::RngTracker tracker(77, r);
    const at::Tensor ones = at::ones({1000}, at::kDouble);
    replicated[r] = tp::dropout(ones, 0.5, true, tracker.replicated());
    split[r] = tp::dropout(ones, 0.5, true, tracker.parallel());
    EXPECT_TRUE(at::equal(tp::dropout(ones, 0.5, false, tracker.parallel()), ones));
  }
  EXPECT_TRUE(at::equal(replicated[0], replicated[1]));
  EXPECT_FALSE(at::equal(split[0], split[1]));
  const double kept = replicated[0].ne(0).sum().item<double>();
  EXPECT_GT(kept, 400);
  EXPECT_LT(kept, 600);
  EXPECT_LT((replicated[0].masked_select(replicated[0].ne(0)) - 2.0).abs().max().item<double>(),
            1e-12);
  // In the model: with dropout on, the replicated residual stream stays equal on both ranks.
  auto config = tiny_gpt();
  config.dropout = 0.3;
  std::vector<at::Tensor> outputs(2);
  test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
    Model model = build_gpt(config, grid->tp());
    model.module->train();
    at::Tensor h = model.stages[0].forward(random_tokens(2, 6, 5));
    outputs[world->rank()] = model.stages[1].forward(h).detach();
  });
  EXPECT_TRUE(at::equal(outputs[0], outputs[1]));
}

namespace {

struct GridRun {
  int world = 1, tp = 1, pp = 1;
  std::string strategy = "ddp";  // ddp, zero1 (pipeline: its data-parallel side)
  int micro = 1;
  double max_grad_norm = 0.0;
  bool tied = false;
  bool drop_tp_rank_gradient = false;
  bool sequence_parallel = false;
  bool llama = false;  // tiny_gpt's Llama
  /// With a dynamic loss scaler: one element of every split parameter's gradient on TP rank 1
  /// is set to inf in this step (-1 = never), an overflow only that rank sees.
  int overflow_step = -1;
};

struct GptData {
  data::TensorDataset dataset;
  int64_t global_batch = 8;
};

GptData gpt_data(int steps) {
  GptData d;
  at::Tensor tokens = random_tokens(1, d.global_batch * steps + 8, 5).view({-1});
  d.dataset = data::TensorDataset::windows(tokens, 6, 1);
  return d;
}

// Plain single-process training of the serial model (Adam, optional clipping); the optimizer
// step of `skipped_step` is left out (its batch is still consumed).
Named train_serial(const GptData& d, int steps, double max_grad_norm, bool tied,
                   int skipped_step = -1, bool llama = false) {
  Model model = build_gpt(tiny_gpt(tied, llama), nullptr);
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

parallel::StrategyPtr make_strategy(const GridRun& run) {
  parallel::StrategyOptions options;
  options.max_grad_norm = run.max_grad_norm;
  if (run.overflow_step >= 0) options.loss_scaling = "dynamic";
  if (run.pp > 1) {
    options.of<dtrain::parallel::pipeline::PipelineOptions>().data_parallel = run.strategy;
    return parallel::make_strategy("pipeline", options);
  }
  return parallel::make_strategy(run.strategy, options);
}

// Trains on the grid; returns the worst difference of any rank's parameters from `serial`.
// `skipped` (optional) gets each rank's count of steps the loss scaler skipped.
double train_on_grid(const GptData& d, int steps, const GridRun& run, const Named& serial,
                     std::vector<double>* skipped = nullptr) {
  std::vector<double> worst(run.world, 0.0);
  if (skipped) skipped->assign(run.world, -1.0);
  test::run_ranks(
      run.world,
      [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, run.tp, run.pp);
        auto config = tiny_gpt(run.tied, run.llama);
        config.sequence_parallel = run.sequence_parallel;
        Model model = build_gpt(config, grid->tp());
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
        const int dp = grid->dp_size();
        auto order =
            data::DistributedSampler(d.dataset.size(), dp, grid->coordinates().dp, {true, 5, true})
                .indices();
        const int64_t local = d.global_batch / dp;
        for (int step = 0; step < steps; ++step) {
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
        strategy->materialize();
        worst[world->rank()] = max_block_diff(named_values(strategy->model()), serial,
                                              tp::parameter_splits(*strategy->model().module));
      },
      std::chrono::seconds(90));
  return *std::max_element(worst.begin(), worst.end());
}

}  // namespace

TEST(TensorParallel, TrainsLikeOneProcessUnderTpPpAndDp) {
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false);
  GridRun run;
  run.world = 2, run.tp = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 2";
  run.world = 4, run.tp = 2, run.pp = 2, run.micro = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2";
  run.world = 8, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x PP 2 x TP 2";
  // The oracle notices a tensor-parallel rank's gradient left out.
  GridRun dropped;
  dropped.world = 2, dropped.tp = 2, dropped.drop_tp_rank_gradient = true;
  EXPECT_GT(train_on_grid(d, steps, dropped, serial), 1e-6);
}

TEST(TensorParallel, ShardedStrategiesTiedWeightsAndClippingCountReplicasOnce) {
  const int steps = 3;
  const GptData d = gpt_data(steps);
  // A norm cap well below the gradients' norm, so every step clips.
  const Named clipped = train_serial(d, steps, 0.05, false);
  for (const std::string strategy : {"ddp", "zero2", "zero3"}) {
    GridRun run;
    run.world = 4, run.tp = 2, run.strategy = strategy, run.max_grad_norm = 0.05;
    EXPECT_LT(train_on_grid(d, steps, run, clipped), test::kTightBound) << strategy;
  }
  GridRun piped;
  piped.world = 4, piped.tp = 2, piped.pp = 2, piped.micro = 2, piped.max_grad_norm = 0.05;
  EXPECT_LT(train_on_grid(d, steps, piped, clipped), test::kTightBound) << "pipeline";
  const Named tied = train_serial(d, steps, 0.0, true);
  GridRun run;
  run.world = 2, run.tp = 2, run.tied = true;
  EXPECT_LT(train_on_grid(d, steps, run, tied), test::kTightBound) << "tied";
}

TEST(TensorParallel, AnOverflowOnOneTensorParallelRankSkipsTheStepOnAll) {
  // Only TP rank 1 sees an inf (in its own block of a split weight): every rank must skip that
  // step, so all equal serial training without it; a rank that stepped would equal the run
  // that kept it.
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named without_step_1 = train_serial(d, steps, 0.0, false, /*skipped_step=*/1);
  const Named all_steps = train_serial(d, steps, 0.0, false);
  GridRun run;
  run.world = 2, run.tp = 2, run.overflow_step = 1;
  std::vector<double> skipped;
  EXPECT_LT(train_on_grid(d, steps, run, without_step_1, &skipped), test::kTightBound) << "TP 2";
  EXPECT_EQ(skipped, std::vector<double>(2, 1.0));
  GridRun piped = run;
  piped.world = 4, piped.pp = 2, piped.micro = 2;
  EXPECT_LT(train_on_grid(d, steps, piped, without_step_1, &skipped), test::kTightBound)
      << "PP 2 x TP 2";
  EXPECT_EQ(skipped, std::vector<double>(4, 1.0));
  // Without the overflow, the same scaled run keeps every step.
  run.overflow_step = steps + 1;
  EXPECT_LT(train_on_grid(d, steps, run, all_steps, &skipped), test::kTightBound);
  EXPECT_EQ(skipped, std::vector<double>(2, 0.0));
}

TEST(TensorParallel, CheckpointsResumeAtOtherSizesAndConsolidate) {
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false);
  const auto dir =
      (fs::temp_directory_path() / ("dtrain-tp-ckpt-" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  // A step at TP = 2 (zero1 over 2 replicas), saved; two more at TP = 1, 4, PP 2 x TP 2 and
  // zero2 at DP 2: each equals uninterrupted serial training.
  auto run_steps = [&](const GridRun& run, int first, int last, const std::string& save_to,
                       const std::string& load_from) {
    std::vector<double> worst(run.world, 0.0);
    test::run_ranks(
        run.world,
        [&](const comm::CommunicatorPtr& world) {
          auto grid = std::make_shared<comm::ProcessGrid>(world, run.tp, run.pp);
          Model model = build_gpt(tiny_gpt(), grid->tp());
          parallel::LossFn loss =
              model.loss ? parallel::LossFn(model.loss) : parallel::cross_entropy;
          auto strategy = make_strategy(run);
          strategy->setup(model, optim::optimizer_factory(test::adam()), grid);
          if (!load_from.empty()) strategy->load(load_from);
          const int dp = grid->dp_size();
          auto order = data::DistributedSampler(d.dataset.size(), dp, grid->coordinates().dp,
                                                {true, 5, true})
                           .indices();
          const int64_t local = d.global_batch / dp;
          for (int step = first; step < last; ++step) {
            std::vector<data::Batch> micro_batches;
            for (int m = 0; m < run.micro; ++m) {
              const int64_t begin = step * local + m * (local / run.micro);
              micro_batches.push_back(d.dataset.get(std::vector<int64_t>(
                  order.begin() + begin, order.begin() + begin + local / run.micro)));
            }
            strategy->train_step(micro_batches, loss);
          }
          if (!save_to.empty()) {
            world->barrier()->wait();
            strategy->save(save_to);
            world->barrier()->wait();
          }
          strategy->materialize();
          if (last == steps) {
            worst[world->rank()] = max_block_diff(named_values(strategy->model()), serial,
                                                  tp::parameter_splits(*strategy->model().module));
          }
        },
        std::chrono::seconds(90));
    return *std::max_element(worst.begin(), worst.end());
  };
  GridRun writer;
  writer.world = 4, writer.tp = 2, writer.strategy = "zero1";
  run_steps(writer, 0, 1, dir, "");
  // Four files: 2 DP shards x 2 TP ranks, each holding blocks.
  EXPECT_TRUE(fs::exists(parallel::state_file(dir, 3, 4)));

  // Consolidation reads whole tensors from the blocks.
  {
    Model whole = build_gpt(tiny_gpt(), nullptr);
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (const auto& item : whole.module->named_parameters()) {
      names.push_back(item.key());
      params.push_back(item.value());
    }
    parallel::read_state_shards(dir, parallel::whole_pieces(names, params), nullptr, {}, nullptr);
    Model before = build_gpt(tiny_gpt(), nullptr);
    EXPECT_GT(test::max_abs_diff(params, test::snapshot(before)), 1e-4);  // it was trained
  }
  for (GridRun reader : {GridRun{1, 1, 1}, GridRun{4, 4, 1}, GridRun{4, 2, 2, "ddp", 2},
                         GridRun{2, 1, 1, "zero2"}}) {
    EXPECT_LT(run_steps(reader, 1, steps, "", dir), test::kTightBound)
        << "resumed at world " << reader.world << " TP " << reader.tp << " PP " << reader.pp;
  }

  // `dtrain generate` samples from a TP checkpoint and from a PP x TP one: its greedy text is
  // that of the serial model after the same step (so the blocks were joined, not left random).
  const std::string piped_dir = dir + "-pp";
  fs::remove_all(piped_dir);
  fs::create_directories(piped_dir);
  run_steps(GridRun{4, 2, 2, "ddp", 2}, 0, 1, piped_dir, "");
  const std::string vocabulary = "abcdefghijk";
  std::string expected;
  {
    const Named after_one = train_serial(d, 1, 0.0, false);
    torch::NoGradGuard no_grad;
    Model serial_model = build_gpt(tiny_gpt(), nullptr);
    for (auto& [name, p] : named_parameters(serial_model)) p.copy_(after_one.at(name));
    serial_model.module->to(at::kFloat);
    serial_model.module->eval();
    std::vector<int64_t> ids = {0, 3};  // "ad"
    for (int i = 0; i < 10; ++i) {
      const auto first = ids.end() - static_cast<std::ptrdiff_t>(std::min<size_t>(ids.size(), 6));
      at::Tensor window =
          at::tensor(std::vector<int64_t>(first, ids.end()), at::kLong).unsqueeze(0);
      ids.push_back(serial_model(window).select(1, window.size(1) - 1).argmax(-1).item<int64_t>());
    }
    for (int64_t id : ids) expected += vocabulary[id];
  }
  for (const auto& [checkpoint, tp_size, pp_size] :
       {std::tuple{dir, 2, 1}, std::tuple{piped_dir, 2, 2}}) {
    train::CheckpointMeta meta;
    meta.strategy = pp_size > 1 ? "pipeline" : "zero1";
    meta.world_size = 4;
    meta.tp = tp_size, meta.pp = pp_size, meta.dp = 4 / (tp_size * pp_size);
    meta.extras["model"] = models::to_json(tiny_gpt());
    meta.extras["vocabulary"] = vocabulary;
    train::record_files(checkpoint, meta);
    train::write_meta(checkpoint, meta);
    train::GenerateOptions options;
    options.checkpoint = checkpoint;
    options.prompt = "ad";
    options.tokens = 10;
    options.temperature = 0;
    options.threads = 1;
    EXPECT_EQ(train::generate_text(options), expected) << "TP " << tp_size << " PP " << pp_size;
  }
  fs::remove_all(dir);
  fs::remove_all(piped_dir);
}

TEST(TensorParallel, SequenceParallelGptEqualsTheSerialModel) {
  const at::Tensor ids = random_tokens(3, 4, 31);  // 4 positions: split over 2 or 4 ranks
  const at::Tensor targets = random_tokens(3, 4, 32);
  for (bool tied : {false, true}) {
    Model serial = build_gpt(tiny_gpt(tied), nullptr);
    const at::Tensor logits = serial(ids);
    parallel::cross_entropy(logits, targets).backward();
    Named serial_grads;
    for (const auto& [name, p] : named_parameters(serial)) serial_grads[name] = p.grad().clone();
    for (int ranks : {2, 4}) {
      test::run_ranks(ranks, [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, ranks, 1);
        auto config = tiny_gpt(tied);
        config.sequence_parallel = true;
        Model model = build_gpt(config, grid->tp());
        const auto splits = tp::parameter_splits(*model.module);
        const auto& head = splits.count("head.out.weight") ? splits.at("head.out.weight")
                                                           : splits.at("embedding.token.weight");
        const at::Tensor block = model(ids);  // the whole sequence, this rank's vocabulary block
        EXPECT_LT((block - logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
                  1e-12);
        model.loss(block, targets).backward();
        // Replicated parameters hold partial gradients until the strategy sums them.
        parallel::TensorParallelLayout layout =
            parallel::tensor_parallel_layout(*model.module, *grid);
        EXPECT_EQ(layout.partial.size(), 3u + 6u * 2);
        std::vector<at::Tensor> params;
        std::vector<std::string> names;
        Named grads;
        for (const auto& [name, p] : named_parameters(model)) {
          params.push_back(p);
          names.push_back(name);
          grads[name] = p.grad().clone();
        }
        EXPECT_GT(max_block_diff(grads, serial_grads, splits), 1e-6);  // partial sums differ
        layout.sum_partial_gradients(params, names);
        for (size_t i = 0; i < params.size(); ++i) grads[names[i]] = params[i].grad();
        EXPECT_LT(max_block_diff(grads, serial_grads, splits), 1e-12)
            << "tied " << tied << " T " << ranks;
      });
    }
  }
}

TEST(TensorParallel, SequenceParallelBlockGathersAndScattersInsteadOfAllreducing) {
  const int64_t b = 2, s = 6, h = 16;
  test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
    auto config = tiny_gpt();
    config.sequence_parallel = true;
    Model model = build_gpt(config, grid->tp());
    const at::Tensor x = at::randn({b, s / 2, h}, at::kDouble).requires_grad_();
    grid->tp()->reset_tally();
    const at::Tensor y = model.stages[1].forward(x);
    EXPECT_EQ(y.sizes(), x.sizes());
    auto tally = grid->tp()->tally();
    EXPECT_EQ(tally.count("allreduce"), 0u);
    EXPECT_EQ(tally["allgather"].count, 2);
    EXPECT_EQ(tally["allgather"].elements, 2 * b * s * h);
    EXPECT_EQ(tally["reduce_scatter"].count, 2);
    EXPECT_EQ(tally["reduce_scatter"].elements, 2 * b * s * h);
    y.sum().backward();
    tally = grid->tp()->tally();
    EXPECT_EQ(tally.count("allreduce"), 0u);
    EXPECT_EQ(tally["allgather"].count, 4);
    EXPECT_EQ(tally["reduce_scatter"].count, 4);
    EXPECT_EQ(tally["reduce_scatter"].elements, 4 * b * s * h);
  });
}

TEST(TensorParallel, SequenceParallelTrainsLikeOneProcess) {
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false);
  GridRun run;
  run.world = 2, run.tp = 2, run.sequence_parallel = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 2";
  run.world = 4, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, zero1";
  run.world = 4, run.pp = 2, run.micro = 2, run.strategy = "ddp";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2";
  // zero2 would shard the gradients before they are summed over the TP group: refused.
  GridRun zero2;
  zero2.world = 2, zero2.tp = 2, zero2.sequence_parallel = true, zero2.strategy = "zero2";
  EXPECT_THROW(train_on_grid(d, steps, zero2, serial), std::runtime_error);
}

// Llama's architecture under every split: grouped-query attention's key/value heads over 2 ranks,
// SwiGLU's interleaved gate and up rows, RMSNorm's partial gradients under sequence parallelism.
TEST(TensorParallel, LlamaEqualsTheSerialModelAndTrainsLikeOneProcess) {
  const at::Tensor ids = random_tokens(3, 6, 21);
  const at::Tensor targets = random_tokens(3, 6, 22);
  for (bool sequence_parallel : {false, true}) {
    Model serial = build_gpt(tiny_gpt(false, true), nullptr);
    const at::Tensor logits = serial(ids);
    parallel::cross_entropy(logits, targets).backward();
    Named serial_grads;
    for (const auto& [name, p] : named_parameters(serial)) serial_grads[name] = p.grad().clone();
    test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
      auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
      auto config = tiny_gpt(false, true);
      config.sequence_parallel = sequence_parallel;
      Model model = build_gpt(config, grid->tp());
      const auto splits = tp::parameter_splits(*model.module);
      const auto& head = splits.at("head.out.weight");
      const at::Tensor block = model(ids);
      EXPECT_LT((block - logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
                1e-12);
      model.loss(block, targets).backward();
      parallel::TensorParallelLayout layout =
          parallel::tensor_parallel_layout(*model.module, *grid);
      // RMSNorm has no bias, the linear layers none: 2 norms per block and the final one.
      EXPECT_EQ(layout.partial.size(), sequence_parallel ? 1u + 2u * 2 : 0u);
      std::vector<at::Tensor> params;
      std::vector<std::string> names;
      for (const auto& [name, p] : named_parameters(model)) {
        params.push_back(p);
        names.push_back(name);
      }
      layout.sum_partial_gradients(params, names);
      Named grads;
      for (size_t i = 0; i < params.size(); ++i) grads[names[i]] = params[i].grad();
      EXPECT_LT(max_block_diff(grads, serial_grads, splits), 1e-12) << sequence_parallel;
    });
  }
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false, -1, true);
  GridRun run;
  run.llama = true;
  run.world = 2, run.tp = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 2";
  run.world = 8, run.pp = 2, run.micro = 2, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x PP 2 x TP 2";
  run.world = 4, run.pp = 1, run.micro = 1, run.sequence_parallel = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, SP";
  // Key/value heads the group does not divide are refused by name.
  test::run_ranks(4, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 4, 1);
    try {
      build_gpt(tiny_gpt(false, true), grid->tp());
      ADD_FAILURE() << "built with 2 key/value heads over 4 ranks";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--kv-heads (2) must be a multiple of "
                                           "--tensor-parallel (4)"),
                std::string::npos)
          << e.what();
    }
  });
}
