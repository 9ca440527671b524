// Expert parallelism (issue 81): a mixture-of-experts layer whose experts are split over P ranks,
// tokens dispatched and combined by all-to-all with variable splits, against the same layer in one
// process on every rank's tokens together, in float64: outputs, input gradients, each rank's
// experts' gradients (all their tokens' contributions) and the replicated router's and shared
// experts' (partial sums over the ranks). Then a Llama with experts trained by ddp with
// --expert-parallel against one process on the global batch, and its checkpoints across layouts.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <vector>

#include <condition_variable>
#include <mutex>

#include "Oracle.h"
#include "RankThreads.h"
#include "TempDir.h"
#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/Moe.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/zero/Zero3Strategy.h"
#include "parallel/zero/ZeroStrategy.h"
#include "train/ExpertBalance.h"

using namespace dtrain;
using comm::CommunicatorPtr;

namespace {

nn::Moe make_moe(const nn::MoeOptions& options, const CommunicatorPtr& group = nullptr) {
  nn::DeferredInit init(3);
  std::shared_ptr<nn::MoeImpl> moe;
  {
    nn::InitScope scope(init);
    moe = std::make_shared<nn::MoeImpl>(options, group);
  }
  init.bind(*moe);
  init.materialize_all();
  moe->to(at::kDouble);
  return nn::Moe(moe);
}

nn::MoeOptions options_for(int64_t experts, int64_t shared, const std::string& score) {
  nn::MoeOptions o;
  o.width = 8;
  o.ffn_width = 5;
  o.experts = experts;
  o.top_k = 2;
  o.shared_experts = shared;
  o.score = score;
  o.init_std = 0.5;
  return o;
}

// Rank r's tokens: 3 + 2r of them (uneven), the same values every rank can draw.
at::Tensor tokens_of(int rank, int64_t width, int salt) {
  at::Generator g = at::detail::createCPUGenerator(100 * salt + rank);
  return at::randn({3 + 2 * rank, width}, g, at::kDouble);
}

double apart(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a - b).abs().max().item<double>();
}

// Every rank's result against one process's on all tokens. `salt` varies the tokens.
void expect_one_process(int ranks, const nn::MoeOptions& o, int salt) {
  std::vector<at::Tensor> xs, probes;
  for (int r = 0; r < ranks; ++r) {
    xs.push_back(tokens_of(r, o.width, salt));
    probes.push_back(tokens_of(r, o.width, salt + 7));
  }
  nn::Moe whole = make_moe(o);
  const at::Tensor x_all = at::cat(xs).requires_grad_(true);
  const at::Tensor out_all = whole(x_all);
  (out_all * at::cat(probes)).sum().backward();
  std::vector<int64_t> sent(ranks, 0);
  test::run_ranks(ranks, [&](const CommunicatorPtr& world) {
    const int r = world->rank();
    nn::Moe moe = make_moe(o, world);
    ASSERT_EQ(moe->local_experts(), o.experts / ranks);
    const int64_t first = moe->first_expert(), L = moe->local_experts();
    EXPECT_EQ(apart(moe->gate, whole->gate.narrow(0, first, L).detach()), 0.0);  // drawn alike
    const at::Tensor x = xs[r].clone().requires_grad_(true);
    const at::Tensor out = moe(x);
    (out * probes[r]).sum().backward();
    int64_t offset = 0;
    for (int i = 0; i < r; ++i) offset += xs[i].size(0);
    const int64_t n = xs[r].size(0);
    EXPECT_LT(apart(out, out_all.narrow(0, offset, n)), 1e-12) << "rank " << r;
    EXPECT_LT(apart(x.grad(), x_all.grad().narrow(0, offset, n)), 1e-12) << "rank " << r;
    for (const char* name : {"gate", "up", "down"}) {
      const at::Tensor mine = moe->named_parameters()[name].grad();
      const at::Tensor theirs = whole->named_parameters()[name].grad().narrow(0, first, L);
      EXPECT_LT(apart(mine, theirs), 1e-12) << name << " rank " << r;
    }
    std::vector<std::string> replicated = {"router"};
    if (o.shared_experts > 0) replicated.insert(replicated.end(), {"shared_gate", "shared_down"});
    for (const auto& name : replicated) {
      at::Tensor sum = moe->named_parameters()[name].grad().clone();
      world->allreduce(sum)->wait();
      EXPECT_LT(apart(sum, whole->named_parameters()[name].grad()), 1e-12) << name;
    }
    sent[r] = world->tally().at("all_to_all").count;
  });
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(sent[r], 5) << r;  // counts; rows there, back, twice
}

}  // namespace

