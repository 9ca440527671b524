// Context parallelism (issue 82): the sequence split over C ranks, causal attention by
// all-gather, ring and Ulysses against one process's attention over the whole sequence in
// float64 (outputs and the gradients of every rank's queries, keys and values), for contiguous
// and zigzag splits at C = 2 and 4; the block-and-merge arithmetic against plain masked softmax
// attention. Then the decoders (gpt's learned positions, llama's rotary ones) split over a
// context group, and trained by ddp, ZeRO-1/2/3, tensor parallelism and pipelines with it,
// against one process on the global batch; checkpoints across context layouts.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "Oracle.h"
#include "RankThreads.h"
#include "TempDir.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/nn/context/Attention.h"
#include "dtrain/nn/tensor/Layers.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/zero/Zero3Strategy.h"
#include "parallel/zero/ZeroStrategy.h"

using namespace dtrain;
using comm::CommunicatorPtr;
namespace cp = dtrain::nn::context;

namespace {

// Causal softmax attention written out: scores, -inf above the diagonal, softmax, values.
at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t t = q.size(2);
  at::Tensor scores =
      at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  scores = scores.masked_fill(at::ones({t, t}, at::kBool).triu(1),
                              -std::numeric_limits<double>::infinity());
  return at::matmul(scores.softmax(-1), v);
}

struct Whole {
  at::Tensor q, k, v, upstream, out, dq, dk, dv;
};

// q [2, heads, tokens, 8]; k and v with `kv_heads` heads (grouped-query: each serving
// heads / kv_heads consecutive query heads), 0: `heads`.
Whole whole_sequence(int64_t heads, int64_t tokens, int64_t kv_heads = 0) {
  if (kv_heads == 0) kv_heads = heads;
  at::Generator g = at::detail::createCPUGenerator(7);
  Whole w;
  auto draw = [&](int64_t h) { return at::randn({2, h, tokens, 8}, g, at::kDouble); };
  w.q = draw(heads), w.k = draw(kv_heads), w.v = draw(kv_heads), w.upstream = draw(heads);
  const at::Tensor q = w.q.clone().requires_grad_(true), k = w.k.clone().requires_grad_(true),
                   v = w.v.clone().requires_grad_(true);
  auto expand = [&](const at::Tensor& x) {
    return x.unsqueeze(2)
        .expand({2, kv_heads, heads / kv_heads, tokens, 8})
        .reshape({2, heads, tokens, 8});
  };
  w.out = plain_attention(q, expand(k), expand(v));
  w.out.backward(w.upstream);
  w.dq = q.grad(), w.dk = k.grad(), w.dv = v.grad();
  w.out = w.out.detach();
  return w;
}

double apart(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// The largest difference over ranks of outputs and gradients from the whole sequence's.
double context_apart(const Whole& w, int ranks, bool zigzag, const std::string& method) {
  std::vector<double> most(ranks, 0.0);
  test::run_ranks(
      ranks,
      [&](const comm::CommunicatorPtr& group) {
        const at::Tensor positions = cp::split_positions(w.q.size(2), ranks, group->rank(), zigzag);
        auto mine = [&](const at::Tensor& x) { return x.index_select(2, positions); };
        const at::Tensor q = mine(w.q).requires_grad_(true), k = mine(w.k).requires_grad_(true),
                         v = mine(w.v).requires_grad_(true);
        const at::Tensor out = cp::causal_attention(q, k, v, positions, group, method);
        out.backward(mine(w.upstream));
        most[group->rank()] = std::max({apart(out, mine(w.out)), apart(q.grad(), mine(w.dq)),
                                        apart(k.grad(), mine(w.dk)), apart(v.grad(), mine(w.dv))});
      },
      std::chrono::seconds(60));
  return *std::max_element(most.begin(), most.end());
}

}  // namespace

// The block arithmetic: the whole sequence as one block equals plain attention; cut into key
// blocks in any order and merged by log-sum-exp, the same; a query that sees none of a block's
// keys (the zigzag's later chunks) contributes nothing.
TEST(ContextParallel, BlocksMergedByLogSumExpAreAttention) {
  const Whole w = whole_sequence(2, 12);
  const at::Tensor all = at::arange(12, at::kLong);
  EXPECT_LT(apart(cp::block_attention(w.q, w.k, w.v, all, all).out, w.out), 1e-12);
  const at::Tensor late = at::arange(8, 12, at::kLong), early = at::arange(0, 8, at::kLong);
  cp::Partial merged = cp::merge(
      cp::block_attention(w.q, w.k.index_select(2, late), w.v.index_select(2, late), all, late),
      cp::block_attention(w.q, w.k.index_select(2, early), w.v.index_select(2, early), all, early));
  EXPECT_LT(apart(merged.out, w.out), 1e-12);
  EXPECT_TRUE(at::isfinite(merged.out).all().item<bool>());
}

