// The decoder (see Gpt.h). Linear layers are ATen's `linear` on 3-D inputs. Attention is LibTorch
// 2.x's fused scaled_dot_product_attention (causal, no T x T mask made; flash, memory-efficient
// or cuDNN kernels on CUDA), written out (scores, causal mask, softmax, weighted values) on 1.13,
// which has none, and wherever attention dropout draws from the model's own generators.
#include "dtrain/models/Gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <mutex>

#include "common/TorchCompat.h"
#include "dtrain/common/Error.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/Moe.h"
#include "dtrain/nn/WeightGrad.h"
#include "dtrain/nn/context/Attention.h"
#include "dtrain/nn/tensor/CrossEntropy.h"
#include "dtrain/nn/tensor/Layers.h"
#include "dtrain/nn/tensor/Mappings.h"
#include "dtrain/nn/tensor/Random.h"

namespace dtrain::models {

namespace {

namespace tp = nn::tensor;

dtrain::nn::MoeOptions moe_options(const GptConfig& c) {
  dtrain::nn::MoeOptions o;
  o.width = c.width;
  o.ffn_width = expert_ffn_width_of(c);
  o.experts = c.moe_experts;
  o.top_k = c.moe_top_k;
  o.shared_experts = c.moe_shared_experts;
  o.score = c.moe_score;
  o.capacity_factor = c.moe_capacity;
  o.aux_loss = c.moe_aux_loss;
  o.z_loss = c.moe_z_loss;
  o.normalize = c.moe_normalize;
  return o;
}

struct Shared {
  comm::CommunicatorPtr group;  // the tensor-parallel group (null: serial)
  comm::CommunicatorPtr experts;  // the expert-parallel group (null: every expert here)
  std::shared_ptr<tp::RngTracker> rng;
  double dropout = 0.0;
  // Sequence parallelism: outside attention and the MLP, activations are [b, t / T, h], each
  // rank holding a contiguous part of the sequence.
  bool sequence_parallel = false;
  // --tp-comm-overlap: the column-parallel layers' input-gradient collective overlaps dW.
  bool tp_comm_overlap = false;
  // --checkpointing selective (Korthikanti et al. 2022): attention's core (scores, softmax,
  // dropout, weighted values) is recomputed in backward from its queries, keys and values.
  bool selective = false;
  // Context parallelism (issue 82): each sequence split over this group (null: whole here), its
  // attention by `cp_method`, the split the zigzag or contiguous chunks.
  comm::CommunicatorPtr context;
  std::string cp_method = "ring";
  bool cp_zigzag = true;
  // Packed sequences: the end-of-document token (-1: none) and the documents of the batch the
  // embedding saw last, whole sequences (what every block's attention of that forward reads; a
  // recomputation runs before the next batch's forward).
  int64_t document_end = -1;
  std::shared_ptr<nn::context::Documents> packed;
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
  // The global positions of this rank's share of a sequence of `tokens`: all of them without
  // context parallelism.
  at::Tensor positions(int64_t tokens) const {
    if (!context) return at::arange(tokens, at::kLong);
    return nn::context::split_positions(tokens, context->size(), context->rank(), cp_zigzag);
  }
  // This rank's share of `local` tokens' positions: the inverse of the split, from the count a
  // rank holds.
  at::Tensor local_positions(int64_t local) const {
    return positions(context ? local * context->size() : local);
  }
  // Dropout outside the split layers: replicated activations share a mask; sequence parts are
  // different positions, so they get their own.
  at::Generator& outer_rng() const {
    return sequence_parallel ? rng->parallel() : rng->replicated();
  }
  // That dropout on activations [b, local tokens, ...]. Under context parallelism a rank draws
  // the mask of the whole sequence, as one process does, and keeps its positions' (its part of
  // the ranks' parts under sequence parallelism, whose masks are each rank's own anyway).
  at::Tensor drop(const at::Tensor& x, bool training) const {
    if (!training || dropout == 0 || !context) {
      return tp::dropout(x, dropout, training, outer_rng());
    }
    const int ranks = context->size();
    const int64_t local = x.size(1);
    std::vector<int64_t> whole = x.sizes().vec();
    whole[1] = local * ranks;
    const at::Tensor scale = tp::dropout(at::ones(whole, x.options()), dropout, true, outer_rng());
    return x * (sequence_parallel ? scale.narrow(1, context->rank() * local, local)
                                  : scale.index_select(1, positions(local * ranks).to(x.device())));
  }
  // Attention dropout's seed for one layer's forward (nn/context/Attention.h: the mask is a
  // hash of it and each weight's place): drawn from the rank's own generator, its heads' own.
  nn::context::Dropout attention_dropout(bool training) const {
    nn::context::Dropout d;
    if (!training || dropout == 0) return d;
    d.p = dropout;
    d.seed = at::randint(0, std::numeric_limits<int64_t>::max(), {1}, rng->parallel(), at::kLong)
                 .item<int64_t>();
    return d;
  }
};

// LayerNorm (with or without its bias) or RMSNorm (as Hugging Face's LlamaRMSNorm: half-precision
// inputs normalized in float32) over the last `width` features: the model's, or with `width`
// given each head's RMSNorm (qk_norm). Parameters "weight" and "bias", as torch::nn::LayerNorm's.
struct NormImpl : torch::nn::Module {
  explicit NormImpl(const GptConfig& c) : NormImpl(c, c.width, c.norm == "rmsnorm") {}
  NormImpl(const GptConfig& c, int64_t width_, bool rms_)
      : width(width_), rms(rms_), eps(c.norm_eps) {
    weight = register_parameter("weight", nn::new_parameter({width}, nn::InitRule::constant(1)));
    if (!rms && c.bias) {
      bias = register_parameter("bias", nn::new_parameter({width}, nn::InitRule::constant(0)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    if (!rms) return at::layer_norm(x, {width}, weight, bias, eps);
    const bool low = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    const at::Tensor h = low ? x.to(at::kFloat) : x;
    const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
    return weight * (low ? normed.to(x.scalar_type()) : normed);
  }
  int64_t width;
  bool rms;
  double eps;
  at::Tensor weight, bias;
};
TORCH_MODULE(Norm);

// Rotary position embeddings on [b, heads, t, d] (Hugging Face's Llama: each head's two halves
// rotated together, angles position x theta^(-2i/d), computed in float64) for tokens at
// `positions` [t] (their global positions under context parallelism), or [b, t] (each
// sequence's own: packed documents' positions restart).
at::Tensor rotary(const at::Tensor& x, double theta, const at::Tensor& positions) {
  const int64_t d = x.size(3);
  const at::Tensor inverse =
      at::pow(theta, at::arange(0, d, 2, at::kDouble) / static_cast<double>(d)).reciprocal();
  at::Tensor angles = positions.to(at::kCPU, at::kDouble).unsqueeze(-1) * inverse;
  angles = at::cat({angles, angles}, -1);
  if (angles.dim() == 3) angles = angles.unsqueeze(1);  // [b, 1, t, d]
  const auto options = x.options();
  const at::Tensor cos = angles.cos().to(options), sin = angles.sin().to(options);
  const at::Tensor turned = at::cat({-x.narrow(-1, d / 2, d / 2), x.narrow(-1, 0, d / 2)}, -1);
  return x * cos + turned * sin;
}

// SwiGLU on fc1's interleaved output h [..., 2 x ffn] (gate, up, gate, up, ...): silu(gate) x up.
// One function rather than autograd's strided selects: the halves are split into contiguous
// tensors once (elementwise kernels on stride-2 views run several times slower), and the
// gradient is written interleaved in place, where autograd's select backward zero-fills two
// tensors of h's size and adds them. Saves what autograd would (gate, up, silu(gate)).
struct InterleavedSwiGlu : torch::autograd::Function<InterleavedSwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h) {
    const at::Tensor halves = h.unflatten(-1, {h.size(-1) / 2, 2}).movedim(-1, 0).contiguous();
    const at::Tensor gate = halves[0], up = halves[1];
    const at::Tensor activated = at::silu(gate);
    ctx->save_for_backward({gate, up, activated});
    return activated * up;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1], &activated = saved[2];
    const at::Tensor dy = grads[0].contiguous();
    std::vector<int64_t> shape = gate.sizes().vec();
    shape.push_back(2);
    at::Tensor dh = at::empty(shape, gate.options());
    at::Tensor dgate = dh.select(-1, 0), dup = dh.select(-1, 1);
    at::silu_backward_out(dgate, dy * up, gate);
    at::mul_out(dup, dy, activated);
    return {dh.flatten(-2)};
  }
};

struct GptEmbeddingImpl : torch::nn::Module {
  GptEmbeddingImpl(const GptConfig& c, Shared shared)
      : token(tp::VocabParallelEmbeddingOptions(c.vocab, c.width)
                  .init_std(0.02)
                  .sequence_parallel(shared.sequence_parallel),
              shared.group),
        shared(std::move(shared)) {
    register_module("token", token);
    if (c.position == "learned") {
      position = register_module(
          "position",
          torch::nn::Embedding(
              torch::nn::EmbeddingOptions(c.context, c.width)
                  ._weight(nn::new_parameter({c.context, c.width}, nn::InitRule::normal(0.02)))));
    }
    context = c.context;
  }
  at::Tensor forward(const at::Tensor& ids) {
    DTRAIN_CHECK_INPUT(ids.dim() == 2 && ids.scalar_type() == at::kLong,
                       "the GPT model takes token ids [batch, time] as int64, got ", ids.sizes(),
                       " ", ids.scalar_type());
    int64_t t = ids.size(1);
    DTRAIN_CHECK_INPUT(t <= context, "a sequence of ", t,
                       " tokens is longer than the model's context of ", context);
    // Packed sequences: the documents of the whole sequences, for every block's attention.
    if (shared.packed) *shared.packed = nn::context::document_index(ids, shared.document_end);
    // Context parallelism: this rank's positions of the sequence.
    const at::Tensor positions = shared.positions(t);
    const at::Tensor mine = shared.context ? ids.index_select(1, positions.to(ids.device())) : ids;
    t = mine.size(1);
    int64_t first = 0, count = t;
    if (shared.sequence_parallel) {
      DTRAIN_CHECK_INPUT(t % shared.size() == 0, "sequence parallelism splits a sequence of ", t,
                         " tokens over ", shared.size(),
                         " tensor-parallel ranks: the length must be a multiple of it");
      count = t / shared.size();
      first = shared.rank() * count;
    }
    at::Tensor h = token(mine);
    if (position && shared.packed) {  // each token's position within its document
      h = h + position(shared.packed->positions.index_select(1, positions.to(ids.device()))
                           .narrow(1, first, count));
    } else if (position) {
      h = h + position(positions.narrow(0, first, count).to(ids.device())).unsqueeze(0);
    }
    return shared.drop(h, is_training());
  }
  tp::VocabParallelEmbedding token;
  torch::nn::Embedding position{nullptr};
  int64_t context = 0;
  Shared shared;
};
TORCH_MODULE(GptEmbedding);

// Attention's heads and the MLP's hidden columns are split over the tensor-parallel group: QKV
// and fc1 column-parallel, proj and fc2 row-parallel. With as many key/value heads as query heads
// QKV is one layer whose output features are ordered [head, (query, key, value), head dim], so a
// contiguous block of them is whole heads (Megatron's layout). With fewer (grouped-query
// attention) the projections are three layers, q, k and v, so that when the group has more ranks
// than key/value heads each head can be held by several ranks (vLLM's replication): rank r takes
// query heads [r H / T, (r + 1) H / T) and key/value head r / (T / KV), every query head staying
// with the key/value head that serves it. A SwiGLU fc1 interleaves gate and up rows so a block
// holds both halves.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptConfig& c, Shared shared_, bool moe_block = false)
      : separate(kv_heads_of(c) < c.heads),
        local_heads(c.heads / shared_.size()),
        local_groups(std::max<int64_t>(1, kv_heads_of(c) / shared_.size())),
        group_heads(local_heads / local_groups),
        head_dim(head_dim_of(c)),
        rope(c.position == "rope"),
        rope_theta(c.rope_theta),
        swiglu(c.mlp == "swiglu"),
        ln1(c),
        qkv(separate ? nullptr
                     : tp::ColumnParallelLinear(
                           tp::ColumnParallelLinearOptions(c.width, 3 * c.heads * head_dim)
                               .bias(c.bias)
                               .init_std(0.02)
                               .sequence_parallel(shared_.sequence_parallel)
                               .overlap_comm(shared_.tp_comm_overlap),
                           shared_.group)),
        q(separate ? projection(c, c.heads * head_dim, 1, shared_) : nullptr),
        k(separate
              ? projection(c, kv_heads_of(c) * head_dim, key_value_replicas(c, shared_), shared_)
              : nullptr),
        v(separate
              ? projection(c, kv_heads_of(c) * head_dim, key_value_replicas(c, shared_), shared_)
              : nullptr),
        q_norm(c.qk_norm ? Norm(c, head_dim, true) : nullptr),
        k_norm(c.qk_norm ? Norm(c, head_dim, true) : nullptr),
        proj(tp::RowParallelLinearOptions(c.heads * head_dim, c.width)
                 .bias(c.bias)
                 .init_std(0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)))
                 .sequence_parallel(shared_.sequence_parallel),
             shared_.group),
        ln2(c),
        fc1(moe_block ? nullptr
                      : tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(
                                                     c.width, (swiglu ? 2 : 1) * ffn_width_of(c))
                                                     .bias(c.bias)
                                                     .init_std(0.02)
                                                     .sequence_parallel(shared_.sequence_parallel)
                                                     .overlap_comm(shared_.tp_comm_overlap),
                                                 shared_.group)),
        fc2(moe_block ? nullptr
                      : tp::RowParallelLinear(
                            tp::RowParallelLinearOptions(ffn_width_of(c), c.width)
                                .bias(c.bias)
                                .init_std(0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)))
                                .sequence_parallel(shared_.sequence_parallel),
                            shared_.group)),
        moe(moe_block ? dtrain::nn::Moe(moe_options(c), shared_.experts) : nullptr),
        shared(std::move(shared_)) {
    register_module("ln1", ln1);
    if (separate) {
      register_module("q", q);
      register_module("k", k);
      register_module("v", v);
    } else {
      register_module("qkv", qkv);
    }
    if (q_norm) {
      register_module("q_norm", q_norm);
      register_module("k_norm", k_norm);
    }
    register_module("proj", proj);
    register_module("ln2", ln2);
    if (moe) {
      register_module("moe", moe);
      // Context parallelism: the balance losses over whole sequences.
      if (shared.context) moe->set_sequence_group(shared.context);
    } else {
      register_module("fc1", fc1);
      register_module("fc2", fc2);
    }
  }

  // Ranks holding each key/value head: 1 when the group divides them.
  static int key_value_replicas(const GptConfig& c, const Shared& shared) {
    return shared.size() > kv_heads_of(c) ? static_cast<int>(shared.size() / kv_heads_of(c)) : 1;
  }
  static tp::ColumnParallelLinear projection(const GptConfig& c, int64_t out, int replicas,
                                             const Shared& shared) {
    // The input is gathered (or copied to the group) once for the three, in attention().
    return tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.width, out)
                                        .bias(c.bias)
                                        .init_std(0.02)
                                        .replicas(replicas),
                                    shared.group);
  }

  at::Tensor attention(const at::Tensor& x) {
    const int64_t d = head_dim, heads = local_heads;
    at::Tensor q_, k_, v_;
    if (separate) {
      const at::Tensor h = shared.sequence_parallel ? tp::gather_from_sequence(x, shared.group)
                                                    : tp::copy_to_group(x, shared.group);
      const int64_t b = h.size(0), t = h.size(1);
      q_ = dtrain::nn::linear(h, q->weight, q->bias).view({b, t, heads, d}).transpose(1, 2);
      k_ = dtrain::nn::linear(h, k->weight, k->bias).view({b, t, local_groups, d}).transpose(1, 2);
      v_ = dtrain::nn::linear(h, v->weight, v->bias).view({b, t, local_groups, d}).transpose(1, 2);
    } else {
      // [b, t, local heads x 3 x d]
      const at::Tensor packed = qkv(x);
      const int64_t b = packed.size(0), t = packed.size(1);
      const at::Tensor parts = packed.view({b, t, heads, 3, d});
      q_ = parts.select(3, 0).transpose(1, 2);
      k_ = parts.select(3, 1).transpose(1, 2);
      v_ = parts.select(3, 2).transpose(1, 2);
    }
    return attend(q_, k_, v_);
  }
  // query: [b, local heads, t, d]; key, value: [b, local groups, t, d].
  at::Tensor attend(at::Tensor query, at::Tensor key, at::Tensor value) {
    const int64_t b = query.size(0), t = query.size(2), d = head_dim, heads = local_heads;
    // The tokens' global positions (this rank's share under context parallelism).
    const at::Tensor positions = shared.local_positions(t);
    // Packed sequences: the whole sequences' documents, and rotary angles from the positions
    // within them.
    at::Tensor documents, rope_positions = positions;
    if (shared.packed) {
      DTRAIN_CHECK(shared.packed->index.defined() && shared.packed->index.size(0) == b,
                   "packed sequences: a block ran without its batch's documents (a strategy "
                   "that runs the stages apart must call Model::see_inputs)");
      documents = shared.packed->index;
      rope_positions = shared.packed->positions.index_select(1, positions.to(documents.device()));
    }
    if (q_norm) {  // each head's queries and keys, before their rotation (Qwen3)
      query = q_norm(query);
      key = k_norm(key);
    }
    if (rope) {
      query = rotary(query, rope_theta, rope_positions);
      key = rotary(key, rope_theta, rope_positions);
    }
    const bool training = is_training();
    // (Drawn here, not in the core: a recomputation of the core keeps the same mask.)
    const nn::context::Dropout dropout = shared.attention_dropout(training);
    auto core = [this, b, t, d, heads, dropout, positions,
                 documents](const std::vector<at::Tensor>& qkv) {
      const at::Tensor& q = qkv[0];
      at::Tensor k = qkv[1], v = qkv[2];
      // Over the whole sequence split over the group, within each packed document, or with
      // attention dropout (the key/value heads as they are: the ring and the all-gather send
      // them unexpanded).
      if (shared.context || documents.defined() || dropout.active()) {
        return nn::context::causal_attention(q, k, v, positions.to(q.device()), shared.context,
                                             shared.cp_method, documents, dropout);
      }
      if (group_heads > 1) {  // each key/value head serves its group's query heads
        k = k.unsqueeze(2).expand({b, local_groups, group_heads, t, d}).reshape({b, heads, t, d});
        v = v.unsqueeze(2).expand({b, local_groups, group_heads, t, d}).reshape({b, heads, t, d});
      }
      at::Tensor out;
#if DTRAIN_TORCH_AT_LEAST(2, 0)
      out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
#else
      at::Tensor scores =
          at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
      at::Tensor future = at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);
      scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
      out = at::matmul(at::softmax(scores, -1), v);
#endif
      return out;
    };
    // Selective recomputation keeps only the queries, keys and values (the key/value heads
    // before their expansion to the query heads) of the core's activations. (The core draws
    // nothing: its dropout's seed is drawn above, so no generator is replayed, and a DualPipe-V
    // pair's other thread may draw meanwhile.)
    at::Tensor y = shared.selective && training ? memory::checkpoint(core, {query, key, value}, {})
                                                : core({query, key, value});
    y = y.transpose(1, 2).reshape({b, t, heads * d});
    return shared.drop(proj(y), is_training());
  }
  at::Tensor mlp(const at::Tensor& x) {
    if (moe) return shared.drop(moe(x), is_training());
    at::Tensor h = fc1(x);
    if (swiglu) {
      h = InterleavedSwiGlu::apply(h);
    } else {
      h = at::gelu(h);
    }
    return shared.drop(fc2(h), is_training());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attention(ln1(x));
    return h + mlp(ln2(h));
  }

  bool separate;         // grouped-query attention: q, k and v layers
  int64_t local_heads;   // query heads on this rank
  int64_t local_groups;  // key/value heads on this rank (one, shared, when replicated)
  int64_t group_heads;   // query heads per key/value head on this rank
  int64_t head_dim;
  bool rope;
  double rope_theta;
  bool swiglu;
  Norm ln1;
  tp::ColumnParallelLinear qkv, q, k, v;
  Norm q_norm, k_norm;  // qk_norm's (null: none)
  tp::RowParallelLinear proj;
  Norm ln2;
  tp::ColumnParallelLinear fc1;
  tp::RowParallelLinear fc2;
  dtrain::nn::Moe moe{nullptr};
  Shared shared;
};
TORCH_MODULE(GptBlock);

