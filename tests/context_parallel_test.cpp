// Context parallelism's attention (issue 82, its first piece): the sequence split over C ranks,
// causal attention by all-gather, ring and Ulysses against one process's attention over the whole
// sequence in float64 (outputs and the gradients of every rank's queries, keys and values), for
// contiguous and zigzag splits at C = 2 and 4; the block-and-merge arithmetic against plain
// masked softmax attention.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "RankThreads.h"
#include "dtrain/common/Error.h"
#include "dtrain/nn/context/Attention.h"

using namespace dtrain;
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

Whole whole_sequence(int64_t heads, int64_t tokens) {
  at::Generator g = at::detail::createCPUGenerator(7);
  Whole w;
  auto draw = [&] { return at::randn({2, heads, tokens, 8}, g, at::kDouble); };
  w.q = draw(), w.k = draw(), w.v = draw(), w.upstream = draw();
  const at::Tensor q = w.q.clone().requires_grad_(true), k = w.k.clone().requires_grad_(true),
                   v = w.v.clone().requires_grad_(true);
  w.out = plain_attention(q, k, v);
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
