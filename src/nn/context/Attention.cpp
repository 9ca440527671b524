// Context parallelism's attention: all-gather, ring and Ulysses over a sequence split.
#include "dtrain/nn/context/Attention.h"

#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/nn/tensor/Mappings.h"

namespace dtrain::nn::context {

namespace {

constexpr double kNothing = -1e30;  // a masked score: exp() of it against any real one is 0

// Every rank's positions, in rank order (not differentiable: integers).
at::Tensor gather_positions(const at::Tensor& positions, const comm::CommunicatorPtr& group) {
  const int ranks = group->size();
  at::Tensor all = at::empty({ranks * positions.size(0)}, positions.options());
  group->allgather(all, positions.contiguous())->wait();
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

// x to the next rank of the ring and the previous rank's x in return, started (both waited by
// the caller): the transfer runs on the group's backend while this thread computes.
struct Passing {
  at::Tensor received;
  comm::WorkPtr sent, arrived;
  at::Tensor wait() {
    sent->wait();
    arrived->wait();
    return received;
  }
};
Passing start_passing(const at::Tensor& x, const comm::CommunicatorPtr& group, int tag) {
  const int ranks = group->size(), rank = group->rank();
  Passing p;
  p.received = at::empty_like(x);
  comm::P2POptions options;
  options.tag = tag;
  p.arrived = group->recv(p.received, (rank + ranks - 1) % ranks, options);
  p.sent = group->send(x, (rank + 1) % ranks, options);
  return p;
}

struct GroupHolder : torch::CustomClassHolder {
  comm::CommunicatorPtr group;
};

constexpr int kKeysTag = 7001, kGradientsTag = 7002;

// Ring attention as one autograd function, so that each transfer overlaps a block's computation
// (what autograd's ops in sequence cannot): forward passes the keys and values on while the
// block in hand is computed and merged; backward recomputes each block's probabilities from the
// saved log-sum-exp (FlashAttention's backward, block by block), passes the keys and values on
// while it computes, and passes each block's accumulated key and value gradients on with them,
// so that after C transfers every block's gradients are back at their owner. Inputs: q, k, v
// [b, h, t, d]; every rank's positions in rank order [C t]; the whole sequence's documents
// [b, C t] or an empty tensor; the group.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& all,
                            const at::Tensor& documents, comm::CommunicatorPtr group) {
    const int ranks = group->size(), rank = group->rank();
    const int64_t t = q.size(2);
    auto positions_of = [&](int r) { return all.narrow(0, r * t, t); };
    auto documents_at = [&](const at::Tensor& at) {  // (none: an empty tensor)
      return documents.numel() > 0 ? documents.index_select(1, at.to(documents.device()))
                                   : at::Tensor();
    };
    const at::Tensor mine = positions_of(rank), my_documents = documents_at(mine);
    at::Tensor kv = at::stack({k, v}).contiguous();
    Partial result;
    for (int step = 0; step < ranks; ++step) {
      Passing passing;
      if (step + 1 < ranks) passing = start_passing(kv, group, kKeysTag);
      const at::Tensor theirs = positions_of((rank - step + ranks) % ranks);
      const Partial block =
          block_attention(q, kv[0], kv[1], mine, theirs, my_documents, documents_at(theirs));
      result = step == 0 ? block : merge(result, block);
      if (step + 1 < ranks) kv = passing.wait();
    }
    auto holder = c10::make_intrusive<GroupHolder>();
    holder->group = std::move(group);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
    ctx->save_for_backward({q, k, v, all, documents, result.out, result.lse});
    return result.out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &all = saved[3],
                     &documents = saved[4], &out = saved[5], &lse = saved[6];
    const comm::CommunicatorPtr group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())
            ->group;
    const int ranks = group->size(), rank = group->rank();
    const int64_t t = q.size(2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    auto positions_of = [&](int r) { return all.narrow(0, r * t, t); };
    auto documents_at = [&](const at::Tensor& at) {  // (none: an empty tensor)
      return documents.numel() > 0 ? documents.index_select(1, at.to(documents.device()))
                                   : at::Tensor();
    };
    const at::Tensor mine = positions_of(rank), my_documents = documents_at(mine);
    const at::Tensor d_out = grads[0].contiguous();
    const at::Tensor delta = (d_out * out).sum(-1, /*keepdim=*/true);  // [b, h, t, 1]
    at::Tensor d_q = at::zeros_like(q);
    at::Tensor kv = at::stack({k, v}).contiguous();
    at::Tensor d_kv = at::zeros_like(kv);  // the gradients of the block in hand so far
    for (int step = 0; step < ranks; ++step) {
      Passing keys;
      if (step + 1 < ranks) keys = start_passing(kv, group, kKeysTag);
      const at::Tensor theirs = positions_of((rank - step + ranks) % ranks);
      const at::Tensor hidden =
          hidden_keys(mine, theirs, my_documents, documents_at(theirs), q.device());
      const at::Tensor scores =
          (at::matmul(q, kv[0].transpose(-2, -1)) * scale).masked_fill(hidden, kNothing);
      const at::Tensor p = at::exp(scores - lse);
      const at::Tensor d_p = at::matmul(d_out, kv[1].transpose(-2, -1));
      const at::Tensor d_s = p * (d_p - delta) * scale;
      d_q += at::matmul(d_s, kv[0]);
      d_kv[0] += at::matmul(d_s.transpose(-2, -1), q);
      d_kv[1] += at::matmul(p.transpose(-2, -1), d_out);
      // The block's gradients go on with it; after the last block, back to its owner.
      Passing gradients = start_passing(d_kv, group, kGradientsTag);
      if (step + 1 < ranks) kv = keys.wait();
      d_kv = gradients.wait();
    }
    return {d_q, d_kv[0], d_kv[1], at::Tensor(), at::Tensor(), at::Tensor()};
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

Partial block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& q_positions, const at::Tensor& k_positions,
                        const at::Tensor& q_documents, const at::Tensor& k_documents) {
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
  return {at::matmul(at::exp(scores - lse) * sees, v), lse};
}

Partial merge(const Partial& a, const Partial& b) {
  const at::Tensor lse = at::logaddexp(a.lse, b.lse);
  return {a.out * at::exp(a.lse - lse) + b.out * at::exp(b.lse - lse), lse};
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, const comm::CommunicatorPtr& group,
                            const std::string& method, const at::Tensor& documents) {
  DTRAIN_CHECK_INPUT(method == "allgather" || method == "ring" || method == "ulysses",
                     "--cp-method must be ring, allgather or ulysses, got '", method, "'");
  DTRAIN_CHECK_INPUT(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes() &&
                         positions.dim() == 1 && positions.size(0) == q.size(2),
                     "context attention: q, k, v [batch, heads, tokens, head dim] alike and one "
                     "position per token");
  // The documents of the tokens at some positions (undefined: one document).
  auto documents_at = [&](const at::Tensor& at) {
    return documents.defined() ? documents.index_select(1, at.to(documents.device()))
                               : at::Tensor();
  };
  const at::Tensor mine = documents_at(positions);
  if (!group || group->size() == 1) {
    return block_attention(q, k, v, positions, positions, mine, mine).out;
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
    return block_attention(q, gathered(k), gathered(v), positions, all, mine, documents_at(all))
        .out;
  }
  if (method == "ring") {
    // This rank's block first; then, C - 1 times, the keys and values of the rank before
    // (stacked to travel as one message, the next transfer running while a block is computed),
    // each partial merged in.
    return RingAttention::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                gather_positions(positions, group),
                                documents.defined() ? documents : at::empty({0}, at::kLong), group);
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
  const at::Tensor out =
      block_attention(to_heads(q), to_heads(k), to_heads(v), all, all, every, every).out;
  // Back: [b, h/C, C t, d] -> rows [C, h/C, b, t, d] by source rank -> [b, h, t, d].
  const at::Tensor by_rank =
      out.view({b, local, ranks, t, d}).permute({2, 1, 0, 3, 4}).reshape({ranks * local, b, t, d});
  return tensor::all_to_all_rows(by_rank.contiguous(), group, rows, rows).transpose(0, 1);
}

}  // namespace dtrain::nn::context