// Under tensor parallelism the output is this rank's block of the logits (vocab-parallel).
struct GptHeadImpl : torch::nn::Module {
  GptHeadImpl(const GptConfig& c, const GptEmbedding& embedding, Shared shared_)
      : ln(c), shared(std::move(shared_)) {
    register_module("ln", ln);
    if (c.tied_embeddings) {
      tied = embedding;  // not registered: the parameter belongs to the embedding
    } else {
      out = register_module(
          "out", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.width, c.vocab)
                                              .bias(false)
                                              .init_std(0.02)
                                              .sequence_parallel(shared.sequence_parallel)
                                              .overlap_comm(shared.tp_comm_overlap),
                                          shared.group));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    if (out) return out(ln(x));
    const at::Tensor h = shared.sequence_parallel ? tp::gather_from_sequence(ln(x), shared.group)
                                                  : tp::copy_to_group(ln(x), shared.group);
    return dtrain::nn::linear(h, tied->token->weight);
  }
  int64_t vocab_start() const { return out ? out->output_start() : tied->token->vocab_start(); }
  Norm ln;
  tp::ColumnParallelLinear out{nullptr};
  GptEmbedding tied{nullptr};
  Shared shared;
};
TORCH_MODULE(GptHead);

struct GptImpl : torch::nn::Module, tp::TensorParallelModule {
  GptImpl(const GptConfig& c, const Shared& shared)
      : embedding(c, shared),
        head(nullptr),
        sequence_parallel(shared.sequence_parallel),
        split_heads_norms(c.qk_norm && shared.group) {
    register_module("embedding", embedding);
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks->push_back(GptBlock(c, shared, is_moe_block(c, i)));
    }
    register_module("blocks", blocks);
    head = register_module("head", GptHead(c, embedding, shared));
    segments = shared.selective ? 0 : memory::parse_segments(c.checkpointing, c.layers);
    generators = {shared.rng->replicated(), shared.rng->parallel()};
  }
  at::Tensor block(size_t i, const at::Tensor& h) {
    return blocks->ptr<GptBlockImpl>(i)->forward(h);
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = embedding(ids);
    std::vector<memory::SegmentFn> functions;
    std::vector<std::vector<at::Tensor>> parameters;
    for (size_t i = 0; i < blocks->size(); ++i) {
      functions.push_back([this, i](const at::Tensor& x) { return block(i, x); });
      parameters.push_back(blocks[i]->parameters());
    }
    h = segments > 1 ? memory::checkpoint_stages(functions, parameters, segments, h, generators)
                     : [&] {
                         for (auto& f : functions) h = f(h);
                         return h;
                       }();
    return head(h);
  }
  std::vector<Stage> stages() {
    std::vector<Stage> out;
    std::vector<std::shared_ptr<torch::nn::Module>> head_modules{head.ptr()};
    out.push_back(
        {"embedding", {embedding.ptr()}, [this](const at::Tensor& ids) { return embedding(ids); }});
    for (size_t i = 0; i < blocks->size(); ++i) {
      Stage stage{"blocks." + std::to_string(i), {blocks[i]}, [this, i](const at::Tensor& h) {
                    return block(i, h);
                  }};
      stage.checkpoint = segments > 1;
      stage.generators = generators;
      out.push_back(stage);
    }
    out.push_back({"head", head_modules, [this](const at::Tensor& h) { return head(h); }});
    return out;
  }

  tp::ParameterSplits local_splits() const override { return {}; }
  // Under sequence parallelism each rank's LayerNorms, position embeddings and the biases
  // added after a reduce-scatter see only its part of the sequence. Under tensor parallelism
  // each rank's heads' norms (qk_norm's weights, shared by the heads) see only its heads.
  std::vector<std::string> partial_gradients() const override {
    std::vector<std::string> wanted;
    for (size_t i = 0; split_heads_norms && i < blocks->size(); ++i) {
      const std::string b = "blocks." + std::to_string(i) + ".";
      wanted.push_back(b + "q_norm.weight");
      wanted.push_back(b + "k_norm.weight");
    }
    if (sequence_parallel) {
      for (const char* p : {"embedding.position.weight", "head.ln.weight", "head.ln.bias"}) {
        wanted.push_back(p);
      }
    }
    for (size_t i = 0; sequence_parallel && i < blocks->size(); ++i) {
      const std::string b = "blocks." + std::to_string(i) + ".";
      for (const char* p :
           {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias", "fc2.bias"}) {
        wanted.push_back(b + p);
      }
      // A mixture of experts routes each rank's tokens through experts replicated over the
      // group (Megatron's expert tensor parallelism of 1).
      for (const char* p : {"moe.router", "moe.gate", "moe.up", "moe.down", "moe.shared_gate",
                            "moe.shared_up", "moe.shared_down"}) {
        wanted.push_back(b + p);
      }
    }
    std::vector<std::string> names;  // those the architecture has
    const auto present = named_parameters();
    for (auto& name : wanted) {
      if (present.find(name) != nullptr) names.push_back(std::move(name));
    }
    return names;
  }

  GptEmbedding embedding;
  torch::nn::ModuleList blocks;
  GptHead head;
  int64_t segments = 1;
  // The dropout generators (replayed when a segment is recomputed).
  std::vector<at::Generator> generators;
  bool sequence_parallel = false;
  bool split_heads_norms = false;  // qk_norm over a tensor-parallel group
};

}  // namespace

