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

// x [rows, ...] to the next rank of the ring (rank + 1), the previous rank's in return; the
// backward passes the gradient the other way.
at::Tensor pass_on(const at::Tensor& x, const comm::CommunicatorPtr& group) {
  const int ranks = group->size(), rank = group->rank();
  std::vector<int64_t> send(ranks, 0), recv(ranks, 0);
  send[(rank + 1) % ranks] = x.size(0);
  recv[(rank + ranks - 1) % ranks] = x.size(0);
  return tensor::all_to_all_rows(x, group, send, recv);
}

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
  at::Tensor future =
      k_positions.to(q.device()).unsqueeze(0) > q_positions.to(q.device()).unsqueeze(1);
  if (q_documents.defined()) {
    future = (future.unsqueeze(0) |
              q_documents.to(q.device()).unsqueeze(2).ne(k_documents.to(q.device()).unsqueeze(1)))
                 .unsqueeze(1);
  }
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
    // (stacked to travel as one message), each partial merged in.
    Partial result = block_attention(q, k, v, positions, positions, mine, mine);
    at::Tensor kv = at::stack({k, v});  // [2, b, h, t, d]
    const at::Tensor all = gather_positions(positions, group);
    for (int step = 1; step < ranks; ++step) {
      kv = pass_on(kv, group);  // now rank - step's
      const int64_t from = (group->rank() - step + ranks) % ranks;
      const at::Tensor theirs = all.narrow(0, from * t, t);
      result = merge(
          result, block_attention(q, kv[0], kv[1], positions, theirs, mine, documents_at(theirs)));
    }
    return result.out;
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