// Every method over 2 and 4 ranks, contiguous and zigzag: one process's outputs and gradients
// within 1e-12.
TEST(ContextParallel, AllGatherRingAndUlyssesAreOneProcessInFloat64) {
  const Whole w = whole_sequence(4, 16);
  for (const std::string method : {"allgather", "ring", "ulysses"}) {
    for (int ranks : {2, 4}) {
      for (bool zigzag : {false, true}) {
        EXPECT_LT(context_apart(w, ranks, zigzag, method), 1e-12)
            << method << ", " << ranks << " ranks" << (zigzag ? ", zigzag" : "");
      }
    }
  }
}

// Grouped-query attention's key/value heads given as they are (4 query heads, 2 key/value
// heads: the ring and the all-gather send half the bytes): every method equals one process over
// the expanded heads, the key/value gradients summed over each group, within 1e-12.
TEST(ContextParallel, GroupedQueryKeysAndValuesTravelUnexpanded) {
  const Whole w = whole_sequence(4, 16, 2);
  for (const std::string method : {"allgather", "ring", "ulysses"}) {
    for (int ranks : {2, 4}) {
      EXPECT_LT(context_apart(w, ranks, /*zigzag=*/true, method), 1e-12)
          << method << ", " << ranks << " ranks";
    }
  }
}

// Attention dropout drawn as FlashAttention draws it (a hash of the seed and each weight's batch
// row, head, query and key position): every method over 2 and 4 ranks, contiguous and zigzag,
// with grouped-query heads, keeps the very weights one process keeps, its outputs and gradients
// (the ring's written-out backward regenerating the mask) within 1e-12. The mask keeps 1 - p of
// the weights, changes with the seed, and changes the output.
TEST(ContextParallel, AttentionDropoutKeepsOneProcesssWeightsOnEveryRank) {
  cp::Dropout drop;
  drop.p = 0.3;
  drop.seed = 0x1234567890abLL;
  const int64_t tokens = 16;
  const at::Tensor all = at::arange(tokens, at::kLong);
  for (int64_t kv_heads : {4, 2}) {
    const Whole w = whole_sequence(4, tokens, kv_heads);
    const at::Tensor q = w.q.clone().requires_grad_(true), k = w.k.clone().requires_grad_(true),
                     v = w.v.clone().requires_grad_(true);
    const at::Tensor out = cp::causal_attention(q, k, v, all, nullptr, "ring", {}, drop);
    EXPECT_GT(apart(out, cp::causal_attention(w.q, w.k, w.v, all, nullptr, "ring")), 1e-3);
    out.backward(w.upstream);
    for (const std::string method : {"allgather", "ring", "ulysses"}) {
      for (int ranks : {2, 4}) {
        for (bool zigzag : {false, true}) {
          std::vector<double> most(ranks, 0.0);
          test::run_ranks(
              ranks,
              [&](const comm::CommunicatorPtr& group) {
                const at::Tensor positions =
                    cp::split_positions(tokens, ranks, group->rank(), zigzag);
                auto mine = [&](const at::Tensor& x) { return x.index_select(2, positions); };
                const at::Tensor mq = mine(w.q).requires_grad_(true),
                                 mk = mine(w.k).requires_grad_(true),
                                 mv = mine(w.v).requires_grad_(true);
                const at::Tensor mout =
                    cp::causal_attention(mq, mk, mv, positions, group, method, {}, drop);
                mout.backward(mine(w.upstream));
                most[group->rank()] =
                    std::max({apart(mout, mine(out)), apart(mq.grad(), mine(q.grad())),
                              apart(mk.grad(), mine(k.grad())), apart(mv.grad(), mine(v.grad()))});
              },
              std::chrono::seconds(60));
          EXPECT_LT(*std::max_element(most.begin(), most.end()), 1e-12)
              << method << ", " << ranks << " ranks" << (zigzag ? ", zigzag" : "") << ", "
              << kv_heads << " key/value heads";
        }
      }
    }
  }
  const at::Tensor wide = at::arange(512, at::kLong);
  const at::Tensor scale = cp::dropout_scale(drop, 2, 4, wide, wide, at::kDouble);
  const double kept = scale.gt(0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.7, 0.005);
  EXPECT_NEAR(scale.max().item<double>(), 1 / 0.7, 1e-12);
  cp::Dropout other = drop;
  other.seed += 1;
  const at::Tensor same =
      scale.gt(0).eq(cp::dropout_scale(other, 2, 4, wide, wide, at::kDouble).gt(0));
  EXPECT_NEAR(same.to(at::kDouble).mean().item<double>(), 0.7 * 0.7 + 0.3 * 0.3, 0.01);
}

