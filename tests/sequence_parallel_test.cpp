// Megatron's sequence parallelism: norm and residual activations split along the sequence over
// the tensor-parallel group, the model equal to the serial one, the block's allreduces replaced by
// allgathers and reduce-scatters, training equal to one process.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <map>

#include "TensorParallelRuns.h"
#include "dtrain/parallel/StateShards.h"
#include "parallel/StrategySupport.h"

using namespace dtrain;
using namespace dtrain::test;

TEST(TensorParallel, SequenceParallelGptEqualsTheSerialModel) {
  const at::Tensor ids = random_tokens(3, 4, 31);  // 4 positions: split over 2 or 4 ranks
  const at::Tensor targets = random_tokens(3, 4, 32);
  for (bool tied : {false, true}) {
    const SerialPass pass = serial_pass(tiny_gpt(tied), ids, targets);
    const at::Tensor& logits = pass.logits;
    const Named& serial_grads = pass.grads;
    // Selective recomputation of attention's core changes nothing of it.
    // --tp-comm-overlap (the input gradient's reduce-scatter beside the weight gradient)
    // changes nothing either.
    for (const auto& [ranks, recompute, overlap] :
         std::vector<std::tuple<int, std::string, bool>>{{2, "none", false},
                                                         {4, "none", false},
                                                         {2, "selective", false},
                                                         {2, "none", true},
                                                         {4, "selective", true}}) {
      test::run_ranks(ranks, [&, ranks = ranks, recompute = recompute,
                              overlap = overlap](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, ranks, 1);
        auto config = tiny_gpt(tied);
        config.sequence_parallel = true;
        config.checkpointing = recompute;
        config.tp_comm_overlap = overlap;
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
            << "tied " << tied << " T " << ranks << " " << recompute << " overlap " << overlap;
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
  // ZeRO: the LayerNorms' partial gradients are summed over the TP group as each is ready,
  // before the data-parallel reduction, which then reduce-scatters into the shards (zero1 too).
  run.world = 4, run.strategy = "zero1";
  std::map<std::string, int64_t> collectives;
  run.dp_collectives = &collectives;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, zero1";
  EXPECT_GT(collectives["reduce_scatter"], 0) << "zero1 with sequence parallelism";
  run.dp_collectives = nullptr;
  run.strategy = "zero2", run.micro = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, zero2";
  run.tp_comm_overlap = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound)
      << "DP 2 x TP 2, zero2, overlap";
  run.tp_comm_overlap = false;
  run.world = 8, run.pp = 2, run.strategy = "zero1";  // a pipeline's zero1 stages too
  run.dp_collectives = &collectives;
  collectives.clear();
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x DP 2 x TP 2, zero1";
  EXPECT_GT(collectives["reduce_scatter"], 0) << "a pipeline's zero1 with sequence parallelism";
  run.dp_collectives = nullptr;
  run.pp = 1, run.micro = 1;
  run.world = 4, run.pp = 2, run.micro = 2, run.strategy = "ddp";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2";
  // --tp-comm-overlap, and under a zero-bubble schedule (whose split backward keeps the separate
  // layers).
  run.tp_comm_overlap = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2, overlap";
  run.schedule = "zb-h1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "zb-h1 x TP 2, overlap";
  run.schedule = "1f1b";
  run.world = 2, run.pp = 1, run.micro = 1, run.llama = true;
  EXPECT_LT(train_on_grid(d, steps, run, train_serial(d, steps, 0.0, false, -1, true)),
            test::kTightBound)
      << "Llama TP 2, overlap";
}

// Clipping under zero2 with sequence parallelism: the global norm over the shards counts each
// LayerNorm once (whole sums, the same on every TP rank) and every split block.
TEST(TensorParallel, SequenceParallelZero2ClipsLikeOneProcess) {
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const double max_norm = 0.05;
  const Named serial = train_serial(d, steps, max_norm, false);
  GridRun run;
  run.world = 4, run.tp = 2, run.sequence_parallel = true, run.strategy = "zero2";
  run.max_grad_norm = max_norm;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound);
}

// Llama's architecture under every split: grouped-query attention's key/value heads over 2 ranks,
// SwiGLU's interleaved gate and up rows, RMSNorm's partial gradients under sequence parallelism.