void validate(const GptConfig& c) {
  DTRAIN_CHECK_INPUT(c.vocab >= 2, "the GPT model needs a vocabulary of at least 2, got ", c.vocab);
  DTRAIN_CHECK_INPUT(c.layers >= 1, "--layers must be >= 1, got ", c.layers);
  DTRAIN_CHECK_INPUT(c.heads >= 1, "--heads must be >= 1, got ", c.heads);
  DTRAIN_CHECK_INPUT(c.head_dim >= 0, "--head-dim must be >= 0 (0: --width / --heads), got ",
                     c.head_dim);
  DTRAIN_CHECK_INPUT(c.width >= 1 && (c.head_dim > 0 || c.width % c.heads == 0), "--width (",
                     c.width, ") must be a positive multiple of --heads (", c.heads,
                     "), or give each head's width (--head-dim)");
  DTRAIN_CHECK_INPUT(c.context >= 1, "--context must be >= 1, got ", c.context);
  DTRAIN_CHECK_INPUT(c.dropout >= 0 && c.dropout < 1, "--dropout must be in [0, 1), got ",
                     c.dropout);
  DTRAIN_CHECK_INPUT(c.kv_heads >= 0 && kv_heads_of(c) <= c.heads && c.heads % kv_heads_of(c) == 0,
                     "--kv-heads (", c.kv_heads, ") must divide --heads (", c.heads, ")");
  DTRAIN_CHECK_INPUT(c.ffn_width >= 0, "--ffn-width must be >= 0, got ", c.ffn_width);
  DTRAIN_CHECK_INPUT(c.norm == "layernorm" || c.norm == "rmsnorm",
                     "the norm must be layernorm or rmsnorm, got '", c.norm, "'");
  DTRAIN_CHECK_INPUT(c.norm_eps > 0, "--norm-eps must be > 0, got ", c.norm_eps);
  DTRAIN_CHECK_INPUT(c.position == "learned" || c.position == "rope",
                     "the position embedding must be learned or rope, got '", c.position, "'");
  DTRAIN_CHECK_INPUT(
      c.position != "rope" || head_dim_of(c) % 2 == 0,
      "rotary embeddings need an even head width: ",
      c.head_dim > 0 ? "--head-dim " : concat("--width ", c.width, " / --heads ", c.heads, " is "),
      head_dim_of(c));
  DTRAIN_CHECK_INPUT(c.rope_theta > 0, "--rope-theta must be > 0, got ", c.rope_theta);
  DTRAIN_CHECK_INPUT(c.mlp == "gelu" || c.mlp == "swiglu", "the MLP must be gelu or swiglu, got '",
                     c.mlp, "'");
  DTRAIN_CHECK_INPUT(c.moe_experts >= 0, "--moe-experts must be >= 0 (0: dense), got ",
                     c.moe_experts);
  if (c.moe_experts == 0) return;
  DTRAIN_CHECK_INPUT(c.mlp == "swiglu",
                     "--moe-experts: the experts are SwiGLU MLPs: use --model llama");
  DTRAIN_CHECK_INPUT(c.moe_every >= 1, "--moe-every must be >= 1, got ", c.moe_every);
  DTRAIN_CHECK_INPUT(c.moe_first_dense >= 0 && c.moe_first_dense < c.layers,
                     "--moe-first-dense must be in [0, --layers ", c.layers, "), got ",
                     c.moe_first_dense);
  DTRAIN_CHECK_INPUT(c.moe_ffn_width >= 0, "--moe-ffn-width must be >= 0, got ", c.moe_ffn_width);
  DTRAIN_CHECK_INPUT(c.moe_aux_loss >= 0 && c.moe_z_loss >= 0,
                     "--moe-aux-loss and --moe-z-loss must be >= 0, got ", c.moe_aux_loss, " and ",
                     c.moe_z_loss);
  // Whole blocks recomputed run their first forward without autograd: the balance losses taken
  // from it would have no gradient.
  DTRAIN_CHECK_INPUT(
      (c.moe_aux_loss == 0 && c.moe_z_loss == 0) || c.checkpointing == "none" ||
          c.checkpointing == "selective",
      "--moe-aux-loss / --moe-z-loss with --checkpointing ", c.checkpointing,
      ": a recomputed block's balance losses would get no gradient; use --checkpointing "
      "selective, or set both to 0 (the auxiliary-loss-free bias needs no loss)");
  // Under sequence parallelism each rank's layers route its part of the sequence only.
  DTRAIN_CHECK_INPUT((c.moe_aux_loss == 0 && c.moe_z_loss == 0) || !c.sequence_parallel,
                     "--moe-aux-loss / --moe-z-loss with --sequence-parallel: not built yet "
                     "(each rank's balance losses would see its part of the sequence only); set "
                     "both to 0 (--moe-bias-rate balances without a loss)");
  dtrain::nn::validate(moe_options(c));
}