TEST(ExpertParallel, TheLayerOverTwoAndFourRanksIsOneProcessInFloat64) {
  for (const int ranks : {2, 4}) {
    SCOPED_TRACE(ranks);
    expect_one_process(ranks, options_for(8, 0, "softmax"), 1);
    expect_one_process(ranks, options_for(4, 1, "sigmoid"), 2);
  }
  // One expert per rank and few tokens: some ranks send nothing to some experts.
  nn::MoeOptions sparse = options_for(4, 0, "softmax");
  sparse.top_k = 1;
  expect_one_process(4, sparse, 3);
}

// A rank none of whose tokens go to another rank's experts still takes part in both exchanges
// and their backward (its peers wait for it): skewed routing sends every token to expert 0.
TEST(ExpertParallel, ARankWithNothingToComputeStillExchanges) {
  nn::MoeOptions o = options_for(4, 0, "softmax");
  o.top_k = 1;
  std::vector<at::Tensor> grads(2);
  test::run_ranks(2, [&](const CommunicatorPtr& world) {
    nn::Moe moe = make_moe(o, world);
    {
      torch::NoGradGuard no_grad;
      moe->router.zero_();
      moe->router.select(1, 0).fill_(0);
      moe->expert_bias.select(0, 0).fill_(10.0);  // every token to expert 0 (rank 0's)
    }
    const at::Tensor x = tokens_of(world->rank(), o.width, 4).requires_grad_(true);
    moe(x).sum().backward();
    EXPECT_EQ(moe->stats().load[0], x.size(0));
    grads[world->rank()] = moe->gate.grad().clone();
  });
  EXPECT_GT(grads[0].abs().sum().item<double>(), 0.0);  // rank 0 computed every token
  EXPECT_EQ(grads[1].abs().sum().item<double>(), 0.0);  // rank 1's experts saw none
}

TEST(ExpertParallel, ExpertsThatDoNotSplitOverTheRanksAreRefused) {
  test::run_ranks(2, [](const CommunicatorPtr& world) {
    nn::MoeOptions o = options_for(3, 0, "softmax");
    try {
      make_moe(o, world);
      ADD_FAILURE() << "3 experts over 2 ranks were accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("--moe-experts (3) must be a multiple of "
                                           "--expert-parallel (2)"),
                std::string::npos)
          << e.what();
    }
  });
}

namespace {

// The same model on every rank (its seed drawn from the global generator, which rank threads
// share): built one rank at a time.
Model build_on(const test::Fixture& f, const comm::CommunicatorPtr& experts,
               const comm::CommunicatorPtr& tensor_parallel = nullptr,
               bool sequence_parallel = false) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  models::ModelSpec spec = f.spec;
  spec.expert_parallel = experts;
  spec.gpt.sequence_parallel = sequence_parallel;
  torch::manual_seed(11);
  Model model = models::make_model(spec, tensor_parallel);
  model.module->to(f.dtype);
  return model;
}

// Rank `rank`'s part of one process's named values: its experts' blocks, the rest whole.
std::map<std::string, at::Tensor> expected_part(const std::map<std::string, at::Tensor>& whole,
                                                const Model& mine) {
  std::map<std::string, at::Tensor> part;
  const auto splits = nn::tensor::parameter_splits(*mine.module);
  for (const auto& item : mine.module->named_parameters()) {
    at::Tensor value = whole.at(item.key());
    const auto split = splits.find(item.key());
    if (split != splits.end()) {
      value = value.narrow(split->second.dim, split->second.start, split->second.length);
    }
    part[item.key()] = value;
  }
  return part;
}

struct ExpertRun {
  int world = 2;
  int experts = 2;  // --expert-parallel
  int steps = 3;
  int first_step = 0;
  int micro = 1;
  double max_grad_norm = 0;
  std::string strategy = "ddp";  // or zero1, zero2, zero3, pipeline
  int pp = 1;                    // pipeline: its ranks (world = pp x tp x data-parallel)
  int tp = 1;                    // tensor parallelism (the model's loss: vocabulary-parallel)
  bool sequence_parallel = false;
  std::string schedule = "1f1b";
  int chunks = 1;
  std::string stage_strategy = "ddp";  // a pipeline's data parallelism: ddp or zero1
  bool model_loss = false;  // the model's loss (with its balance losses), not cross-entropy
  std::string save_to, load_from;
};

