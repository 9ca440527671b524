// Context parallelism's attention: all-gather, ring and Ulysses over a sequence split.
#include "dtrain/nn/context/Attention.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "common/TorchCompat.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/tensor/Mappings.h"

namespace dtrain::nn::context {

namespace {

constexpr double kNothing = -1e30;  // a masked score: exp() of it against any real one is 0

// A 32-bit integer hash (two multiply-xorshift rounds, Thomas Mueller's constant) over int64
// tensors holding 32-bit values: each product stays below 2^59.
at::Tensor mix32(const at::Tensor& x) {
  constexpr int64_t kMultiplier = 0x45d9f3b, kLow32 = 0xffffffffLL;
  at::Tensor h = at::bitwise_xor(x, x.__rshift__(16));
  h = (h * kMultiplier).bitwise_and(kLow32);
  h = at::bitwise_xor(h, h.__rshift__(16));
  h = (h * kMultiplier).bitwise_and(kLow32);
  return at::bitwise_xor(h, h.__rshift__(16));
}

// The weights attention dropout keeps [b, h, q, k] (bool: what a masked_fill keeps for backward,
// a byte a weight).
at::Tensor dropout_kept(const Dropout& dropout, int64_t batch, int64_t heads,
                        const at::Tensor& q_positions, const at::Tensor& k_positions,
                        const at::Device& device) {
  DTRAIN_CHECK_INPUT(dropout.p >= 0 && dropout.p < 1, "attention dropout must be in [0, 1), got ",
                     dropout.p);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  constexpr int64_t kLow32 = 0xffffffffLL;
  const int64_t low = dropout.seed & kLow32, high = (dropout.seed >> 32) & kLow32;
  // One key per (batch row, head) from the seed, then one per query from it and the query's
  // position, then one per weight from that and the key's position: [b, h, q, k].
  const at::Tensor rows = (at::arange(batch, longs).unsqueeze(1) * 65536 +
                           (at::arange(heads, longs) + dropout.head_offset).unsqueeze(0))
                              .bitwise_and(kLow32);
  const at::Tensor per_row = mix32(at::bitwise_xor(mix32(at::bitwise_xor(rows, low)), high));
  const at::Tensor per_query =
      mix32(at::bitwise_xor(per_row.unsqueeze(-1), q_positions.to(longs).view({1, 1, -1})));
  const at::Tensor bits =
      mix32(at::bitwise_xor(per_query.unsqueeze(-1), k_positions.to(longs).view({1, 1, 1, -1})));
  // 24 of its bits as a uniform draw: kept where at or above p.
  constexpr int64_t kUnits = int64_t{1} << 24;
  return bits.bitwise_and(kUnits - 1).ge(static_cast<int64_t>(std::llround(dropout.p * kUnits)));
}

// Dropped weights zeroed, kept ones scaled by 1 / (1 - p).
at::Tensor apply_dropout(const at::Tensor& weights, const Dropout& dropout,
                         const at::Tensor& q_positions, const at::Tensor& k_positions) {
  const at::Tensor kept = dropout_kept(dropout, weights.size(0), weights.size(1), q_positions,
                                       k_positions, weights.device());
  return weights.masked_fill(kept.logical_not(), 0) * (1.0 / (1.0 - dropout.p));
}

struct DropoutHolder : torch::CustomClassHolder {
  Dropout dropout;
};

// Every rank's positions, in rank order (not differentiable: integers).
at::Tensor gather_positions(const at::Tensor& positions, const comm::CommunicatorPtr& group) {
  const int ranks = group->size();
  at::Tensor all = at::empty({ranks * positions.size(0)}, positions.options());
  comm::on_lane(group)->allgather(all, positions.contiguous())->wait();
  return all;
}

// The keys each query does not see: later ones, and with documents, another document's
// ([q, k], or [batch, 1, q, k] with documents).
at::Tensor hidden_keys(const at::Tensor& q_positions, const at::Tensor& k_positions,
                       const at::Tensor& q_documents, const at::Tensor& k_documents,
                       const at::Device& device) {
  at::Tensor hidden = k_positions.to(device).unsqueeze(0) > q_positions.to(device).unsqueeze(1);
  if (q_documents.defined()) {
    hidden = (hidden.unsqueeze(0) |
              q_documents.to(device).unsqueeze(2).ne(k_documents.to(device).unsqueeze(1)))
                 .unsqueeze(1);
  }
  return hidden;
}

// Attention where every query sees at least one of the keys (its own position among them: one
// process, the all-gather's and Ulysses' whole sequences): softmax over the scores with the
// hidden ones at -inf, then dropout. What backward keeps of it: softmax's output, the dropout
// mask (a byte a weight) and the weights (block_attention's log-sum-exp form keeps more).
at::Tensor softmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& q_positions, const at::Tensor& k_positions,
                             const at::Tensor& q_documents, const at::Tensor& k_documents,
                             const Dropout& dropout) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor hidden =
      hidden_keys(q_positions, k_positions, q_documents, k_documents, q.device());
  at::Tensor weights =
      at::softmax((at::matmul(q, k.transpose(-2, -1)) * scale)
                      .masked_fill(hidden, -std::numeric_limits<double>::infinity()),
                  -1);
  if (dropout.active()) weights = apply_dropout(weights, dropout, q_positions, k_positions);
  return at::matmul(weights, v);
}

