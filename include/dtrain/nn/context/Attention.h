// Context parallelism's attention (issue 82): the sequence of a batch is split over a group of C
// ranks, each holding the queries, keys and values of its own tokens, and causal attention over
// the whole sequence is computed without any rank holding all of it at once (ring) or holding
// all of it only for the keys and values of one layer (all-gather), or by trading the sequence
// split for a head split (Ulysses). Every method is differentiable end to end: its
// communication is made of autograd functions whose backward is the reverse exchange, so the
// gradients of each rank's queries, keys and values are those of one process on the whole
// sequence.
//
// Which tokens a rank holds is given by their global positions (`positions`), so any split works;
// causal masking compares positions. `split_positions` gives the two usual ones: contiguous
// chunks, and the zigzag of Megatron's CP and torch's context_parallel (the sequence cut into 2C
// chunks, rank r holding chunks r and 2C - 1 - r), under which every rank does the same causal
// work.
//
// Packed sequences (documents packed into one sequence, Megatron's --reset-attention-mask): a
// whole sequence's document index [batch, tokens] keeps each query's attention inside its own
// document (document_index gives it from the tokens and the end-of-document token).
//
// The decoders use it with --context-parallel and --reset-attention-mask (models/Gpt.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "dtrain/comm/Communicator.h"

namespace dtrain::nn::context {

/// The global positions rank `rank` of `ranks` holds of a sequence of `tokens` (ascending):
/// contiguous chunks, or (zigzag) chunks rank and 2 ranks - 1 - rank of 2 ranks. InputError
/// naming the numbers when they do not divide.
at::Tensor split_positions(int64_t tokens, int ranks, int rank, bool zigzag);

/// Packed sequences: for token ids [batch, tokens] and the end-of-document token, each token's
/// document (0, 1, ... along the sequence; the end-of-document token belongs to the document it
/// ends) and its position within it (0 after each end), both [batch, tokens] int64
/// (Megatron's get_ltor_masks_and_position_ids with reset_position_ids and
/// reset_attention_mask).
struct Documents {
  at::Tensor index, positions;
};
Documents document_index(const at::Tensor& ids, int64_t document_end);

/// Attention dropout (`--dropout` on attention's weights), drawn as FlashAttention draws it: the
/// weight of the query at position i on the key at position j, in head h of batch row b, is kept
/// or dropped by a hash of (seed, b, h, i, j) alone. Any rank computing any block of the
/// attention, in any split or order, keeps the same weights as one process on the whole
/// sequence, and backward works the mask out again instead of keeping it. `head_offset`: the
/// first head of the block among the heads the seed covers (Ulysses' rank holds later ones).
struct Dropout {
  double p = 0.0;
  int64_t seed = 0;
  int64_t head_offset = 0;
  bool active() const { return p > 0.0; }
};
/// The factor of each weight [batch, heads, q tokens, k tokens] of queries at `q_positions` on
/// keys at `k_positions`: 0 (dropped) or 1 / (1 - p) (kept, scaled as inverted dropout).
at::Tensor dropout_scale(const Dropout& dropout, int64_t batch, int64_t heads,
                         const at::Tensor& q_positions, const at::Tensor& k_positions,
                         const at::TensorOptions& options);

/// Causal attention of this rank's queries over every rank's keys and values: q, k, v
/// [batch, heads, local tokens, head dim] (the same heads on every rank; k and v may have fewer
/// heads that divide q's, grouped-query attention's key/value heads, each serving that many
/// consecutive query heads: the ring and the all-gather send them so), `positions` the
/// local tokens' global positions [local tokens] (int64), the same count on every rank.
/// `documents` (optional): the whole sequence's document index [batch, tokens] (every rank's
/// positions; Documents::index), a query then seeing only the keys of its own document.
/// `method`: "allgather" (the keys and values gathered once), "ring" (passed around the ring
/// C - 1 times, partial results merged by log-sum-exp), "ulysses" (an all-to-all from the
/// sequence split to a head split and back; heads must be a multiple of C). Returns
/// [batch, heads, local tokens, head dim]. Collective over `group` (null or one rank: local
/// causal attention). `dropout`: attention dropout, the same weights kept by every method.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, const comm::CommunicatorPtr& group,
                            const std::string& method, const at::Tensor& documents = {},
                            const Dropout& dropout = {});

/// Attention of queries at `q_positions` over keys at `k_positions` (a key is seen by the
/// queries at or after its position), with the log-sum-exp of each query's scores: `out`
/// [batch, heads, q tokens, head dim], `lse` [batch, heads, q tokens, 1]. A query that sees no
/// key gets zeros and a log-sum-exp of about -1e30, which merge() weighs as nothing. With
/// `q_documents` [batch, q tokens] and `k_documents` [batch, k tokens], a key is also seen only
/// by the queries of its document. With `dropout`, `out` sums the kept weights only (scaled),
/// `lse` stays that of all the scores: merged blocks are then the dropped attention.
struct Partial {
  at::Tensor out, lse;
};
Partial block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& q_positions, const at::Tensor& k_positions,
                        const at::Tensor& q_documents = {}, const at::Tensor& k_documents = {},
                        const Dropout& dropout = {});
/// The attention over the union of two partials' keys.
Partial merge(const Partial& a, const Partial& b);

}  // namespace dtrain::nn::context
