// The GPT-style model (see Gpt.h). Linear layers are ATen's `linear` on 3-D inputs; attention is
// written out (scores, causal mask, softmax, weighted values) as LibTorch 1.13 has no fused
// scaled-dot-product attention.
#include "dtrain/models/Gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>
#include <mutex>

#include "dtrain/common/Error.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/nn/tensor/CrossEntropy.h"
#include "dtrain/nn/tensor/Layers.h"
#include "dtrain/nn/tensor/Mappings.h"
#include "dtrain/nn/tensor/Random.h"

namespace dtrain::models {

namespace {

namespace tp = nn::tensor;

struct Shared {
  comm::CommunicatorPtr group;  // the tensor-parallel group (null: serial)
  std::shared_ptr<tp::RngTracker> rng;
  double dropout = 0.0;
  // Sequence parallelism: outside attention and the MLP, activations are [b, t / T, h], each
  // rank holding a contiguous part of the sequence.
  bool sequence_parallel = false;
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
  // Dropout outside the split layers: replicated activations share a mask; sequence parts are
  // different positions, so they get their own.
  at::Generator& outer_rng() const {
    return sequence_parallel ? rng->parallel() : rng->replicated();
  }
};

struct GptEmbeddingImpl : torch::nn::Module {
  GptEmbeddingImpl(const GptConfig& c, Shared shared)
      : token(tp::VocabParallelEmbeddingOptions(c.vocab, c.width)
                  .init_std(0.02)
                  .sequence_parallel(shared.sequence_parallel),
              shared.group),
        position(c.context, c.width),
        shared(std::move(shared)) {
    register_module("token", token);
    register_module("position", position);
    torch::NoGradGuard no_grad;
    position->weight.normal_(0.0, 0.02);
  }
  at::Tensor forward(const at::Tensor& ids) {
    DTRAIN_CHECK_INPUT(ids.dim() == 2 && ids.scalar_type() == at::kLong,
                       "the GPT model takes token ids [batch, time] as int64, got ", ids.sizes(),
                       " ", ids.scalar_type());
    const int64_t t = ids.size(1);
    DTRAIN_CHECK_INPUT(t <= position->weight.size(0), "a sequence of ", t,
                       " tokens is longer than the model's context of ", position->weight.size(0));
    int64_t first = 0, count = t;
    if (shared.sequence_parallel) {
      DTRAIN_CHECK_INPUT(t % shared.size() == 0, "sequence parallelism splits a sequence of ", t,
                         " tokens over ", shared.size(),
                         " tensor-parallel ranks: the length must be a multiple of it");
      count = t / shared.size();
      first = shared.rank() * count;
    }
    at::Tensor positions = at::arange(first, first + count, ids.options());
    return tp::dropout(token(ids) + position(positions).unsqueeze(0), shared.dropout, is_training(),
                       shared.outer_rng());
  }
  tp::VocabParallelEmbedding token;
  torch::nn::Embedding position;
  Shared shared;
};
TORCH_MODULE(GptEmbedding);

// Attention's heads and the MLP's hidden columns are split over the tensor-parallel group: QKV
// and fc1 column-parallel, proj and fc2 row-parallel. QKV's output features are ordered
// [head, (q, k, v), head dim] so that a contiguous block of them is whole heads.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptConfig& c, Shared shared_)
      : local_heads(c.heads / shared_.size()),
        ln1(torch::nn::LayerNormOptions({c.width})),
        qkv(tp::ColumnParallelLinearOptions(c.width, 3 * c.width)
                .init_std(0.02)
                .sequence_parallel(shared_.sequence_parallel),
            shared_.group),
        proj(tp::RowParallelLinearOptions(c.width, c.width)
                 .init_std(0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)))
                 .sequence_parallel(shared_.sequence_parallel),
             shared_.group),
        ln2(torch::nn::LayerNormOptions({c.width})),
        fc1(tp::ColumnParallelLinearOptions(c.width, 4 * c.width)
                .init_std(0.02)
                .sequence_parallel(shared_.sequence_parallel),
            shared_.group),
        fc2(tp::RowParallelLinearOptions(4 * c.width, c.width)
                .init_std(0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)))
                .sequence_parallel(shared_.sequence_parallel),
            shared_.group),
        shared(std::move(shared_)) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  at::Tensor attention(const at::Tensor& x) {
    const at::Tensor packed = qkv(x);  // [b, t, local heads x 3 x d] (whole sequence)
    const int64_t b = packed.size(0), t = packed.size(1);
    const int64_t d = packed.size(-1) / (3 * local_heads);
    const at::Tensor heads = packed.view({b, t, local_heads, 3, d});
    auto part = [&](int64_t i) { return heads.select(3, i).transpose(1, 2); };  // [b, h, t, d]
    const at::Tensor q = part(0), k = part(1), v = part(2);
    at::Tensor scores =
        at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
    at::Tensor future = at::ones({t, t}, packed.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    // Each rank's heads are its own: their dropout masks differ across the group.
    at::Tensor weights =
        tp::dropout(at::softmax(scores, -1), shared.dropout, is_training(), shared.rng->parallel());
    at::Tensor y = at::matmul(weights, v).transpose(1, 2).reshape({b, t, local_heads * d});
    return tp::dropout(proj(y), shared.dropout, is_training(), shared.outer_rng());
  }
  at::Tensor mlp(const at::Tensor& x) {
    return tp::dropout(fc2(at::gelu(fc1(x))), shared.dropout, is_training(), shared.outer_rng());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attention(ln1(x));
    return h + mlp(ln2(h));
  }

  int64_t local_heads;
  torch::nn::LayerNorm ln1;
  tp::ColumnParallelLinear qkv;
  tp::RowParallelLinear proj;
  torch::nn::LayerNorm ln2;
  tp::ColumnParallelLinear fc1;
  tp::RowParallelLinear fc2;
  Shared shared;
};
TORCH_MODULE(GptBlock);