// What cannot split is named: a sequence the chunks do not divide, heads Ulysses cannot share
// out, an unknown method.
TEST(ContextParallel, SplitsThatCannotWorkAreNamed) {
  try {
    cp::split_positions(12, 4, 0, true);
    ADD_FAILURE() << "12 tokens in 8 zigzag chunks were accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("needs a sequence that 8 divides, got 12 tokens"), std::string::npos)
        << e.message();
  }
  const Whole w = whole_sequence(2, 16);
  test::run_ranks(4, [&](const comm::CommunicatorPtr& group) {
    const at::Tensor positions = cp::split_positions(16, 4, group->rank(), false);
    const at::Tensor q = w.q.index_select(2, positions);
    try {
      cp::causal_attention(q, q, q, positions, group, "ulysses");
      ADD_FAILURE() << "2 heads over 4 ranks were accepted";
    } catch (const InputError& e) {
      EXPECT_NE(e.message().find("splits the 2 attention heads over 4 ranks"), std::string::npos)
          << e.message();
    }
    EXPECT_THROW(cp::causal_attention(q, q, q, positions, group, "striped"), InputError);
  });
}

namespace {

// A small decoder on random tokens in float64 (windows of 8: zigzag over 4 ranks), trained with
// Adam, or SGD with momentum, which carries a difference in the gradients into the weights
// without amplifying it (Adam divides by the root of tiny second moments: plain data
// parallelism over 4 ranks is 2e-12 from one process after 3 of its steps on gpt).
test::Fixture decoder(const std::string& name, bool sgd = false) {
  test::Fixture f;
  f.spec.name = name;
  models::GptConfig& c = f.spec.gpt;
  c.vocab = 13;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = name == "llama" ? 2 : 0;
  c.width = 16;
  c.context = 8;
  f.optimizer = test::adam();
  if (sgd) {
    f.optimizer.name = "sgd";
    f.optimizer.lr = 0.5;
    f.optimizer.momentum = 0.9;
  }
  f.global_batch = 8;
  at::Generator generator = at::detail::createCPUGenerator(5);
  const at::Tensor tokens = at::randint(13, {f.global_batch * 3 + 8}, generator, at::kLong);
  f.dataset = data::TensorDataset::windows(tokens, 8, 1);
  torch::manual_seed(11);
  f.initial = test::snapshot(test::make_model_as(f.spec, f.dtype));
  return f;
}

// The same model on every rank (its seed drawn from the global generator, which rank threads
// share): built one rank at a time.
Model build_on(const models::ModelSpec& base, const comm::CommunicatorPtr& context,
               const comm::CommunicatorPtr& tensor_parallel = nullptr) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  models::ModelSpec spec = base;
  spec.context_parallel = context;
  torch::manual_seed(11);
  Model model = models::make_model(spec, tensor_parallel);
  model.module->to(at::kDouble);
  return model;
}

std::map<std::string, at::Tensor> named(const Model& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.module->named_parameters()) out[item.key()] = item.value();
  return out;
}