bool is_moe_block(const GptConfig& c, int64_t index) {
  return c.moe_experts > 0 && index >= c.moe_first_dense &&
         (index - c.moe_first_dense) % c.moe_every == 0;
}

void llama_preset(GptConfig& c) {
  c.norm = "rmsnorm";
  c.position = "rope";
  c.mlp = "swiglu";
  c.bias = false;
}

int64_t kv_heads_of(const GptConfig& c) { return c.kv_heads > 0 ? c.kv_heads : c.heads; }

int64_t head_dim_of(const GptConfig& c) {
  return c.head_dim > 0 ? c.head_dim : c.width / std::max<int64_t>(c.heads, 1);
}

int64_t ffn_width_of(const GptConfig& c) {
  if (c.ffn_width > 0) return c.ffn_width;
  if (c.mlp != "swiglu") return 4 * c.width;
  return (8 * c.width / 3 + 63) / 64 * 64;
}

int64_t expert_ffn_width_of(const GptConfig& c) {
  return c.moe_ffn_width > 0 ? c.moe_ffn_width : ffn_width_of(c);
}

void check_context_parallel(const GptConfig& c, int cp, int tp) {
  DTRAIN_CHECK_INPUT(cp >= 1, "--context-parallel must be >= 1, got ", cp);
  DTRAIN_CHECK_INPUT(
      c.cp_method == "ring" || c.cp_method == "allgather" || c.cp_method == "ulysses",
      "--cp-method must be ring, allgather or ulysses, got '", c.cp_method, "'");
  if (cp == 1) return;
  const int64_t chunks = c.cp_zigzag ? 2 * cp : cp;
  DTRAIN_CHECK_INPUT(c.context % chunks == 0, "--context-parallel ", cp, " cuts the --context of ",
                     c.context, " tokens into ", chunks, " chunks",
                     c.cp_zigzag ? " (two mirrored ones a rank: --cp-split zigzag)" : "",
                     ": it must be a multiple of ", chunks);
  DTRAIN_CHECK_INPUT(!c.sequence_parallel || tp <= 1 || (c.context / cp) % tp == 0,
                     "--sequence-parallel splits each rank's ", c.context / cp,
                     " tokens (--context ", c.context, " / --context-parallel ", cp,
                     ") over --tensor-parallel ", tp, ": it must be a multiple of it");
  const int64_t heads = c.heads / std::max(1, tp);
  DTRAIN_CHECK_INPUT(c.cp_method != "ulysses" || heads % cp == 0, "--cp-method ulysses hands the ",
                     heads, " attention heads of a rank",
                     tp > 1 ? " (--heads / --tensor-parallel)" : "",
                     " out over --context-parallel ", cp, ": it must divide them");
}