// Under tensor parallelism the output is this rank's block of the logits (vocab-parallel).
struct GptHeadImpl : torch::nn::Module {
  GptHeadImpl(const GptConfig& c, const GptEmbedding& embedding, Shared shared_)
      : ln(torch::nn::LayerNormOptions({c.width})), shared(std::move(shared_)) {
    register_module("ln", ln);
    if (c.tied_embeddings) {
      tied = embedding;  // not registered: the parameter belongs to the embedding
    } else {
      out = register_module(
          "out", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.width, c.vocab)
                                              .bias(false)
                                              .init_std(0.02)
                                              .sequence_parallel(shared.sequence_parallel),
                                          shared.group));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    if (out) return out(ln(x));
    const at::Tensor h = shared.sequence_parallel ? tp::gather_from_sequence(ln(x), shared.group)
                                                  : tp::copy_to_group(ln(x), shared.group);
    return at::linear(h, tied->token->weight);
  }
  int64_t vocab_start() const { return out ? out->output_start() : tied->token->vocab_start(); }
  torch::nn::LayerNorm ln;
  tp::ColumnParallelLinear out{nullptr};
  GptEmbedding tied{nullptr};
  Shared shared;
};
TORCH_MODULE(GptHead);

struct GptImpl : torch::nn::Module, tp::TensorParallelModule {
  GptImpl(const GptConfig& c, const Shared& shared)
      : embedding(c, shared), head(nullptr), sequence_parallel(shared.sequence_parallel) {
    register_module("embedding", embedding);
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(GptBlock(c, shared));
    register_module("blocks", blocks);
    head = register_module("head", GptHead(c, embedding, shared));
    segments = memory::parse_segments(c.checkpointing, c.layers);
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
    h = segments > 1 ? memory::checkpoint_stages(functions, parameters, segments, h) : [&] {
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
      out.push_back(stage);
    }
    out.push_back({"head", head_modules, [this](const at::Tensor& h) { return head(h); }});
    return out;
  }