// One process's loss and gradients on a batch, and the largest difference from them of the
// mean of `ranks` context-parallel ranks' losses and of their gradients averaged (as data
// parallelism averages them).
double decoder_apart(const test::Fixture& f, int ranks, const std::string& method, bool zigzag,
                     const std::string& checkpointing = "none", int64_t document_end = -1,
                     double dropout = 0) {
  models::ModelSpec spec = f.spec;
  spec.gpt.dropout = dropout;
  spec.gpt.document_end = document_end;
  spec.checkpointing = checkpointing;
  spec.gpt.cp_method = method;
  spec.gpt.cp_zigzag = zigzag;
  const data::Batch batch = f.dataset.slice(0, 4);
  Model whole = build_on(spec, nullptr);
  const at::Tensor whole_logits = whole(batch.inputs);
  // (The model's loss where it has one: a mixture of experts' adds its balance losses.)
  const at::Tensor expected_loss = whole.loss
                                       ? whole.loss(whole_logits, batch.targets)
                                       : parallel::cross_entropy(whole_logits, batch.targets);
  expected_loss.backward();
  std::map<std::string, at::Tensor> expected;
  for (const auto& item : whole.module->named_parameters())
    expected[item.key()] = item.value().grad();
  // (Once, here: the rank threads may not share a forward of one model, a mixture of experts
  // keeps what it routed.)
  const at::Tensor whole_predicted = whole_logits.argmax(-1);
  std::vector<double> most(ranks, 0.0);
  test::run_ranks(
      ranks,
      [&](const comm::CommunicatorPtr& group) {
        Model model = build_on(spec, group);
        const at::Tensor logits = model(batch.inputs);
        EXPECT_EQ(logits.size(1), batch.inputs.size(1) / ranks);
        const at::Tensor loss = model.loss(logits, batch.targets);
        loss.backward();
        at::Tensor mean = loss.detach().clone();
        group->allreduce(mean)->wait();
        double worst = std::abs(mean.item<double>() / ranks - expected_loss.item<double>());
        for (const auto& item : model.module->named_parameters()) {
          at::Tensor grad = item.value().grad().clone();
          group->allreduce(grad)->wait();
          worst =
              std::max(worst, (grad / ranks - expected.at(item.key())).abs().max().item<double>());
        }
        // The predictions of the whole sequence, every rank's in its place.
        const at::Tensor predicted = model.predict(logits);
        EXPECT_TRUE(predicted.equal(whole_predicted));
        most[group->rank()] = worst;
      },
      std::chrono::seconds(60));
  return *std::max_element(most.begin(), most.end());
}

}  // namespace

// The decoders split over 2 and 4 ranks, by each method and split, with selective recomputation
// and packed documents (token 12 ends one: about one in 13 of the random tokens) too: the mean of
// the ranks' losses is one process's loss on the whole sequences, their gradients averaged its
// gradients, within 1e-12 (gpt's learned position embeddings and llama's rotary ones at the global
// positions, llama's grouped-query heads), and the predictions are the whole sequence's.
TEST(ContextParallel, TheDecodersSplitOverAContextGroupAreOneProcessInFloat64) {
  for (const std::string name : {"llama", "gpt"}) {
    const test::Fixture f = decoder(name);
    for (const std::string method : {"ring", "allgather", "ulysses"}) {
      for (int ranks : {2, 4}) {
        for (bool zigzag : {true, false}) {
          EXPECT_LT(decoder_apart(f, ranks, method, zigzag), 1e-12)
              << name << ", " << method << ", " << ranks << " ranks" << (zigzag ? ", zigzag" : "");
        }
      }
    }
    EXPECT_LT(decoder_apart(f, 2, "ring", true, "selective"), 1e-12) << name << ", selective";
    for (const std::string method : {"ring", "allgather", "ulysses"}) {
      EXPECT_LT(decoder_apart(f, 4, method, true, "none", 12), 1e-12)
          << name << ", packed, " << method;
      // Dropout (attention's weights and the activations', each rank drawing the masks of the
      // whole sequence's), packed too, and with the core recomputed.
      EXPECT_LT(decoder_apart(f, 4, method, true, "none", -1, 0.2), 1e-12)
          << name << ", dropout, " << method;
    }
    EXPECT_LT(decoder_apart(f, 2, "ring", false, "none", 12, 0.2), 1e-12)
        << name << ", packed, dropout";
    EXPECT_LT(decoder_apart(f, 2, "ring", true, "selective", -1, 0.2), 1e-12)
        << name << ", selective, dropout";
  }
}