Model make_gpt(const GptConfig& config, comm::CommunicatorPtr tensor_parallel, bool deferred,
               comm::CommunicatorPtr expert_parallel, comm::CommunicatorPtr context_parallel) {
  validate(config);
  Shared shared;
  if (context_parallel && context_parallel->size() > 1) {
    check_context_parallel(config, context_parallel->size(),
                           tensor_parallel ? tensor_parallel->size() : 1);
    shared.context = context_parallel;
    shared.cp_method = config.cp_method;
    shared.cp_zigzag = config.cp_zigzag;
  }
  if (config.document_end >= 0) {
    DTRAIN_CHECK_INPUT(config.document_end < config.vocab, "the end-of-document token ",
                       config.document_end, " is not in the vocabulary of ", config.vocab);
    shared.document_end = config.document_end;
    shared.packed = std::make_shared<nn::context::Documents>();
  }
  if (expert_parallel && expert_parallel->size() > 1) {
    DTRAIN_CHECK_INPUT(config.moe_experts > 0, "--expert-parallel ", expert_parallel->size(),
                       " splits a mixture of experts: give the model --moe-experts");
    shared.experts = expert_parallel;
  }
  shared.group = tensor_parallel && tensor_parallel->size() > 1 ? tensor_parallel : nullptr;
  shared.dropout = config.dropout;
  shared.sequence_parallel = config.sequence_parallel && shared.group;
  shared.tp_comm_overlap = config.tp_comm_overlap && shared.group;
  shared.selective = config.checkpointing == "selective";
  const int ranks = shared.size();
  DTRAIN_CHECK_INPUT(config.heads % ranks == 0, "--heads (", config.heads,
                     ") must be a multiple of --tensor-parallel (", ranks, ")");
  DTRAIN_CHECK_INPUT(kv_heads_of(config) % ranks == 0 || ranks % kv_heads_of(config) == 0,
                     "--kv-heads (", kv_heads_of(config), ") and --tensor-parallel (", ranks,
                     "): one must divide the other (each rank takes whole key/value heads, or "
                     "shares one with --tensor-parallel / --kv-heads ranks)");
  DTRAIN_CHECK_INPUT(config.vocab >= ranks, "a vocabulary of ", config.vocab,
                     " cannot be split over ", ranks, " tensor-parallel ranks");
  // The same on every rank built from the same seed.
  uint64_t dropout_seed = 0;
  uint64_t init_seed = 0;
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    dropout_seed = generator.get<at::CPUGeneratorImpl>()->random64();
    // Every parameter's values are drawn from this seed and its name (nn/DeferredInit.h): the
    // same on every rank, whatever part of them a rank keeps.
    init_seed = generator.get<at::CPUGeneratorImpl>()->random64();
  }
  shared.rng =
      std::make_shared<tp::RngTracker>(dropout_seed, shared.group ? shared.group->rank() : 0);
  auto init = std::make_shared<nn::DeferredInit>(init_seed);
  std::shared_ptr<GptImpl> module;
  {
    nn::InitScope scope(*init);
    module = std::make_shared<GptImpl>(config, shared);
  }
  init->bind(*module);
  Model model(module);
  if (deferred) {
    model.deferred = init;  // placeholders: the strategy draws what the rank keeps
  } else {
    init->materialize_all();
  }
  model.stages = module->stages();
  if (shared.packed) {
    // A pipeline's later stages: the documents of the micro-batch they run, from its tokens.
    model.see_inputs = [packed = shared.packed, end = shared.document_end](const at::Tensor& ids) {
      *packed = nn::context::document_index(ids, end);
    };
  }
  if (shared.group) {
    const int64_t start = module->head->vocab_start();
    model.loss = [group = shared.group, start](const at::Tensor& logits,
                                               const at::Tensor& targets) {
      return tp::vocab_parallel_cross_entropy(logits, targets, group, start);
    };
    model.predict = [group = shared.group, start](const at::Tensor& logits) {
      return tp::vocab_parallel_argmax(logits, group, start);
    };
  }
  if (shared.context) {
    // The targets of this rank's positions; the predictions of every rank's, in order.
    model.loss = [shared, base = model.loss](const at::Tensor& logits, const at::Tensor& targets) {
      const at::Tensor mine =
          targets.index_select(1, shared.positions(targets.size(1)).to(targets.device()));
      return base ? base(logits, mine)
                  : torch::nn::functional::cross_entropy(logits.flatten(0, -2), mine.reshape({-1}));
    };
    model.predict = [shared, base = model.predict](const at::Tensor& logits) {
      const at::Tensor local = (base ? base(logits) : logits.argmax(-1)).contiguous();  // [b, t]
      const int ranks = shared.context->size();
      const int64_t t = local.size(1);
      at::Tensor all = at::empty({ranks * local.size(0), t}, local.options());
      shared.context->allgather(all, local)->wait();
      std::vector<at::Tensor> positions;
      for (int r = 0; r < ranks; ++r) {
        positions.push_back(nn::context::split_positions(t * ranks, ranks, r, shared.cp_zigzag));
      }
      at::Tensor whole = at::empty({local.size(0), t * ranks}, local.options());
      whole.index_copy_(
          1, at::cat(positions).to(local.device()),
          all.view({ranks, local.size(0), t}).permute({1, 0, 2}).reshape({local.size(0), -1}));
      return whole;
    };
  }
  if (config.moe_experts > 0 && (config.moe_aux_loss > 0 || config.moe_z_loss > 0)) {
    // The language model's loss (vocabulary-parallel under tensor parallelism) plus the MoE
    // blocks' balance losses of the forward just run (those of layers that add them in their
    // own backward left out: a pipeline's stages).
    std::vector<std::shared_ptr<dtrain::nn::MoeImpl>> layers;
    for (size_t i = 0; i < module->blocks->size(); ++i) {
      auto block = module->blocks->ptr<GptBlockImpl>(i);
      if (block->moe) layers.push_back(block->moe.ptr());
    }
    model.loss = [layers, base = model.loss](const at::Tensor& logits, const at::Tensor& targets) {
      at::Tensor loss =
          base ? base(logits, targets)
               : torch::nn::functional::cross_entropy(logits.flatten(0, -2), targets.reshape({-1}));
      for (const auto& layer : layers) {
        if (layer->losses_in_backward()) continue;
        const auto& stats = layer->stats();
        const double aux = layer->options.aux_loss, z = layer->options.z_loss;
        if (aux > 0 && stats.aux_loss.defined()) loss = loss + aux * stats.aux_loss;
        if (z > 0 && stats.z_loss.defined()) loss = loss + z * stats.z_loss;
      }
      return loss;
    };
  }
  return model;
}