// Trains `run` and returns the largest difference over ranks and parameters from `whole` (one
// process's values by name).
double expert_parallel_apart(const test::Fixture& f, const ExpertRun& run,
                             const std::map<std::string, at::Tensor>& whole) {
  std::vector<double> most(run.world, 0.0);
  test::run_ranks(
      run.world,
      [&](const CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, run.tp, run.pp);
        grid->split_experts(run.experts);
        Model model = build_on(f, grid->ep(), grid->tp(), run.sequence_parallel);
        parallel::StrategyOptions options;
        options.max_grad_norm = run.max_grad_norm;
        std::unique_ptr<parallel::Strategy> made;
        if (run.strategy == "ddp") {
          made = std::make_unique<parallel::ddp::DdpStrategy>(options);
        } else if (run.strategy == "pipeline") {
          auto& pipe = options.of<parallel::pipeline::PipelineOptions>();
          pipe.schedule = run.schedule;
          pipe.virtual_stages = run.chunks;
          pipe.data_parallel = run.stage_strategy;
          made = std::make_unique<parallel::pipeline::PipelineStrategy>(options);
        } else if (run.strategy == "zero3") {
          made = std::make_unique<parallel::zero::Zero3Strategy>(options);
        } else {
          made = std::make_unique<parallel::zero::ZeroStrategy>(options,
                                                                run.strategy == "zero1" ? 1 : 2);
        }
        parallel::Strategy& strategy = *made;
        const parallel::LossFn loss = run.model_loss || run.tp > 1
                                          ? parallel::LossFn(model.loss)
                                          : parallel::LossFn(parallel::cross_entropy);
        strategy.setup(model, optim::optimizer_factory(f.optimizer), grid);
        if (!run.load_from.empty()) strategy.load(run.load_from);
        const int shares = grid->dp_size();
        auto order = data::DistributedSampler(f.dataset.size(), shares, grid->coordinates().dp,
                                              {true, 5, true})
                         .indices();
        const int64_t local = f.global_batch / shares;
        for (int step = run.first_step; step < run.first_step + run.steps; ++step) {
          std::vector<data::Batch> micro_batches;
          for (int m = 0; m < run.micro; ++m) {
            const int64_t begin = step * local + m * (local / run.micro);
            micro_batches.push_back(f.dataset.get(std::vector<int64_t>(
                order.begin() + begin, order.begin() + begin + local / run.micro)));
          }
          strategy.train_step(micro_batches, loss);
        }
        if (!run.save_to.empty()) strategy.save(run.save_to);
        strategy.materialize();  // ZeRO-3: the full (local) parameters again
        const auto expected = expected_part(whole, strategy.model());
        // (A pipeline's rank compares the stages it trains.)
        std::vector<std::pair<std::string, at::Tensor>> trained;
        if (auto* pipeline = dynamic_cast<parallel::pipeline::PipelineStrategy*>(&strategy)) {
          for (size_t k = 0; k < pipeline->local_parameters().size(); ++k) {
            trained.emplace_back(pipeline->local_parameter_names()[k],
                                 pipeline->local_parameters()[k]);
          }
        } else {
          for (const auto& item : strategy.model().module->named_parameters()) {
            trained.emplace_back(item.key(), item.value());
          }
        }
        for (const auto& [name, value] : trained) {
          most[world->rank()] =
              std::max(most[world->rank()], (value - expected.at(name)).abs().max().item<double>());
        }
      },
      std::chrono::seconds(60));
  return *std::max_element(most.begin(), most.end());
}

std::map<std::string, at::Tensor> trained_whole(test::Fixture& f, int steps,
                                                double max_grad_norm = 0) {
  Model model = build_on(f, nullptr);
  f.initial = test::snapshot(model);
  const auto values = test::train_single(f, steps, max_grad_norm);
  std::map<std::string, at::Tensor> named;
  size_t i = 0;
  for (const auto& item : model.module->named_parameters()) named[item.key()] = values[i++];
  return named;
}

}  // namespace