// Packed sequences (--reset-attention-mask): documents packed into one window see only
// themselves, their positions restarting after each end-of-document token: the logits of each
// document in the window equal those of the document alone, for gpt's learned positions and
// llama's rotary ones, split over 2 context-parallel ranks too; without the mask the later
// documents' logits change (attention across a boundary changes what the model sees), and so
// does the loss.
TEST(ContextParallel, PackedDocumentsSeeOnlyThemselves) {
  for (const std::string name : {"llama", "gpt"}) {
    test::Fixture f = decoder(name);
    f.spec.gpt.context = 16;
    const int64_t end = 12;
    // Documents of 5, 6 and 5 tokens (the first two ended by the token), and one of 16.
    at::Generator generator = at::detail::createCPUGenerator(9);
    at::Tensor ids = at::randint(12, {2, 16}, generator, at::kLong);
    ids[0][4] = end;
    ids[0][10] = end;
    const std::vector<std::pair<int64_t, int64_t>> documents{{0, 5}, {5, 6}, {11, 5}};
    models::ModelSpec packed = f.spec;
    packed.gpt.document_end = end;
    const Model model = build_on(packed, nullptr);
    const Model plain = build_on(f.spec, nullptr);
    const at::Tensor logits = model(ids);
    const at::Tensor unmasked = plain(ids);
    for (const auto& [begin, length] : documents) {
      const at::Tensor alone = plain(ids.narrow(0, 0, 1).narrow(1, begin, length));
      EXPECT_LT(
          (logits.narrow(0, 0, 1).narrow(1, begin, length) - alone).abs().max().item<double>(),
          1e-12)
          << name << ", document at " << begin;
      if (begin > 0) {
        EXPECT_GT(
            (unmasked.narrow(0, 0, 1).narrow(1, begin, length) - alone).abs().max().item<double>(),
            1e-3)
            << name << ": without the mask the document at " << begin << " sees the ones before";
      }
    }
    // A window without the token is one document: the same as without the mask.
    EXPECT_LT((logits[1] - unmasked[1]).abs().max().item<double>(), 1e-12) << name;
    const at::Tensor targets = at::randint(13, {2, 16}, generator, at::kLong);
    EXPECT_GT(std::abs(parallel::cross_entropy(logits, targets).item<double>() -
                       parallel::cross_entropy(unmasked, targets).item<double>()),
              1e-4)
        << name;
    // Split over a context group: each rank's logits are its positions' of the packed model's.
    test::run_ranks(2, [&](const comm::CommunicatorPtr& group) {
      models::ModelSpec spec = packed;
      Model split = build_on(spec, group);
      const at::Tensor positions = nn::context::split_positions(16, 2, group->rank(), true);
      EXPECT_LT((split(ids) - logits.index_select(1, positions)).abs().max().item<double>(), 1e-12)
          << name << ", rank " << group->rank();
    });
  }
}

// Where the end-of-document token is found: each document's index (the token belongs to the
// document it ends) and its positions restarting after it.
TEST(ContextParallel, DocumentIndexAndPositionsRestartAfterEachEnd) {
  const at::Tensor ids = at::tensor({5, 7, 0, 3, 0, 0, 4, 1}, at::kLong).view({1, 8});
  const nn::context::Documents d = nn::context::document_index(ids, 0);
  EXPECT_TRUE(d.index.equal(at::tensor({0, 0, 0, 1, 1, 2, 3, 3}, at::kLong).view({1, 8})))
      << d.index;
  EXPECT_TRUE(d.positions.equal(at::tensor({0, 1, 2, 0, 1, 0, 0, 1}, at::kLong).view({1, 8})))
      << d.positions;
}