std::string to_json(const GptConfig& c) {
  nlohmann::json json{{"model", "gpt"},
                      {"vocab", c.vocab},
                      {"layers", c.layers},
                      {"heads", c.heads},
                      {"width", c.width},
                      {"context", c.context},
                      {"dropout", c.dropout},
                      {"tied_embeddings", c.tied_embeddings},
                      {"kv_heads", kv_heads_of(c)},
                      {"ffn_width", ffn_width_of(c)},
                      {"norm", c.norm},
                      {"norm_eps", c.norm_eps},
                      {"position", c.position},
                      {"rope_theta", c.rope_theta},
                      {"mlp", c.mlp},
                      {"bias", c.bias}};
  // (written where they differ from the defaults: earlier readers take the file as it was)
  if (c.head_dim > 0) json["head_dim"] = c.head_dim;
  if (c.qk_norm) json["qk_norm"] = true;
  if (c.moe_experts > 0) {
    json["moe"] = {{"experts", c.moe_experts},
                   {"top_k", c.moe_top_k},
                   {"shared", c.moe_shared_experts},
                   {"every", c.moe_every},
                   {"first_dense", c.moe_first_dense},
                   {"capacity", c.moe_capacity},
                   {"score", c.moe_score},
                   {"ffn_width", c.moe_ffn_width},
                   {"aux_loss", c.moe_aux_loss},
                   {"z_loss", c.moe_z_loss}};
    if (!c.moe_normalize) json["moe"]["normalize"] = false;
  }
  return json.dump();
}