  tp::ParameterSplits local_splits() const override { return {}; }
  // Under sequence parallelism each rank's LayerNorms, position embeddings and the biases
  // added after a reduce-scatter see only its part of the sequence.
  std::vector<std::string> partial_gradients() const override {
    if (!sequence_parallel) return {};
    std::vector<std::string> names{"embedding.position.weight", "head.ln.weight", "head.ln.bias"};
    for (size_t i = 0; i < blocks->size(); ++i) {
      const std::string b = "blocks." + std::to_string(i) + ".";
      for (const char* p :
           {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias", "fc2.bias"}) {
        names.push_back(b + p);
      }
    }
    return names;
  }

  GptEmbedding embedding;
  torch::nn::ModuleList blocks;
  GptHead head;
  int64_t segments = 1;
  bool sequence_parallel = false;
};

}  // namespace

void validate(const GptConfig& c) {
  DTRAIN_CHECK_INPUT(c.vocab >= 2, "the GPT model needs a vocabulary of at least 2, got ", c.vocab);
  DTRAIN_CHECK_INPUT(c.layers >= 1, "--layers must be >= 1, got ", c.layers);
  DTRAIN_CHECK_INPUT(c.heads >= 1, "--heads must be >= 1, got ", c.heads);
  DTRAIN_CHECK_INPUT(c.width >= 1 && c.width % c.heads == 0, "--width (", c.width,
                     ") must be a positive multiple of --heads (", c.heads, ")");
  DTRAIN_CHECK_INPUT(c.context >= 1, "--context must be >= 1, got ", c.context);
  DTRAIN_CHECK_INPUT(c.dropout >= 0 && c.dropout < 1, "--dropout must be in [0, 1), got ",
                     c.dropout);
}

Model make_gpt(const GptConfig& config, comm::CommunicatorPtr tensor_parallel) {
  validate(config);
  Shared shared;
  shared.group = tensor_parallel && tensor_parallel->size() > 1 ? tensor_parallel : nullptr;
  shared.dropout = config.dropout;
  shared.sequence_parallel = config.sequence_parallel && shared.group;
  const int ranks = shared.size();
  DTRAIN_CHECK_INPUT(config.heads % ranks == 0, "--heads (", config.heads,
                     ") must be a multiple of --tensor-parallel (", ranks, ")");
  DTRAIN_CHECK_INPUT(config.vocab >= ranks, "a vocabulary of ", config.vocab,
                     " cannot be split over ", ranks, " tensor-parallel ranks");
  uint64_t dropout_seed = 0;
  {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    // The same on every rank built from the same seed.
    dropout_seed = generator.get<at::CPUGeneratorImpl>()->random64();
  }
  shared.rng =
      std::make_shared<tp::RngTracker>(dropout_seed, shared.group ? shared.group->rank() : 0);
  auto module = std::make_shared<GptImpl>(config, shared);
  Model model(module);
  model.stages = module->stages();
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
  return model;
}

std::string to_json(const GptConfig& c) {
  return nlohmann::json{{"model", "gpt"},       {"vocab", c.vocab},
                        {"layers", c.layers},   {"heads", c.heads},
                        {"width", c.width},     {"context", c.context},
                        {"dropout", c.dropout}, {"tied_embeddings", c.tied_embeddings}}
      .dump();
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
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_THROW(InputError, origin, ": the GPT model description is incomplete: ", e.what());
  }
  validate(c);
  return c;
}

int64_t gpt_parameter_count(const GptConfig& c) {
  const int64_t w = c.width;
  const int64_t block =
      2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w);
  return c.vocab * w + c.context * w + c.layers * block + 2 * w +
         (c.tied_embeddings ? 0 : w * c.vocab);
}

}  // namespace dtrain::models