namespace {

struct ContextRun {
  int world = 2;
  int context = 2;  // --context-parallel
  std::string method = "ring";
  bool zigzag = true;
  int steps = 3;
  int first_step = 0;
  int micro = 1;
  double max_grad_norm = 0;
  std::string strategy = "ddp";  // zero1, zero2, zero3 or pipeline
  int pp = 1;
  int tp = 1;
  bool sequence_parallel = false;
  std::string stage_strategy = "ddp";
  std::string schedule = "1f1b";  // a pipeline's
  int chunks = 1;
  std::string save_to, load_from;
};

// Trains `run` and returns the largest difference over ranks and parameters from `whole` (one
// process's values by name; a tensor-parallel rank's blocks of them).
double context_parallel_apart(const test::Fixture& f, const ContextRun& run,
                              const std::map<std::string, at::Tensor>& whole) {
  std::vector<double> most(run.world, 0.0);
  models::ModelSpec spec = f.spec;
  spec.gpt.cp_method = run.method;
  spec.gpt.cp_zigzag = run.zigzag;
  spec.gpt.sequence_parallel = run.sequence_parallel;
  test::run_ranks(
      run.world,
      [&](const CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, run.tp, run.pp);
        grid->split_context(run.context);
        EXPECT_EQ(grid->cp_size(), run.context);
        Model model = build_on(spec, grid->cp(), grid->tp());
        parallel::StrategyOptions options;
        options.max_grad_norm = run.max_grad_norm;
        std::unique_ptr<parallel::Strategy> made;
        if (run.strategy == "ddp") {
          made = std::make_unique<parallel::ddp::DdpStrategy>(options);
        } else if (run.strategy == "zero3") {
          made = std::make_unique<parallel::zero::Zero3Strategy>(options);
        } else if (run.strategy == "pipeline") {
          auto& pipe = options.of<parallel::pipeline::PipelineOptions>();
          pipe.schedule = run.schedule;
          pipe.virtual_stages = run.chunks;
          pipe.data_parallel = run.stage_strategy;
          made = std::make_unique<parallel::pipeline::PipelineStrategy>(options);
        } else {
          made = std::make_unique<parallel::zero::ZeroStrategy>(options,
                                                                run.strategy == "zero1" ? 1 : 2);
        }
        parallel::Strategy& strategy = *made;
        const parallel::LossFn loss =
            model.loss ? parallel::LossFn(model.loss) : parallel::LossFn(parallel::cross_entropy);
        strategy.setup(model, optim::optimizer_factory(f.optimizer), grid);
        if (!run.load_from.empty()) strategy.load(run.load_from);
        // The context group's ranks read the same examples.
        const int shares = grid->data_parallel_size();
        auto order = data::DistributedSampler(f.dataset.size(), shares, grid->data_parallel_rank(),
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
        strategy.materialize();  // ZeRO-3: the whole parameters
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
        const auto splits = nn::tensor::parameter_splits(*strategy.model().module);
        for (const auto& [name, value] : trained) {
          at::Tensor expected = whole.at(name);
          const auto split = splits.find(name);
          if (split != splits.end()) {
            expected =
                expected.narrow(split->second.dim, split->second.start, split->second.length);
          }
          most[world->rank()] =
              std::max(most[world->rank()], (value - expected).abs().max().item<double>());
        }
      },
      std::chrono::seconds(90));
  return *std::max_element(most.begin(), most.end());
}

std::map<std::string, at::Tensor> trained_whole(const test::Fixture& f, int steps,
                                                double max_grad_norm = 0) {
  Model model = build_on(f.spec, nullptr);
  torch::manual_seed(11);  // the seeds of its dropout as build_on's (the values are f.initial)
  const auto values = test::train_single(f, steps, max_grad_norm);
  std::map<std::string, at::Tensor> out;
  size_t i = 0;
  for (const auto& item : model.module->named_parameters()) out[item.key()] = values[i++];
  return out;
}

}  // namespace