// ddp with --expert-parallel 2 over 2 ranks, 2 over 4 (two expert groups, each expert's
// gradient summed over its expert data-parallel pair) and 4 over 4: every rank's parameters
// equal one process's on the global batch (its experts' blocks), also with gradient
// accumulation and with clipping (the experts' squares summed over the expert group); zero1,
// zero2 and zero3 alike (zero3: each rank's experts sharded over the ranks holding the same ones,
// gathered with their block and reduce-scattered over that group).
TEST(ExpertParallel, DdpWithExpertsSplitIsOneProcessInFloat64) {
  test::Fixture f = test::llama_with_experts();
  const auto whole = trained_whole(f, 3);
  {
    const Model serial = build_on(f, nullptr);
    EXPECT_GT(
        (serial.module->named_parameters()["blocks.1.moe.gate"] - whole.at("blocks.1.moe.gate"))
            .abs()
            .max()
            .item<double>(),
        1e-3);  // it trained
  }
  for (const auto& [world, experts] : std::vector<std::pair<int, int>>{{2, 2}, {4, 2}, {4, 4}}) {
    ExpertRun run;
    run.world = world;
    run.experts = experts;
    EXPECT_LT(expert_parallel_apart(f, run, whole), test::kTightBound)
        << world << " ranks, --expert-parallel " << experts;
  }
  ExpertRun accumulate;
  accumulate.micro = 2;
  EXPECT_LT(expert_parallel_apart(f, accumulate, whole), test::kTightBound) << "accumulation";
  // ZeRO-1 and 2: the dense state sharded over the data-parallel ranks, the experts' over the
  // ranks holding the same experts.
  for (const std::string strategy : {"zero1", "zero2", "zero3"}) {
    ExpertRun zero;
    zero.world = 4;
    zero.strategy = strategy;
    zero.micro = 2;
    EXPECT_LT(expert_parallel_apart(f, zero, whole), test::kTightBound) << strategy;
  }
  // zero3 with an expert data-parallel group of one (each rank's experts its own alone), and of
  // two with every rank's experts apart (P = 4 over 4: the expert units unsharded).
  for (const auto& [world, experts] : std::vector<std::pair<int, int>>{{2, 2}, {4, 4}}) {
    ExpertRun zero3;
    zero3.world = world;
    zero3.experts = experts;
    zero3.strategy = "zero3";
    EXPECT_LT(expert_parallel_apart(f, zero3, whole), test::kTightBound)
        << "zero3, " << world << " ranks, --expert-parallel " << experts;
  }
  test::Fixture clipped = test::llama_with_experts();
  const auto whole_clipped = trained_whole(clipped, 3, 0.05);
  for (const std::string strategy : {"ddp", "zero1", "zero2", "zero3"}) {
    ExpertRun clip;
    clip.world = 4;
    clip.max_grad_norm = 0.05;
    clip.strategy = strategy;
    EXPECT_LT(expert_parallel_apart(clipped, clip, whole_clipped), test::kTightBound)
        << "clipping, " << strategy;
  }
}