GptConfig gpt_config_from_json(const std::string& text, const std::string& origin) {
  GptConfig c;
  try {
    const auto json = nlohmann::json::parse(text);
    c.vocab = json.at("vocab").get<int64_t>();
    c.layers = json.at("layers").get<int64_t>();
    c.heads = json.at("heads").get<int64_t>();
    c.width = json.at("width").get<int64_t>();
    c.context = json.at("context").get<int64_t>();
    c.dropout = json.at("dropout").get<double>();
    c.tied_embeddings = json.at("tied_embeddings").get<bool>();
    // The architecture's fields (checkpoints from before them are GPT-2's).
    c.kv_heads = json.value("kv_heads", c.kv_heads);
    c.ffn_width = json.value("ffn_width", c.ffn_width);
    c.norm = json.value("norm", c.norm);
    c.norm_eps = json.value("norm_eps", c.norm_eps);
    c.position = json.value("position", c.position);
    c.rope_theta = json.value("rope_theta", c.rope_theta);
    c.mlp = json.value("mlp", c.mlp);
    c.bias = json.value("bias", c.bias);
    c.head_dim = json.value("head_dim", c.head_dim);
    c.qk_norm = json.value("qk_norm", c.qk_norm);
    if (json.contains("moe")) {
      const auto& moe = json.at("moe");
      c.moe_experts = moe.at("experts").get<int64_t>();
      c.moe_top_k = moe.at("top_k").get<int64_t>();
      c.moe_shared_experts = moe.at("shared").get<int64_t>();
      c.moe_every = moe.at("every").get<int64_t>();
      c.moe_first_dense = moe.at("first_dense").get<int64_t>();
      c.moe_capacity = moe.at("capacity").get<double>();
      c.moe_score = moe.at("score").get<std::string>();
      c.moe_ffn_width = moe.at("ffn_width").get<int64_t>();
      c.moe_aux_loss = moe.at("aux_loss").get<double>();
      c.moe_z_loss = moe.at("z_loss").get<double>();
      c.moe_normalize = moe.value("normalize", c.moe_normalize);
    }
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_THROW(InputError, origin,
                 ": the GPT model description is incomplete: ", json_error_text(e.what()));
  }
  validate(c);
  return c;
}