// Grouped-query attention's key/value heads [b, kv heads, t, d] expanded to the query heads,
// each serving `heads` / kv heads consecutive ones (as the decoders expand them); and a gradient
// over the query heads folded back (summed over each group).
at::Tensor expand_heads(const at::Tensor& x, int64_t heads) {
  const int64_t kv = x.size(1), groups = heads / kv;
  if (groups == 1) return x;
  return x.unsqueeze(2)
      .expand({x.size(0), kv, groups, x.size(2), x.size(3)})
      .reshape({x.size(0), heads, x.size(2), x.size(3)});
}
at::Tensor fold_heads(const at::Tensor& x, int64_t kv) {
  const int64_t groups = x.size(1) / kv;
  if (groups == 1) return x;
  return x.reshape({x.size(0), kv, groups, x.size(2), x.size(3)}).sum(2);
}

// x to the next rank of the ring and the previous rank's x in return, started (both waited by
// the caller): the transfer runs on the group's backend while this thread computes.
// With --trace, the time a rank waits for it ("ring wait": what the block's computation did not
// hide) is a span. DTRAIN_CP_SERIAL_RING=1 (benchmarks only) waits for every transfer before the
// block is computed: its "ring wait" spans are then the transfers' whole time, against which
// bench/cp/run_ring_lab.py measures the share hidden.
struct Passing {
  at::Tensor sending, received;
  comm::WorkPtr sent, arrived;
  at::Tensor wait() {
    if (!arrived) return received;  // (waited at the start)
    trace::Span span("comm", "ring wait");
    sent->wait();
    arrived->wait();
    sent.reset();
    arrived.reset();
    sending = at::Tensor();
    return received;
  }
};
Passing start_passing(const at::Tensor& x, const comm::CommunicatorPtr& group, int tag) {
  static const bool serial = std::getenv("DTRAIN_CP_SERIAL_RING") != nullptr;
  const int ranks = group->size(), rank = group->rank();
  Passing p;
  p.sending = x;
  p.received = at::empty_like(x);
  comm::P2POptions options;
  options.tag = tag;
  // (A DualPipe-V pair's backward thread passes on the context group's second lane.)
  const comm::CommunicatorPtr& lane = comm::on_lane(group);
  p.arrived = lane->recv(p.received, (rank + ranks - 1) % ranks, options);
  p.sent = lane->send(x, (rank + 1) % ranks, options);
  if (serial) p.wait();
  return p;
}

struct GroupHolder : torch::CustomClassHolder {
  comm::CommunicatorPtr group;
};

constexpr int kKeysTag = 7001, kGradientsTag = 7002;

// A part of a rank's tokens that the ring computes as one piece: a tile pair whose keys all come
// after all its queries is skipped (under causal attention about half the pairs), and one pair's
// scores are all that is held at a time.
struct Tile {
  int64_t start = 0, length = 0;  // along the rank's tokens
  int64_t first = 0, last = 0;    // its lowest and highest position
  at::Tensor positions, documents;
  at::Tensor of(const at::Tensor& x) const { return x.narrow(2, start, length); }  // [b, h, t, d]
  bool run() const { return last - first + 1 == length; }  // consecutive positions (ascending)
};