// Pipelines with a mixture of experts (DeepSeek-V3 trained PP x EP): the experts split over the
// data-parallel ranks of each stage, each stage's all-to-alls among its own ranks, the experts'
// gradients reduced over their expert data-parallel group after the schedule. 1F1B, GPipe,
// interleaved, zero bubble and DualPipe-V (its pairs on two threads, the backward's all-to-alls
// on the second lane; one rank holding both arms of the V, and two), with accumulation and
// clipping, equal one process on the global batch. The balance losses of layers on every stage
// reach the gradients through each layer's backward (the loss lives on the last stage): equal to
// one process adding them per micro-batch.
TEST(ExpertParallel, PipelinesWithExpertsAreOneProcessInFloat64) {
  test::Fixture f = test::llama_with_experts();
  const auto whole = trained_whole(f, 3);
  struct Case {
    int world, pp, experts, micro;
    std::string schedule;
    int chunks;
  };
  for (const Case& c : std::vector<Case>{{2, 2, 1, 2, "1f1b", 1},
                                         {4, 2, 2, 2, "1f1b", 1},
                                         {4, 2, 2, 1, "gpipe", 1},
                                         {4, 2, 2, 2, "interleaved", 2},
                                         {4, 2, 2, 2, "zb-h1", 1},
                                         {8, 2, 4, 2, "1f1b", 1},
                                         {8, 2, 2, 2, "1f1b", 1},
                                         {2, 1, 2, 2, "dualpipev", 2},
                                         {2, 1, 2, 4, "dualpipev", 2},
                                         {4, 2, 2, 4, "dualpipev", 2}}) {
    ExpertRun run;
    run.strategy = "pipeline";
    run.world = c.world;
    run.pp = c.pp;
    run.experts = c.experts;
    run.micro = c.micro;
    run.schedule = c.schedule;
    run.chunks = c.chunks;
    EXPECT_LT(expert_parallel_apart(f, run, whole), test::kTightBound)
        << c.world << " ranks, " << c.pp << " stages, --expert-parallel " << c.experts << ", "
        << c.schedule << ", " << c.micro << " micro-batches";
  }
  // DualPipe-V with recomputation (whole blocks and attention's core, recomputed in a pair's
  // backward thread while its forward thread runs the other chunk), and with tensor parallelism
  // (TP 2 x EP 2, with and without sequence parallelism: the backward thread's tensor-parallel
  // collectives on the TP group's second lane).
  auto dualpipev = [&](const test::Fixture& fixture, int world, int pp, int tp, bool sp) {
    ExpertRun run;
    run.strategy = "pipeline";
    run.world = world;
    run.pp = pp;
    run.tp = tp;
    run.sequence_parallel = sp;
    run.experts = 2;
    run.micro = 4;
    run.schedule = "dualpipev";
    run.chunks = 2;
    return expert_parallel_apart(fixture, run, whole);
  };
  for (const std::string checkpointing : {"2", "selective"}) {
    test::Fixture recomputed = f;
    recomputed.spec.checkpointing = checkpointing;
    for (const auto& [world, pp] : std::vector<std::pair<int, int>>{{2, 1}, {4, 2}}) {
      EXPECT_LT(dualpipev(recomputed, world, pp, 1, false), test::kTightBound)
          << "dualpipev, --checkpointing " << checkpointing << ", " << world << " ranks";
    }
  }
  for (const bool sp : {false, true}) {
    EXPECT_LT(dualpipev(f, 4, 1, 2, sp), test::kTightBound)
        << "dualpipev, TP 2" << (sp ? " (SP)" : "") << " x EP 2";
  }
  // DeepSeek-V3's PP x EP x ZeRO-1: the experts' optimizer state sharded over the ranks holding
  // the same experts, the rest's over the stage's data-parallel ranks.
  for (const auto& [world, experts] : std::vector<std::pair<int, int>>{{4, 2}, {8, 2}}) {
    ExpertRun zero;
    zero.strategy = "pipeline";
    zero.stage_strategy = "zero1";
    zero.world = world;
    zero.pp = 2;
    zero.experts = experts;
    zero.micro = 2;
    EXPECT_LT(expert_parallel_apart(f, zero, whole), test::kTightBound)
        << "zero1, " << world << " ranks, --expert-parallel " << experts;
  }
  test::Fixture clipped = test::llama_with_experts();
  const auto whole_clipped = trained_whole(clipped, 3, 0.05);
  for (const std::string stage_strategy : {"ddp", "zero1"}) {
    ExpertRun clip;
    clip.strategy = "pipeline";
    clip.stage_strategy = stage_strategy;
    clip.world = 4;
    clip.pp = 2;
    clip.micro = 2;
    clip.max_grad_norm = 0.05;
    EXPECT_LT(expert_parallel_apart(clipped, clip, whole_clipped), test::kTightBound)
        << "clipping, " << stage_strategy;
  }

  test::Fixture balanced = test::llama_with_experts();
  balanced.spec.gpt.moe_aux_loss = 0.05;
  balanced.spec.gpt.moe_z_loss = 0.01;
  balanced.spec.gpt.moe_first_dense = 0;  // MoE layers on both stages
  test::Fixture unbalanced = balanced;
  unbalanced.spec.gpt.moe_aux_loss = unbalanced.spec.gpt.moe_z_loss = 0;
  for (const auto& [world, experts] : std::vector<std::pair<int, int>>{{2, 1}, {4, 2}}) {
    const int shares = world / 2;
    const auto oracle =
        test::trained_in_pieces(balanced, build_on(balanced, nullptr), 3, shares, 2);
    const auto without =
        test::trained_in_pieces(unbalanced, build_on(unbalanced, nullptr), 3, shares, 2);
    EXPECT_GT((oracle.at("blocks.1.moe.router") - without.at("blocks.1.moe.router"))
                  .abs()
                  .max()
                  .item<double>(),
              1e-4);  // the balance losses move the router
    ExpertRun run;
    run.strategy = "pipeline";
    run.world = world;
    run.pp = 2;
    run.experts = experts;
    run.micro = 2;
    run.model_loss = true;
    EXPECT_LT(expert_parallel_apart(balanced, run, oracle), test::kTightBound)
        << "balance losses, " << world << " ranks, --expert-parallel " << experts;
  }
}