int64_t gpt_parameter_count(const GptConfig& c) {
  const int64_t w = c.width, d = head_dim_of(c), f = ffn_width_of(c);
  const int64_t b = c.bias ? 1 : 0;
  const int64_t qkv = (c.heads + 2 * kv_heads_of(c)) * d, a = c.heads * d;
  const int64_t mlp_in = (c.mlp == "swiglu" ? 2 : 1) * f;
  const int64_t norm = c.norm == "layernorm" ? w * (1 + b) : w;
  const int64_t block = 2 * norm + (c.qk_norm ? 2 * d : 0) + (w * qkv + b * qkv) + (a * w + b * w) +
                        (w * mlp_in + b * mlp_in) + (f * w + b * w);
  int64_t blocks = c.layers * block;
  if (c.moe_experts > 0) {  // an MoE block: the router, E experts and the shared ones
    const int64_t fe = expert_ffn_width_of(c);
    const int64_t dense = (w * mlp_in + b * mlp_in) + (f * w + b * w);
    const int64_t moe = c.moe_experts * w + 3 * (c.moe_experts + c.moe_shared_experts) * fe * w;
    for (int64_t i = 0; i < c.layers; ++i) {
      if (is_moe_block(c, i)) blocks += moe - dense;
    }
  }
  return c.vocab * w + (c.position == "learned" ? c.context * w : 0) + blocks + norm +
         (c.tied_embeddings ? 0 : w * c.vocab);
}

int64_t gpt_active_parameter_count(const GptConfig& c) {
  int64_t active = gpt_parameter_count(c);
  if (c.moe_experts > 0) {
    const int64_t fe = expert_ffn_width_of(c);
    for (int64_t i = 0; i < c.layers; ++i) {
      if (is_moe_block(c, i)) active -= 3 * (c.moe_experts - c.moe_top_k) * fe * c.width;
    }
  }
  return active;
}

double gpt_training_flops_per_token(const GptConfig& c) {
  const int64_t w = c.width, d = head_dim_of(c), f = ffn_width_of(c);
  const int64_t qkv = (c.heads + 2 * kv_heads_of(c)) * d, a = c.heads * d;
  const int64_t mlp_in = (c.mlp == "swiglu" ? 2 : 1) * f;
  double matmul_weights =
      static_cast<double>(c.layers) * static_cast<double>(w * qkv + a * w + w * mlp_in + f * w) +
      static_cast<double>(w) * static_cast<double>(c.vocab);
  if (c.moe_experts > 0) {  // the active weights: the router, top-k experts and the shared ones
    const int64_t fe = expert_ffn_width_of(c);
    const double active =
        static_cast<double>(c.moe_experts * w + 3 * (c.moe_top_k + c.moe_shared_experts) * fe * w);
    for (int64_t i = 0; i < c.layers; ++i) {
      if (is_moe_block(c, i)) matmul_weights += active - static_cast<double>(w * mlp_in + f * w);
    }
  }
  return 6.0 * matmul_weights + 12.0 * static_cast<double>(c.layers * c.heads * d * c.context);
}

}  // namespace dtrain::models