// How a query tile sees a key tile: not at all (every key after every query), wholly (every key
// at or before every query), causally (the same consecutive positions: the diagonal), or
// otherwise (a mask of its own).
enum class Sight { kNone, kAll, kCausal, kMasked };
Sight sight(const Tile& queries, const Tile& keys) {
  if (keys.first > queries.last) return Sight::kNone;
  if (queries.documents.defined()) return Sight::kMasked;
  if (keys.last <= queries.first) return Sight::kAll;
  if (keys.run() && queries.run() && keys.first == queries.first && keys.length == queries.length) {
    return Sight::kCausal;
  }
  return Sight::kMasked;
}

// Whether a tile pair is computed by LibTorch's fused attention (FlashAttention's CPU kernels,
// which return the log-sum-exp and take it back in backward, as torch's own ring does on CUDA):
// LibTorch 2.x on a CPU, a pair without a mask of its own. Else written out (scores, mask, exp).
[[maybe_unused]] bool fused(Sight s, const at::Tensor& q) {
#if DTRAIN_TORCH_AT_LEAST(2, 3)
  return (s == Sight::kAll || s == Sight::kCausal) && q.device().is_cpu();
#else
  (void)s;
  (void)q;
  return false;
#endif
}

// Every rank's tiles: the two halves of its tokens (under the zigzag split, its two chunks), or
// its tokens whole where they are odd in number.
struct Ring {
  std::vector<std::vector<Tile>> tiles;
  Ring(const at::Tensor& all, const at::Tensor& documents, int64_t t, int ranks) {
    const at::Tensor where = all.to(at::kCPU);
    const int pieces = t % 2 == 0 ? 2 : 1;
    for (int r = 0; r < ranks; ++r) {
      std::vector<Tile> of_rank;
      for (int piece = 0; piece < pieces; ++piece) {
        Tile tile;
        tile.length = t / pieces;
        tile.start = piece * tile.length;
        tile.positions = all.narrow(0, r * t + tile.start, tile.length);
        const at::Tensor here = where.narrow(0, r * t + tile.start, tile.length);
        tile.first = here.min().item<int64_t>();
        tile.last = here.max().item<int64_t>();
        if (documents.numel() > 0) {
          tile.documents = documents.index_select(1, tile.positions.to(documents.device()));
        }
        of_rank.push_back(std::move(tile));
      }
      tiles.push_back(std::move(of_rank));
    }
  }
};