// A peer that stops in the middle of DualPipe-V's pairs (rank 1 hangs after the first pair of
// its second step, as a frozen machine would): rank 0's two threads each wait in an exchange
// with it, each wait times out naming its op and group, both threads are joined and the step
// throws that error; nothing hangs. Rank 1, let go, finds rank 0 gone the same way.
TEST(ExpertParallel, APeerLostInTheMiddleOfDualPipeVsPairsIsNamed) {
  test::Fixture f = test::llama_with_experts();
  Model initial = build_on(f, nullptr);
  f.initial = test::snapshot(initial);
  std::mutex mutex;
  std::condition_variable changed;
  bool hung = false, let_go = false;
  std::string error;
  double waited_s = 0;
  test::run_ranks(
      2,
      [&](const CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, 1, 1);
        grid->split_experts(2);
        Model model = build_on(f, grid->ep(), nullptr, false);
        parallel::StrategyOptions options;
        auto& pipe = options.of<parallel::pipeline::PipelineOptions>();
        pipe.schedule = "dualpipev";
        pipe.virtual_stages = 2;
        parallel::pipeline::PipelineStrategy strategy(options);
        strategy.setup(model, optim::optimizer_factory(f.optimizer), grid);
        int step = 0;
        if (world->rank() == 1) {
          strategy.set_action_observer([&](const parallel::pipeline::Action& a) {
            if (step != 1 || !a.overlapped) return;
            std::unique_lock<std::mutex> lock(mutex);
            hung = true;
            changed.notify_all();
            changed.wait(lock, [&] { return let_go; });
            throw std::runtime_error("rank 1 let go");
          });
        }
        std::vector<data::Batch> micro_batches;
        for (int m = 0; m < 4; ++m) micro_batches.push_back(f.dataset.slice(2 * m, 2 * m + 2));
        for (; step < 2; ++step) {
          const auto start = std::chrono::steady_clock::now();
          try {
            strategy.train_step(micro_batches, parallel::cross_entropy);
          } catch (const std::exception& e) {
            if (world->rank() == 1) return;
            std::lock_guard<std::mutex> lock(mutex);
            error = e.what();
            waited_s =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            let_go = true;
            changed.notify_all();
            return;
          }
        }
      },
      std::chrono::seconds(10));
  EXPECT_TRUE(hung);
  EXPECT_NE(error.find("timed out after 10000 ms"), std::string::npos) << error;
  EXPECT_NE(error.find(" on group '"), std::string::npos) << error;
  EXPECT_LT(waited_s, 60) << error;
}

// A checkpoint written by a pipeline with its experts split resumes under ddp at another expert
// layout, and one written by ddp resumes in the pipeline: one process's values.
TEST(ExpertParallel, PipelineCheckpointsReshardAcrossExpertLayouts) {
  test::Fixture f = test::llama_with_experts();
  const auto two_steps = trained_whole(f, 2);
  const auto three_steps = trained_whole(f, 3);
  test::TempDir piped, flat;
  ExpertRun pipeline;
  pipeline.strategy = "pipeline";
  pipeline.world = 4;
  pipeline.pp = 2;
  pipeline.micro = 2;
  pipeline.steps = 2;
  pipeline.save_to = piped.path();
  ASSERT_LT(expert_parallel_apart(f, pipeline, two_steps), test::kTightBound);
  ExpertRun ddp;
  ddp.world = 4;
  ddp.experts = 4;
  ddp.load_from = piped.path();
  ddp.first_step = 2;
  ddp.steps = 1;
  EXPECT_LT(expert_parallel_apart(f, ddp, three_steps), test::kTightBound) << "pipeline -> ddp";
  test::TempDir sharded;  // a pipeline's zero1: every rank a file of its shards
  ExpertRun zero = pipeline;
  zero.stage_strategy = "zero1";
  zero.save_to = sharded.path();
  ASSERT_LT(expert_parallel_apart(f, zero, two_steps), test::kTightBound);
  ddp.load_from = sharded.path();
  EXPECT_LT(expert_parallel_apart(f, ddp, three_steps), test::kTightBound)
      << "pipeline zero1 -> ddp";
  ExpertRun zero_again = zero;
  zero_again.save_to.clear();
  zero_again.load_from = sharded.path();
  zero_again.first_step = 2;
  zero_again.steps = 1;
  EXPECT_LT(expert_parallel_apart(f, zero_again, three_steps), test::kTightBound)
      << "pipeline zero1 -> pipeline zero1";
  ExpertRun written;
  written.steps = 2;
  written.save_to = flat.path();
  ASSERT_LT(expert_parallel_apart(f, written, two_steps), test::kTightBound);
  ExpertRun resumed = pipeline;
  resumed.save_to.clear();
  resumed.load_from = flat.path();
  resumed.first_step = 2;
  resumed.steps = 1;
  resumed.experts = 1;
  EXPECT_LT(expert_parallel_apart(f, resumed, three_steps), test::kTightBound) << "ddp -> pipeline";
  resumed.experts = 2;
  EXPECT_LT(expert_parallel_apart(f, resumed, three_steps), test::kTightBound)
      << "ddp -> pipeline, --expert-parallel 2";
}