// Context parallelism folded into data parallelism (Megatron's rule for the weights): the
// context group's ranks read the same examples, each its share of every sequence's positions,
// and the gradients are averaged over data-parallel x context ranks. ddp, ZeRO-1, 2 and 3, with
// accumulation and clipping, tensor parallelism with and without sequence parallelism, and
// pipelines (stages data-parallel by ddp and zero1) each equal one process on the global batch
// within 1e-12 after 3 Adam steps, every method among them.
TEST(ContextParallel, TrainingWithAContextGroupIsOneProcessInFloat64) {
  const test::Fixture llama = decoder("llama", true);
  const auto whole = trained_whole(llama, 3);
  {
    const Model initial = build_on(llama.spec, nullptr);
    EXPECT_GT((named(initial).at("blocks.0.q.weight") - whole.at("blocks.0.q.weight"))
                  .abs()
                  .max()
                  .item<double>(),
              1e-4);  // it trained
  }
  struct Case {
    int world, context, tp, pp;
    std::string strategy, method;
    bool sequence_parallel;
    int micro;
  };
  auto run_of = [](const Case& c) {
    ContextRun run;
    run.world = c.world;
    run.context = c.context;
    run.tp = c.tp;
    run.pp = c.pp;
    run.method = c.method;
    run.sequence_parallel = c.sequence_parallel;
    run.strategy = c.strategy == "pipeline zero1" ? "pipeline" : c.strategy;
    run.stage_strategy = c.strategy == "pipeline zero1" ? "zero1" : "ddp";
    run.micro = c.micro;
    return run;
  };
  auto said = [](const Case& c) {
    return concat(c.world, " ranks, CP ", c.context, " (", c.method, "), TP ", c.tp,
                  c.sequence_parallel ? " (SP)" : "", ", PP ", c.pp, ", ", c.strategy, ", ",
                  c.micro, " micro-batches");
  };
  for (const Case& c : std::vector<Case>{{2, 2, 1, 1, "ddp", "ring", false, 1},
                                         {4, 2, 1, 1, "ddp", "allgather", false, 2},
                                         {4, 4, 1, 1, "ddp", "ulysses", false, 1},
                                         {4, 2, 1, 1, "zero1", "ring", false, 2},
                                         {4, 4, 1, 1, "zero2", "allgather", false, 1},
                                         {4, 2, 1, 1, "zero3", "ring", false, 1},
                                         {4, 2, 1, 1, "zero3", "ulysses", false, 2},
                                         {4, 2, 2, 1, "ddp", "ring", false, 1},
                                         {4, 2, 2, 1, "ddp", "ulysses", true, 1},
                                         {8, 2, 2, 1, "zero1", "allgather", true, 2},
                                         {4, 2, 1, 2, "pipeline", "ring", false, 2},
                                         {8, 2, 1, 2, "pipeline zero1", "allgather", false, 2},
                                         {8, 2, 2, 2, "pipeline", "ring", true, 2}}) {
    EXPECT_LT(context_parallel_apart(llama, run_of(c), whole), 1e-12) << said(c);
  }
  // DualPipe-V (one pipeline rank holding both chunks of the V; CP 2, and CP 2 x PP 2): a pair's
  // backward thread passes the ring's keys and values on the context group's second lane.
  for (const int pp : {1, 2}) {
    ContextRun dual = run_of({2 * pp, 2, 1, pp, "pipeline", "ring", false, 4});
    dual.schedule = "dualpipev";
    dual.chunks = 2;
    EXPECT_LT(context_parallel_apart(llama, dual, whole), 1e-12) << "dualpipev, CP 2, PP " << pp;
  }
  const auto whole_clipped = trained_whole(llama, 3, 0.05);
  for (const std::string strategy : {"ddp", "zero1"}) {
    ContextRun clip;
    clip.world = 4;
    clip.strategy = strategy;
    clip.max_grad_norm = 0.05;
    EXPECT_LT(context_parallel_apart(llama, clip, whole_clipped), 1e-12)
        << "clipping, " << strategy;
  }
  // Packed documents (token 12 ends one): ddp, zero3 and TP x SP, each split over its ranks,
  // and pipelines, whose second stage learns the documents from the micro-batch's tokens: with
  // and without CP, and with the blocks recomputed in backward (1F1B runs the next micro-batch's
  // forward first: the recomputation must see its own micro-batch's documents again).
  test::Fixture packed = decoder("llama", true);
  packed.spec.gpt.document_end = 12;
  torch::manual_seed(11);
  packed.initial = test::snapshot(test::make_model_as(packed.spec, packed.dtype));
  // How far a run's query weights end from the plain run's.
  auto moved = [&](const std::map<std::string, at::Tensor>& other) {
    return (other.at("blocks.0.q.weight") - whole.at("blocks.0.q.weight"))
        .abs()
        .max()
        .item<double>();
  };
  const auto whole_packed = trained_whole(packed, 3);
  EXPECT_GT(moved(whole_packed), 1e-6);  // the mask changed the training
  for (const Case& c : std::vector<Case>{{4, 2, 1, 1, "ddp", "ring", false, 1},
                                         {4, 2, 1, 1, "zero3", "allgather", false, 2},
                                         {4, 2, 2, 1, "ddp", "ulysses", true, 1},
                                         {2, 1, 1, 2, "pipeline", "ring", false, 2},
                                         {4, 2, 1, 2, "pipeline", "allgather", false, 2}}) {
    EXPECT_LT(context_parallel_apart(packed, run_of(c), whole_packed), 1e-12)
        << "packed, " << said(c);
  }
  test::Fixture recomputed = packed;
  recomputed.spec.checkpointing = "2";
  EXPECT_LT(context_parallel_apart(recomputed, run_of({2, 1, 1, 2, "pipeline", "ring", false, 2}),
                                   whole_packed),
            1e-12)
      << "packed, recomputed, pipeline";
  // Dropout: every rank of a context group draws the masks one process draws (one group: the
  // data-parallel ranks' masks are their own samples', not one process's).
  test::Fixture dropped = decoder("llama", true);
  dropped.spec.gpt.dropout = 0.1;
  const auto whole_dropped = trained_whole(dropped, 3);
  EXPECT_GT(moved(whole_dropped), 1e-6);  // the masks changed the training
  for (const Case& c : std::vector<Case>{{2, 2, 1, 1, "ddp", "ring", false, 1},
                                         {4, 4, 1, 1, "zero1", "ulysses", false, 1}}) {
    EXPECT_LT(context_parallel_apart(dropped, run_of(c), whole_dropped), 1e-12)
        << "dropout, " << said(c);
  }
  const test::Fixture gpt = decoder("gpt", true);
  ContextRun learned;
  learned.world = 4;
  learned.context = 4;
  learned.zigzag = false;
  EXPECT_LT(context_parallel_apart(gpt, learned, trained_whole(gpt, 3)), 1e-12) << "gpt";
}