// Ring attention as one autograd function, so that each transfer overlaps a block's computation
// (what autograd's ops in sequence cannot): forward passes the keys and values on while the
// block in hand is computed and merged; backward recomputes each block's probabilities from the
// saved log-sum-exp (FlashAttention's backward, block by block), passes the keys and values on
// while it computes, and passes each block's accumulated key and value gradients on with them,
// so that after C transfers every block's gradients are back at their owner (each transfer but
// the last overlapping the next block's computation). Each block is computed tile pair by tile
// pair (Tile): the zigzag's chunk pairs, as Megatron's and torch's rings do; where the causal
// mask hides a whole pair it is skipped. Inputs: q, k, v [b, h, t, d] (k and v may hold fewer
// key/value heads: they travel so, expanded where a pair is computed); every rank's positions in
// rank order [C t]; the whole sequence's documents [b, C t] or an empty tensor; the group.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& all,
                            const at::Tensor& documents, comm::CommunicatorPtr group,
                            const Dropout& dropout) {
    const int ranks = group->size(), rank = group->rank();
    const Ring ring(all, documents, q.size(2), ranks);
    const std::vector<Tile>& mine = ring.tiles[rank];
    const int64_t h = q.size(1);
    at::Tensor kv = at::stack({k, v}).contiguous();  // (grouped-query: the key/value heads only)
    std::vector<Partial> results(mine.size());
    for (int step = 0; step < ranks; ++step) {
      Passing passing;
      if (step + 1 < ranks) passing = start_passing(kv, group, kKeysTag);
      const std::vector<Tile>& theirs = ring.tiles[(rank - step + ranks) % ranks];
      for (size_t i = 0; i < mine.size(); ++i) {
        trace::Span span("forward", "ring block");
        for (const Tile& keys : theirs) {
          const Sight s = sight(mine[i], keys);
          if (s == Sight::kNone) continue;
          Partial block;
#if DTRAIN_TORCH_AT_LEAST(2, 3)
          if (fused(s, q) && !dropout.active()) {
            auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
                mine[i].of(q).contiguous(), expand_heads(keys.of(kv[0]), h).contiguous(),
                expand_heads(keys.of(kv[1]), h).contiguous(), 0.0, s == Sight::kCausal);
            block = {out, lse.unsqueeze(-1)};
          }
#endif
          if (!block.out.defined()) {
            block = block_attention(mine[i].of(q), expand_heads(keys.of(kv[0]), h),
                                    expand_heads(keys.of(kv[1]), h), mine[i].positions,
                                    keys.positions, mine[i].documents, keys.documents, dropout);
          }
          results[i] = results[i].out.defined() ? merge(results[i], block) : block;
        }
      }
      if (step + 1 < ranks) kv = passing.wait();
    }
    // Every query tile saw at least its own keys (its tile's diagonal at step 0).
    std::vector<at::Tensor> outs, lses;
    for (const Partial& p : results) {
      outs.push_back(p.out);
      lses.push_back(p.lse);
    }
    // (The fused kernels' log-sum-exp is float32 under bfloat16: the output keeps q's type.)
    const at::Tensor out = at::cat(outs, 2).to(q.scalar_type()), lse = at::cat(lses, 2);
    auto holder = c10::make_intrusive<GroupHolder>();
    holder->group = std::move(group);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
    auto kept = c10::make_intrusive<DropoutHolder>();
    kept->dropout = dropout;
    ctx->saved_data["dropout"] = c10::IValue::make_capsule(std::move(kept));
    ctx->save_for_backward({q, k, v, all, documents, out, lse});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &all = saved[3],
                     &documents = saved[4], &out = saved[5], &lse = saved[6];
    const comm::CommunicatorPtr group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())
            ->group;
    const Dropout dropout =
        c10::static_intrusive_pointer_cast<DropoutHolder>(ctx->saved_data["dropout"].toCapsule())
            ->dropout;
    const int ranks = group->size(), rank = group->rank();
    const Ring ring(all, documents, q.size(2), ranks);
    const std::vector<Tile>& mine = ring.tiles[rank];
    const int64_t h = q.size(1), kv_heads = k.size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const at::Tensor d_out = grads[0].contiguous();
    const at::Tensor delta = (d_out * out).sum(-1, /*keepdim=*/true);  // [b, h, t, 1]
    at::Tensor d_q = at::zeros_like(q);
    at::Tensor kv = at::stack({k, v}).contiguous();
    Passing gradients;  // the block in hand's gradients accumulated by its earlier holders
    for (int step = 0; step < ranks; ++step) {
      Passing keys;
      if (step + 1 < ranks) keys = start_passing(kv, group, kKeysTag);
      at::Tensor d_kv = at::zeros_like(kv);  // this rank's share of the block's gradients
      const std::vector<Tile>& theirs = ring.tiles[(rank - step + ranks) % ranks];
      for (const Tile& queries : mine) {
        trace::Span span("backward", "ring block");
        const at::Tensor q_t = queries.of(q), d_out_t = queries.of(d_out);
        for (const Tile& block : theirs) {
          const Sight s = sight(queries, block);
          if (s == Sight::kNone) continue;
#if DTRAIN_TORCH_AT_LEAST(2, 3)
          if (fused(s, q) && !dropout.active()) {
            auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                d_out_t.contiguous(), q_t.contiguous(),
                expand_heads(block.of(kv[0]), h).contiguous(),
                expand_heads(block.of(kv[1]), h).contiguous(), queries.of(out).contiguous(),
                queries.of(lse).squeeze(-1).contiguous(), 0.0, s == Sight::kCausal);
            queries.of(d_q) += dq;
            block.of(d_kv[0]) += fold_heads(dk, kv_heads);
            block.of(d_kv[1]) += fold_heads(dv, kv_heads);
            continue;
          }
#endif
          const at::Tensor hidden = hidden_keys(queries.positions, block.positions,
                                                queries.documents, block.documents, q.device());
          const at::Tensor k_t = expand_heads(block.of(kv[0]), h),
                           v_t = expand_heads(block.of(kv[1]), h);
          const at::Tensor scores =
              (at::matmul(q_t, k_t.transpose(-2, -1)) * scale).masked_fill(hidden, kNothing);
          const at::Tensor p = at::exp(scores - queries.of(lse));
          at::Tensor d_p = at::matmul(d_out_t, v_t.transpose(-2, -1));
          at::Tensor kept = p;  // the weights the output summed: dropped ones out (FlashAttention's
                                // backward with dropout; delta, from the output, already is)
          if (dropout.active()) {
            d_p = apply_dropout(d_p, dropout, queries.positions, block.positions);
            kept = apply_dropout(p, dropout, queries.positions, block.positions);
          }
          const at::Tensor d_s = p * (d_p - queries.of(delta)) * scale;
          queries.of(d_q) += at::matmul(d_s, k_t);
          block.of(d_kv[0]) += fold_heads(at::matmul(d_s.transpose(-2, -1), q_t), kv_heads);
          block.of(d_kv[1]) += fold_heads(at::matmul(kept.transpose(-2, -1), d_out_t), kv_heads);
        }
      }
      // The earlier holders' share, sent at the end of their step, arrived while this rank
      // computed; the block's gradients go on with it, after the last block back to its owner.
      if (step > 0) d_kv += gradients.wait();
      gradients = start_passing(d_kv, group, kGradientsTag);
      if (step + 1 < ranks) kv = keys.wait();
    }
    const at::Tensor d_kv = gradients.wait();  // this rank's own keys' and values'
    return {d_q, d_kv[0], d_kv[1], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor split_positions(int64_t tokens, int ranks, int rank, bool zigzag) {
  DTRAIN_CHECK_INPUT(ranks >= 1 && rank >= 0 && rank < ranks, "context parallelism: rank ", rank,
                     " of ", ranks);
  const int64_t chunks = zigzag ? 2 * ranks : ranks;
  DTRAIN_CHECK_INPUT(tokens % chunks == 0, "context parallelism over ", ranks, " ranks",
                     zigzag ? " (zigzag: 2 x ranks chunks)" : "", " needs a sequence that ", chunks,
                     " divides, got ", tokens, " tokens");
  const int64_t chunk = tokens / chunks;
  if (!zigzag) return at::arange(rank * chunk, (rank + 1) * chunk, at::kLong);
  return at::cat({at::arange(rank * chunk, (rank + 1) * chunk, at::kLong),
                  at::arange((chunks - 1 - rank) * chunk, (chunks - rank) * chunk, at::kLong)});
}

Documents document_index(const at::Tensor& ids, int64_t document_end) {
  DTRAIN_CHECK_INPUT(ids.dim() == 2, "packed sequences: token ids [batch, tokens], got ",
                     ids.sizes());
  const at::Tensor ends = ids.eq(document_end).to(at::kLong);
  Documents d;
  d.index = ends.cumsum(1) - ends;
  // Where each document begins (the first token, and each token after an end), carried forward.
  const int64_t t = ids.size(1);
  const at::Tensor along = at::arange(t, ids.options().dtype(at::kLong)).expand_as(ends);
  at::Tensor begins = at::zeros_like(ends);
  begins.select(1, 0).fill_(1);
  if (t > 1) begins.narrow(1, 1, t - 1).copy_(ends.narrow(1, 0, t - 1));
  const at::Tensor start = std::get<0>((along * begins).cummax(1));
  d.positions = along - start;
  return d;
}

at::Tensor dropout_scale(const Dropout& dropout, int64_t batch, int64_t heads,
                         const at::Tensor& q_positions, const at::Tensor& k_positions,
                         const at::TensorOptions& options) {
  return dropout_kept(dropout, batch, heads, q_positions, k_positions, options.device())
             .to(options.dtype()) *
         (1.0 / (1.0 - dropout.p));
}

Partial block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& q_positions, const at::Tensor& k_positions,
                        const at::Tensor& q_documents, const at::Tensor& k_documents,
                        const Dropout& dropout) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  // [q tokens, k tokens]: a key after the query is masked; with documents [batch, 1, q, k], a
  // key of another document too.
  const at::Tensor future =
      hidden_keys(q_positions, k_positions, q_documents, k_documents, q.device());
  const at::Tensor scores =
      (at::matmul(q, k.transpose(-2, -1)) * scale).masked_fill(future, kNothing);
  const at::Tensor lse = scores.logsumexp(-1, /*keepdim=*/true);
  // A query that sees none of these keys: its scores are all kNothing, softmax would spread it
  // evenly; its weights are zeroed so its output is 0 (and its lse, about -1e30, weighs nothing).
  const at::Tensor sees = (~future).any(-1).unsqueeze(-1).to(q.scalar_type());
  at::Tensor weights = at::exp(scores - lse) * sees;
  if (dropout.active()) weights = apply_dropout(weights, dropout, q_positions, k_positions);
  return {at::matmul(weights, v), lse};
}