// Tensor parallelism with a mixture of experts (Megatron's expert tensor parallelism of 1): the
// experts are replicated over the TP group (split over the expert group as before). Without
// sequence parallelism every TP rank routes the same tokens alike; with it each its part of the
// sequence, the layer's gradients summed over the TP group as sequence parallelism's norms are.
// DP x TP x EP under ddp, zero1 and zero3, and PP x TP x EP, equal one process; the balance losses
// without sequence parallelism too; a checkpoint written at TP 2 x EP 2 resumes under ddp alone.
TEST(ExpertParallel, TensorParallelWithExpertsIsOneProcessInFloat64) {
  test::Fixture f = test::llama_with_experts();
  const auto whole = trained_whole(f, 3);
  struct Case {
    int world, tp, pp, experts;
    bool sequence_parallel;
    std::string strategy;
  };
  for (const Case& c : std::vector<Case>{{2, 2, 1, 1, false, "ddp"},
                                         {4, 2, 1, 2, false, "ddp"},
                                         {4, 2, 1, 2, true, "ddp"},
                                         {4, 2, 1, 2, true, "zero1"},
                                         {4, 2, 1, 2, false, "zero3"},
                                         {8, 2, 2, 2, false, "pipeline"},
                                         {8, 2, 2, 2, true, "pipeline"},
                                         {8, 2, 2, 2, true, "pipeline zero1"}}) {
    ExpertRun run;
    run.world = c.world;
    run.tp = c.tp;
    run.pp = c.pp;
    run.experts = c.experts;
    run.sequence_parallel = c.sequence_parallel;
    run.strategy = c.strategy == "pipeline zero1" ? "pipeline" : c.strategy;
    run.stage_strategy = c.strategy == "pipeline zero1" ? "zero1" : "ddp";
    run.micro = 2;
    EXPECT_LT(expert_parallel_apart(f, run, whole), test::kTightBound)
        << c.world << " ranks, TP " << c.tp << ", PP " << c.pp << ", --expert-parallel "
        << c.experts << (c.sequence_parallel ? ", sequence-parallel, " : ", ") << c.strategy;
  }
  test::Fixture clipped = test::llama_with_experts();
  const auto whole_clipped = trained_whole(clipped, 3, 0.05);
  ExpertRun clip;
  clip.world = 4;
  clip.tp = 2;
  clip.sequence_parallel = true;
  clip.max_grad_norm = 0.05;
  EXPECT_LT(expert_parallel_apart(clipped, clip, whole_clipped), test::kTightBound) << "clipping";

  test::Fixture balanced = test::llama_with_experts();
  balanced.spec.gpt.moe_aux_loss = 0.05;
  balanced.spec.gpt.moe_z_loss = 0.01;
  const auto oracle = test::trained_in_pieces(balanced, build_on(balanced, nullptr), 3, 2, 2);
  ExpertRun run;
  run.world = 4;
  run.tp = 2;
  run.micro = 2;
  run.model_loss = true;
  EXPECT_LT(expert_parallel_apart(balanced, run, oracle), test::kTightBound) << "balance losses";

  const auto two_steps = trained_whole(f, 2);
  const auto three_steps = trained_whole(f, 3);
  test::TempDir dir;
  ExpertRun written;
  written.world = 4;
  written.tp = 2;
  written.steps = 2;
  written.save_to = dir.path();
  ASSERT_LT(expert_parallel_apart(f, written, two_steps), test::kTightBound);
  ExpertRun resumed;
  resumed.world = 2;
  resumed.experts = 1;
  resumed.load_from = dir.path();
  resumed.first_step = 2;
  resumed.steps = 1;
  EXPECT_LT(expert_parallel_apart(f, resumed, three_steps), test::kTightBound) << "resumed";
}