// A mixture of experts' balance losses over a split sequence: each rank's auxiliary loss counts
// the assignments of every part of the sequences (f_e allreduced over the context group), its
// P_e and z-loss are its part's means, so the ranks' mean is the whole sequences' loss. The loss
// and gradients of one forward (2 and 4 ranks, every method), then training under ddp with
// accumulation, zero1, TP x CP and a pipeline (the layers' losses taken in their backward): one
// process adding each micro-batch's balance losses, within 1e-12.
TEST(ContextParallel, BalanceLossesSeeTheWholeSequences) {
  test::Fixture f = decoder("llama", true);
  models::GptConfig& c = f.spec.gpt;
  c.moe_experts = 4;
  c.moe_top_k = 2;
  c.moe_ffn_width = 8;
  c.moe_aux_loss = 0.05;
  c.moe_z_loss = 0.01;
  for (const auto& [ranks, method] : std::vector<std::pair<int, std::string>>{
           {2, "ring"}, {2, "allgather"}, {4, "ring"}, {4, "ulysses"}}) {
    EXPECT_LT(decoder_apart(f, ranks, method, true), 1e-12) << ranks << " ranks, " << method;
  }
  test::Fixture unbalanced = f;
  unbalanced.spec.gpt.moe_aux_loss = unbalanced.spec.gpt.moe_z_loss = 0;
  struct Case {
    int world, context, tp, pp;
    std::string strategy, method;
    int micro;
  };
  for (const Case& k : std::vector<Case>{{2, 2, 1, 1, "ddp", "ring", 1},
                                         {4, 2, 1, 1, "ddp", "allgather", 2},
                                         {4, 4, 1, 1, "zero1", "ring", 1},
                                         {4, 2, 2, 1, "ddp", "ring", 1},
                                         {4, 2, 1, 2, "pipeline", "ring", 2}}) {
    const int shares = k.world / (k.context * k.tp * k.pp);
    const auto oracle = test::trained_in_pieces(f, build_on(f.spec, nullptr), 3, shares, k.micro);
    const auto without =
        test::trained_in_pieces(unbalanced, build_on(unbalanced.spec, nullptr), 3, shares, k.micro);
    EXPECT_GT((oracle.at("blocks.0.moe.router") - without.at("blocks.0.moe.router"))
                  .abs()
                  .max()
                  .item<double>(),
              1e-6);  // the balance losses move the router
    ContextRun run;
    run.world = k.world;
    run.context = k.context;
    run.tp = k.tp;
    run.pp = k.pp;
    run.strategy = k.strategy;
    run.method = k.method;
    run.micro = k.micro;
    EXPECT_LT(context_parallel_apart(f, run, oracle), 1e-12)
        << k.world << " ranks, CP " << k.context << ", TP " << k.tp << ", PP " << k.pp << ", "
        << k.strategy << ", " << k.micro << " micro-batches";
  }
}

// Checkpoints know nothing of the context split: written at CP 2 (ddp, and zero1's shards over
// data-parallel x context ranks) they resume at CP 1 and at CP 4, and the third step is one
// process's third.
TEST(ContextParallel, CheckpointsResumeAtAnyContextSplit) {
  const test::Fixture f = decoder("llama");
  const auto two_steps = trained_whole(f, 2);
  const auto three_steps = trained_whole(f, 3);
  for (const std::string strategy : {"ddp", "zero1"}) {
    test::TempDir dir;
    ContextRun written;
    written.world = 4;
    written.strategy = strategy;
    written.steps = 2;
    written.save_to = dir.path();
    ASSERT_LT(context_parallel_apart(f, written, two_steps), 1e-12) << strategy;
    for (const auto& [world, context] : std::vector<std::pair<int, int>>{{2, 1}, {4, 4}}) {
      ContextRun resumed;
      resumed.world = world;
      resumed.context = context;
      resumed.strategy = strategy;
      resumed.load_from = dir.path();
      resumed.first_step = 2;
      resumed.steps = 1;
      EXPECT_LT(context_parallel_apart(f, resumed, three_steps), 1e-12)
          << strategy << " resumed on " << world << " ranks at CP " << context;
    }
  }
}