Partial merge(const Partial& a, const Partial& b) {
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  return {a.out * at::exp(a.lse - lse) + b.out * at::exp(b.lse - lse), lse};
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, const comm::CommunicatorPtr& group,
                            const std::string& method, const at::Tensor& documents,
                            const Dropout& dropout) {
  DTRAIN_CHECK_INPUT(method == "allgather" || method == "ring" || method == "ulysses",
                     "--cp-method must be ring, allgather or ulysses, got '", method, "'");
  DTRAIN_CHECK_INPUT(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() &&
                         k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                         k.size(3) == q.size(3) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0 &&
                         positions.dim() == 1 && positions.size(0) == q.size(2),
                     "context attention: q [batch, heads, tokens, head dim], k and v alike with "
                     "heads or key/value heads that divide them, and one position per token");
  // The documents of the tokens at some positions (undefined: one document).
  auto documents_at = [&](const at::Tensor& at) {
    return documents.defined() ? documents.index_select(1, at.to(documents.device()))
                               : at::Tensor();
  };
  const at::Tensor mine = documents_at(positions);
  const int64_t heads = q.size(1);
  if (!group || group->size() == 1) {
    return softmax_attention(q, expand_heads(k, heads), expand_heads(v, heads), positions,
                             positions, mine, mine, dropout);
  }
  const int ranks = group->size();
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  DTRAIN_CHECK_INPUT(
      !documents.defined() || (documents.dim() == 2 && documents.size(1) == ranks * t),
      "context attention: the documents of the whole sequence [batch, ", ranks * t, " tokens]");
  if (method == "allgather") {
    // Every rank's keys and values along the sequence ([b, t, h, d]: dim 1); backward sums
    // each rank's queries' gradients into them (a reduce-scatter).
    auto gathered = [&](const at::Tensor& x) {
      return tensor::gather_from_sequence(x.transpose(1, 2).contiguous(), group).transpose(1, 2);
    };
    const at::Tensor all = gather_positions(positions, group);
    return softmax_attention(q, expand_heads(gathered(k), heads), expand_heads(gathered(v), heads),
                             positions, all, mine, documents_at(all), dropout);
  }
  if (method == "ring") {
    // This rank's block first; then, C - 1 times, the keys and values of the rank before
    // (stacked to travel as one message, the next transfer running while a block is computed),
    // each partial merged in.
    return RingAttention::apply(
        q.contiguous(), k.contiguous(), v.contiguous(), gather_positions(positions, group),
        documents.defined() ? documents : at::empty({0}, at::kLong), group, dropout);
  }
  // Ulysses: heads to the ranks (h / C each), every rank's tokens to each: [h, b, t, d] rows
  // by head, h / C to each rank; what comes back is, for this rank's heads, every rank's tokens.
  DTRAIN_CHECK_INPUT(h % ranks == 0, "--cp-method ulysses splits the ", h, " attention heads over ",
                     ranks, " ranks: they must divide");
  const int64_t local = h / ranks;
  const std::vector<int64_t> rows(ranks, local);
  auto to_heads = [&](const at::Tensor& x) {  // [b, h, t, d] -> [b, h / C, C t, d]
    const at::Tensor out =
        tensor::all_to_all_rows(x.transpose(0, 1).contiguous(), group, rows, rows);  // [C h/C..]
    return out.view({ranks, local, b, t, d})
        .permute({2, 1, 0, 3, 4})
        .reshape({b, local, ranks * t, d});
  };
  const at::Tensor all = gather_positions(positions, group);
  const at::Tensor every = documents_at(all);
  Dropout mine_of_heads = dropout;  // this rank's heads are the group's h / C from rank x h / C
  mine_of_heads.head_offset += group->rank() * local;
  const at::Tensor out =
      softmax_attention(to_heads(q), to_heads(expand_heads(k, heads)),
                        to_heads(expand_heads(v, heads)), all, all, every, every, mine_of_heads);
  // Back: [b, h/C, C t, d] -> rows [C, h/C, b, t, d] by source rank -> [b, h, t, d].
  const at::Tensor by_rank =
      out.view({b, local, ranks, t, d}).permute({2, 1, 0, 3, 4}).reshape({ranks * local, b, t, d});
  return tensor::all_to_all_rows(by_rank.contiguous(), group, rows, rows).transpose(0, 1);
}

}  // namespace dtrain::nn::context
