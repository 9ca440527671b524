// The GPT-style model (see Gpt.h). Linear layers are ATen's `linear` on 3-D inputs; attention is
// written out (scores, causal mask, softmax, weighted values) as LibTorch 1.13 has no fused
// scaled-dot-product attention.
#include "dtrain/models/Gpt.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "dtrain/common/Error.h"
#include "dtrain/memory/Checkpoint.h"

namespace dtrain::models {

namespace {

void init_linear(torch::nn::Linear& linear, double std) {
  torch::NoGradGuard no_grad;
  linear->weight.normal_(0.0, std);
  if (linear->bias.defined()) linear->bias.zero_();
}

struct GptEmbeddingImpl : torch::nn::Module {
  GptEmbeddingImpl(const GptConfig& c)
      : token(c.vocab, c.width), position(c.context, c.width), dropout(c.dropout) {
    register_module("token", token);
    register_module("position", position);
    register_module("dropout", dropout);
    torch::NoGradGuard no_grad;
    token->weight.normal_(0.0, 0.02);
    position->weight.normal_(0.0, 0.02);
  }
  at::Tensor forward(const at::Tensor& ids) {
    DTRAIN_CHECK_INPUT(ids.dim() == 2 && ids.scalar_type() == at::kLong,
                       "the GPT model takes token ids [batch, time] as int64, got ", ids.sizes(),
                       " ", ids.scalar_type());
    const int64_t t = ids.size(1);
    DTRAIN_CHECK_INPUT(t <= position->weight.size(0), "a sequence of ", t,
                       " tokens is longer than the model's context of ",
                       position->weight.size(0));
    at::Tensor positions = at::arange(t, ids.options());
    return dropout(token(ids) + position(positions).unsqueeze(0));
  }
  torch::nn::Embedding token;
  torch::nn::Embedding position;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(GptEmbedding);

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const GptConfig& c)
      : heads(c.heads),
        ln1(torch::nn::LayerNormOptions({c.width})),
        qkv(c.width, 3 * c.width),
        proj(c.width, c.width),
        ln2(torch::nn::LayerNormOptions({c.width})),
        fc1(c.width, 4 * c.width),
        fc2(4 * c.width, c.width),
        attn_dropout(c.dropout),
        resid_dropout(c.dropout) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("attn_dropout", attn_dropout);
    register_module("resid_dropout", resid_dropout);
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
    init_linear(qkv, 0.02);
    init_linear(proj, residual_std);
    init_linear(fc1, 0.02);
    init_linear(fc2, residual_std);
  }

  at::Tensor attention(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), w = x.size(2), d = w / heads;
    auto parts = qkv(x).split(w, -1);
    auto shape = [&](const at::Tensor& y) { return y.view({b, t, heads, d}).transpose(1, 2); };
    at::Tensor q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
    at::Tensor future = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    at::Tensor weights = attn_dropout(at::softmax(scores, -1));
    at::Tensor y = at::matmul(weights, v).transpose(1, 2).reshape({b, t, w});
    return resid_dropout(proj(y));
  }
  at::Tensor mlp(const at::Tensor& x) { return resid_dropout(fc2(at::gelu(fc1(x)))); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attention(ln1(x));
    return h + mlp(ln2(h));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout attn_dropout, resid_dropout;
};
TORCH_MODULE(GptBlock);

struct GptHeadImpl : torch::nn::Module {
  GptHeadImpl(const GptConfig& c, const GptEmbedding& embedding)
      : ln(torch::nn::LayerNormOptions({c.width})) {
    register_module("ln", ln);
    if (c.tied_embeddings) {
      tied = embedding;  // not registered: the parameter belongs to the embedding
    } else {
      out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(c.width, c.vocab).bias(false)));
      init_linear(out, 0.02);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor& weight = tied ? tied->token->weight : out->weight;
    return at::linear(ln(x), weight);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear out{nullptr};
  GptEmbedding tied{nullptr};
};
TORCH_MODULE(GptHead);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c) : embedding(c), head(nullptr) {
    register_module("embedding", embedding);
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(GptBlock(c));
    register_module("blocks", blocks);
    head = register_module("head", GptHead(c, embedding));
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
    h = segments > 1 ? memory::checkpoint_stages(functions, parameters, segments, h)
                     : [&] {
                         for (auto& f : functions) h = f(h);
                         return h;
                       }();
    return head(h);
  }
  std::vector<Stage> stages() {
    std::vector<Stage> out;
    std::vector<std::shared_ptr<torch::nn::Module>> head_modules{head.ptr()};
    out.push_back({"embedding", {embedding.ptr()},
                   [this](const at::Tensor& ids) { return embedding(ids); }});
    for (size_t i = 0; i < blocks->size(); ++i) {
      Stage stage{"blocks." + std::to_string(i), {blocks[i]},
                  [this, i](const at::Tensor& h) { return block(i, h); }};
      stage.checkpoint = segments > 1;
      out.push_back(stage);
    }
    out.push_back({"head", head_modules, [this](const at::Tensor& h) { return head(h); }});
    return out;
  }

  GptEmbedding embedding;
  torch::nn::ModuleList blocks;
  GptHead head;
  int64_t segments = 1;
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

Model make_gpt(const GptConfig& config) {
  validate(config);
  auto module = std::make_shared<GptImpl>(config);
  Model model(module);
  model.stages = module->stages();
  return model;
}

std::string to_json(const GptConfig& c) {
  return nlohmann::json{{"model", "gpt"},          {"vocab", c.vocab},
                        {"layers", c.layers},      {"heads", c.heads},
                        {"width", c.width},        {"context", c.context},
                        {"dropout", c.dropout},    {"tied_embeddings", c.tied_embeddings}}
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
  const int64_t block = 2 * 2 * w + (w * 3 * w + 3 * w) + (w * w + w) + (w * 4 * w + 4 * w) +
                        (4 * w * w + w);
  return c.vocab * w + c.context * w + c.layers * block + 2 * w +
         (c.tied_embeddings ? 0 : w * c.vocab);
}

}  // namespace dtrain::models