// A checkpoint written with the experts split over 2 ranks resumes at --expert-parallel 2, at 4
// over 4 ranks, and without expert parallelism: the values are one process's after two steps,
// and a third step (Adam's moments and count restored) is one process's third.
TEST(ExpertParallel, CheckpointsReshardAcrossExpertLayouts) {
  test::Fixture f = test::llama_with_experts();
  const auto two_steps = trained_whole(f, 2);
  const auto three_steps = trained_whole(f, 3);
  test::TempDir dir;
  ExpertRun first;
  first.steps = 2;
  first.save_to = dir.path();
  ASSERT_LT(expert_parallel_apart(f, first, two_steps), test::kTightBound);
  // Written by zero1 over 4 ranks (every rank a file of its shards), read at P = 2 by ddp.
  test::TempDir sharded;
  ExpertRun zero;
  zero.world = 4;
  zero.strategy = "zero1";
  zero.steps = 2;
  zero.save_to = sharded.path();
  ASSERT_LT(expert_parallel_apart(f, zero, two_steps), test::kTightBound);
  ExpertRun from_zero;
  from_zero.load_from = sharded.path();
  from_zero.first_step = 2;
  from_zero.steps = 1;
  EXPECT_LT(expert_parallel_apart(f, from_zero, three_steps), test::kTightBound) << "from zero1";
  // Written by zero3 over 4 ranks at P = 2 (every rank a file of its dense shard and its shard of
  // its experts), read by ddp at P = 2 and by zero3 without expert parallelism; and zero3 at P = 2
  // reading ddp's.
  test::TempDir zero3_dir;
  ExpertRun zero3 = zero;
  zero3.strategy = "zero3";
  zero3.save_to = zero3_dir.path();
  ASSERT_LT(expert_parallel_apart(f, zero3, two_steps), test::kTightBound);
  from_zero.load_from = zero3_dir.path();
  EXPECT_LT(expert_parallel_apart(f, from_zero, three_steps), test::kTightBound) << "from zero3";
  ExpertRun zero3_whole = from_zero;
  zero3_whole.strategy = "zero3";
  zero3_whole.experts = 1;
  EXPECT_LT(expert_parallel_apart(f, zero3_whole, three_steps), test::kTightBound)
      << "from zero3 to zero3 without expert parallelism";
  ExpertRun zero3_from_ddp = from_zero;
  zero3_from_ddp.strategy = "zero3";
  zero3_from_ddp.world = 4;
  zero3_from_ddp.load_from = dir.path();
  EXPECT_LT(expert_parallel_apart(f, zero3_from_ddp, three_steps), test::kTightBound)
      << "zero3 at P = 2 over 4 ranks from ddp's";
  for (const auto& [world, experts] : std::vector<std::pair<int, int>>{{2, 2}, {4, 4}, {2, 1}}) {
    ExpertRun again;
    again.world = world;
    again.experts = experts;
    again.load_from = dir.path();
    again.steps = 0;
    EXPECT_LT(expert_parallel_apart(f, again, two_steps), test::kTightBound)
        << "loaded at " << world << " ranks, --expert-parallel " << experts;
    again.first_step = 2;
    again.steps = 1;
    EXPECT_LT(expert_parallel_apart(f, again, three_steps), test::kTightBound)
        << "resumed at " << world << " ranks, --expert-parallel " << experts;
  }
}

// After a step: each layer's loads over the step's training forwards (two micro-batches here;
// an evaluation forward does not count) summed over the data-parallel ranks, its max / mean in
// the metrics, and the auxiliary-loss-free bias moved by the rate towards the experts chosen
// least, the same on every rank.
TEST(ExpertParallel, TheStepsLoadIsSummedOverRanksAndMovesTheBiasAlike) {
  nn::MoeOptions o = options_for(4, 0, "softmax");
  o.top_k = 1;
  std::vector<at::Tensor> biases(2);
  std::vector<std::map<std::string, double>> metrics(2);
  std::vector<std::vector<int64_t>> loads(2, std::vector<int64_t>(4, 0));
  test::run_ranks(2, [&](const CommunicatorPtr& world) {
    const int r = world->rank();
    auto root = std::make_shared<torch::nn::Module>();
    nn::Moe moe = make_moe(o);
    {
      torch::NoGradGuard no_grad;
      moe->router.select(0, 0).add_(0.5);  // skewed towards expert 0
    }
    root->register_module("moe", moe.ptr());
    auto balance = train::ExpertBalance::find(*root, world, 0.25);
    ASSERT_TRUE(balance);
    for (int micro = 0; micro < 2; ++micro) {
      moe(tokens_of(r, o.width, 10 + micro));
      for (int64_t e = 0; e < 4; ++e) loads[r][e] += moe->stats().load[e];
    }
    {
      torch::NoGradGuard evaluation;
      moe(tokens_of(r, o.width, 20));
    }
    balance->after_step(metrics[r]);
    biases[r] = moe->expert_bias.clone();
  });
  std::vector<int64_t> total(4);
  for (int64_t e = 0; e < 4; ++e) total[e] = loads[0][e] + loads[1][e];
  EXPECT_EQ(metrics[0].at("moe_imbalance.moe"), nn::load_imbalance(total));
  EXPECT_GT(metrics[0].at("moe_imbalance"), 1.0);
  EXPECT_EQ(metrics[0], metrics[1]);
  EXPECT_EQ(metrics[0].at("moe_dropped"), 0.0);
  double mean = 0;
  for (int64_t l : total) mean += static_cast<double>(l) / 4;
  for (int64_t e = 0; e < 4; ++e) {
    const double expected = total[e] < mean ? 0.25 : total[e] > mean ? -0.25 : 0.0;
    EXPECT_DOUBLE_EQ(biases[0][e].item<double>(), expected) << e;
  }
  EXPECT_TRUE(at::equal(biases[0], biases[1]));
}
