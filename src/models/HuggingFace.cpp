// Hugging Face's Llama names and layout (see HuggingFace.h). With grouped-query attention
// dtrain's q, k and v are transformers' q_proj, k_proj and v_proj as they are (query head i
// served by key/value head i / (heads / kv_heads) in both, as transformers' repeat_kv). With as
// many key/value heads as query heads dtrain packs them as qkv, rows ordered
// [head, (query, key, value), head dim]. A mixture of experts is Mixtral's: the router is
// block_sparse_moe.gate, dtrain's stacked experts ([E, ...]) are experts.J.w1 (gate), w3 (up) and
// w2 (down), one tensor per expert. With per-head query/key norms (qk_norm) the decoder is
// Qwen3's (self_attn.q_norm, k_norm), its mixture of experts Qwen3-MoE's: mlp.gate, and
// mlp.experts.J.gate_proj, up_proj and down_proj; its dense blocks are mlp_only_layers.
#include "dtrain/models/HuggingFace.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>
#include <sstream>

#include "dtrain/common/Error.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/tensor/Split.h"

namespace dtrain::models {

using json = nlohmann::json;

namespace {

struct Shapes {
  int64_t width, heads, groups, rep, head_dim, ffn, experts, expert_ffn;
  int64_t attention;  // heads x head_dim: the query projection's outputs
  bool qwen;          // Qwen3's names (q_norm and k_norm; Qwen3-MoE's experts)
};

Shapes shapes_of(const GptConfig& c) {
  Shapes s;
  s.width = c.width;
  s.heads = c.heads;
  s.groups = kv_heads_of(c);
  s.rep = c.heads / s.groups;
  s.head_dim = head_dim_of(c);
  s.ffn = ffn_width_of(c);
  s.experts = c.moe_experts;
  s.expert_ffn = expert_ffn_width_of(c);
  s.attention = c.heads * s.head_dim;
  s.qwen = c.qk_norm;
  return s;
}

void check_llama(const GptConfig& c) {
  std::string why;
  DTRAIN_CHECK_INPUT(has_hugging_face_layout(c, &why), why);
}

std::string layer(int64_t i) { return "model.layers." + std::to_string(i) + "."; }
std::string block(int64_t i) { return "blocks." + std::to_string(i) + "."; }

}  // namespace

bool is_llama_architecture(const GptConfig& c) {
  return c.norm == "rmsnorm" && c.position == "rope" && c.mlp == "swiglu" && !c.bias;
}

bool has_hugging_face_layout(const GptConfig& c, std::string* why) {
  std::ostringstream out;
  if (!is_llama_architecture(c)) {
    out << "Hugging Face's Llama layout needs the Llama architecture (--model llama): this "
        << "decoder has " << c.norm << ", " << c.position << " positions, a " << c.mlp << " MLP"
        << (c.bias ? " and biases" : "");
  } else if (c.moe_experts > 0 && c.qk_norm &&
             (c.moe_score != "softmax" || c.moe_shared_experts > 0)) {
    out << "Hugging Face's layout for a mixture of experts with --qk-norm is Qwen3-MoE's "
        << "(softmax scores, no shared experts): this model has --moe-score " << c.moe_score
        << ", --moe-shared-experts " << c.moe_shared_experts;
  } else if (c.moe_experts > 0 && !c.qk_norm &&
             (c.moe_score != "softmax" || c.moe_shared_experts > 0 || c.moe_every != 1 ||
              c.moe_first_dense != 0 || !c.moe_normalize)) {
    out << "Hugging Face's layout for a mixture of experts is Mixtral's (every block routed, "
        << "softmax scores renormalized over the top k, no shared experts; Qwen3-MoE's with "
        << "--qk-norm): this model has --moe-score " << c.moe_score << ", --moe-shared-experts "
        << c.moe_shared_experts << ", --moe-every " << c.moe_every << ", --moe-first-dense "
        << c.moe_first_dense << (c.moe_normalize ? "" : ", --no-moe-normalize");
  }
  if (why) *why = out.str();
  return out.str().empty();
}

namespace {

// Qwen3-MoE's sparse layers (mlp_only_layers, decoder_sparse_step) as dtrain's first dense blocks
// and a period: InputError naming the fields where no such pair gives them.
void qwen3_moe_layout(const json& j, GptConfig& c, const std::string& origin) {
  const int64_t step = j.value("decoder_sparse_step", int64_t{1});
  DTRAIN_CHECK_INPUT(step >= 1, origin, ": decoder_sparse_step ", step, " (must be >= 1)");
  std::set<int64_t> dense;
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    for (const auto& index : j["mlp_only_layers"]) dense.insert(index.get<int64_t>());
  }
  std::vector<int64_t> sparse;
  for (int64_t i = 0; i < c.layers; ++i) {
    if (!dense.count(i) && (i + 1) % step == 0) sparse.push_back(i);
  }
  DTRAIN_CHECK_INPUT(!sparse.empty(), origin, ": mlp_only_layers and decoder_sparse_step ", step,
                     " leave no mixture-of-experts layer of ", c.layers);
  c.moe_first_dense = sparse.front();
  c.moe_every = sparse.size() > 1 ? sparse[1] - sparse[0] : 1;
  for (int64_t i = 0; i < c.layers; ++i) {
    const bool ours = is_moe_block(c, i);
    const bool theirs = std::find(sparse.begin(), sparse.end(), i) != sparse.end();
    DTRAIN_CHECK_INPUT(ours == theirs, origin, ": mlp_only_layers ",
                       j.value("mlp_only_layers", json::array()).dump(),
                       " with decoder_sparse_step ", step, " make layer ", i,
                       theirs ? " sparse" : " dense",
                       "; dtrain's layout is dense first blocks, then a mixture of experts every "
                       "N blocks (--moe-first-dense ",
                       c.moe_first_dense, " --moe-every ", c.moe_every, " would make it",
                       ours ? " sparse)" : " dense)");
  }
}

}  // namespace

GptConfig llama_config_from_hf(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DTRAIN_THROW(InputError, origin, ": not JSON (", json_error_text(e.what()), ")");
  }
  DTRAIN_CHECK_INPUT(j.is_object(), origin, ": not a JSON object");
  const std::string type = j.value("model_type", std::string());
  DTRAIN_CHECK_INPUT(type == "llama" || type == "mixtral" || type == "qwen3" || type == "qwen3_moe",
                     origin, ": model_type '", type,
                     "'; dtrain reads Llama, Mixtral, Qwen3 and Qwen3-MoE configs (model_type "
                     "llama, mixtral, qwen3, qwen3_moe)");
  const bool qwen = type == "qwen3" || type == "qwen3_moe";
  GptConfig c;
  llama_preset(c);
  c.qk_norm = qwen;
  try {
    if (type == "mixtral") {
      c.moe_experts = j.at("num_local_experts").get<int64_t>();
      const int64_t context = j.at("max_position_embeddings").get<int64_t>();
      c.moe_top_k = j.value("num_experts_per_tok", int64_t{2});
      c.moe_ffn_width = j.at("intermediate_size").get<int64_t>();
      c.moe_aux_loss = j.value("router_aux_loss_coef", 0.001);
      // Mixtral's own default (transformers' MixtralConfig.default_theta).
      c.rope_theta = 1000000.0;
      if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
        const int64_t window = j["sliding_window"].get<int64_t>();
        DTRAIN_CHECK_INPUT(window >= context, origin, ": sliding_window ", window,
                           " is shorter than max_position_embeddings ", context,
                           " (dtrain's attention sees the whole context)");
      }
    }
    c.vocab = j.at("vocab_size").get<int64_t>();
    c.width = j.at("hidden_size").get<int64_t>();
    c.ffn_width = j.at("intermediate_size").get<int64_t>();
    c.layers = j.at("num_hidden_layers").get<int64_t>();
    c.heads = j.at("num_attention_heads").get<int64_t>();
    c.kv_heads = j.value("num_key_value_heads", c.heads);
    c.context = j.at("max_position_embeddings").get<int64_t>();
    c.norm_eps = j.value("rms_norm_eps", 1e-6);
    c.tied_embeddings = j.value("tie_word_embeddings", false);
    const int64_t context = c.context;
    if (qwen && j.value("use_sliding_window", false) && j.contains("sliding_window") &&
        !j["sliding_window"].is_null()) {
      const int64_t window = j["sliding_window"].get<int64_t>();
      DTRAIN_CHECK_INPUT(window >= context, origin, ": use_sliding_window with sliding_window ",
                         window, " shorter than max_position_embeddings ", context,
                         " (dtrain's attention sees the whole context)");
    }
    if (type == "qwen3_moe") {  // (num_local_experts: transformers' attribute name for it)
      c.moe_experts = j.contains("num_experts") ? j.at("num_experts").get<int64_t>()
                                                : j.at("num_local_experts").get<int64_t>();
      c.moe_top_k = j.value("num_experts_per_tok", int64_t{8});
      c.moe_ffn_width = j.value("moe_intermediate_size", int64_t{768});
      c.moe_normalize = j.value("norm_topk_prob", false);
      c.moe_aux_loss = j.value("router_aux_loss_coef", 0.001);
      DTRAIN_CHECK_INPUT(c.moe_experts > 0, origin, ": num_experts ", c.moe_experts,
                         " (a Qwen3-MoE without experts)");
      DTRAIN_CHECK_INPUT(c.moe_top_k >= 1 && c.moe_top_k <= c.moe_experts, origin,
                         ": num_experts_per_tok ", c.moe_top_k, " is not in [1, num_experts ",
                         c.moe_experts, "]");
      qwen3_moe_layout(j, c, origin);
    }
    c.rope_theta = j.value("rope_theta", type == "mixtral" ? c.rope_theta : 10000.0);
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
      const auto& rope = j["rope_parameters"];
      c.rope_theta = rope.value("rope_theta", c.rope_theta);
      const std::string kind = rope.value("rope_type", std::string("default"));
      DTRAIN_CHECK_INPUT(kind == "default", origin, ": rope_parameters.rope_type '", kind,
                         "' (dtrain's rotary embeddings are the default kind, unscaled)");
    }
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
      DTRAIN_THROW(InputError, origin, ": rope_scaling ", j["rope_scaling"].dump(),
                   " (dtrain's rotary embeddings are unscaled)");
    }
    const std::string act = j.value("hidden_act", std::string("silu"));
    DTRAIN_CHECK_INPUT(act == "silu", origin, ": hidden_act '", act, "' (dtrain's SwiGLU is silu)");
    DTRAIN_CHECK_INPUT(!j.value("attention_bias", false) && !j.value("mlp_bias", false), origin,
                       ": attention_bias or mlp_bias is set (dtrain's Llama has no biases)");
    // Qwen3's head width is 128 unless given (transformers' Qwen3Config); the others' width /
    // heads. Kept as 0 where it is that.
    int64_t head_dim = type == "qwen3" ? 128 : 0;
    if (j.contains("head_dim") && !j["head_dim"].is_null()) head_dim = j["head_dim"].get<int64_t>();
    DTRAIN_CHECK_INPUT(head_dim >= 0, origin, ": head_dim ", head_dim, " (must be > 0)");
    c.head_dim = c.heads > 0 && head_dim * c.heads == c.width ? 0 : head_dim;
  } catch (const json::exception& e) {
    DTRAIN_THROW(InputError, origin, ": ", json_error_text(e.what()));
  }
  try {
    validate(c);
  } catch (const InputError& e) {
    DTRAIN_THROW(InputError, origin, ": ", e.message());
  }
  return c;
}

std::string llama_config_to_hf(const GptConfig& c, const std::string& dtype, int64_t eos_token_id) {
  check_llama(c);
  const Shapes s = shapes_of(c);
  const bool moe = c.moe_experts > 0;
  const char* architecture = s.qwen ? (moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM")
                                    : (moe ? "MixtralForCausalLM" : "LlamaForCausalLM");
  const char* type = s.qwen ? (moe ? "qwen3_moe" : "qwen3") : (moe ? "mixtral" : "llama");
  json j = {
      {"architectures", {architecture}},
      {"model_type", type},
      {"vocab_size", c.vocab},
      {"hidden_size", c.width},
      // (Mixtral's is each expert's; Qwen3-MoE's the dense blocks')
      {"intermediate_size", moe && !s.qwen ? s.expert_ffn : s.ffn},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.heads},
      {"num_key_value_heads", kv_heads_of(c)},
      {"head_dim", s.head_dim},
      {"max_position_embeddings", c.context},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_parameters", {{"rope_theta", c.rope_theta}, {"rope_type", "default"}}},
      {"tie_word_embeddings", c.tied_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"attention_dropout", 0.0},
      {"initializer_range", 0.02},
      {"dtype", dtype},
      {"torch_dtype", dtype},
  };
  if (s.qwen) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.layers;
  }
  if (moe && s.qwen) {
    j["num_experts"] = c.moe_experts;
    j["num_experts_per_tok"] = c.moe_top_k;
    j["moe_intermediate_size"] = s.expert_ffn;
    j["norm_topk_prob"] = c.moe_normalize;
    j["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (int64_t i = 0; i < c.layers; ++i) {
      if (!is_moe_block(c, i)) dense.push_back(i);
    }
    j["mlp_only_layers"] = dense;
    j["router_aux_loss_coef"] = c.moe_aux_loss;
    j["output_router_logits"] = false;
  } else if (moe) {
    j["num_local_experts"] = c.moe_experts;
    j["num_experts_per_tok"] = c.moe_top_k;
    j["router_aux_loss_coef"] = c.moe_aux_loss;
    j["output_router_logits"] = false;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
  }
  if (eos_token_id >= 0) {
    j["bos_token_id"] = eos_token_id;
    j["eos_token_id"] = eos_token_id;
  }
  return j.dump(2) + "\n";
}

nn::NamedTensors to_hf_llama(const FullTensors& ours, const GptConfig& c) {
  check_llama(c);
  const Shapes s = shapes_of(c);
  auto get = [&ours](const std::string& name) {
    const auto it = ours.find(name);
    DTRAIN_CHECK_INPUT(it != ours.end(), "the model has no parameter ", name);
    return it->second;
  };
  nn::NamedTensors out;
  out.push_back({"model.embed_tokens.weight", get("embedding.token.weight")});
  for (int64_t i = 0; i < c.layers; ++i) {
    if (s.rep > 1) {
      out.push_back({layer(i) + "self_attn.q_proj.weight", get(block(i) + "q.weight")});
      out.push_back({layer(i) + "self_attn.k_proj.weight", get(block(i) + "k.weight")});
      out.push_back({layer(i) + "self_attn.v_proj.weight", get(block(i) + "v.weight")});
    } else {
      const at::Tensor qkv = get(block(i) + "qkv.weight").view({s.heads, 3, s.head_dim, s.width});
      for (int64_t part = 0; part < 3; ++part) {
        out.push_back({layer(i) + "self_attn." + "qkv"[part] + "_proj.weight",
                       qkv.select(1, part).reshape({s.heads * s.head_dim, s.width})});
      }
    }
    if (s.qwen) {
      out.push_back({layer(i) + "self_attn.q_norm.weight", get(block(i) + "q_norm.weight")});
      out.push_back({layer(i) + "self_attn.k_norm.weight", get(block(i) + "k_norm.weight")});
    }
    out.push_back({layer(i) + "self_attn.o_proj.weight", get(block(i) + "proj.weight")});
    if (is_moe_block(c, i)) {
      const std::string m = layer(i) + (s.qwen ? "mlp." : "block_sparse_moe."),
                        b = block(i) + "moe.";
      const auto bias = ours.find(b + "expert_bias");
      DTRAIN_CHECK_INPUT(bias == ours.end() || !bias->second.ne(0).any().item<bool>(), b,
                         "expert_bias is not zero (--moe-bias-rate moved it): ",
                         s.qwen ? "Qwen3-MoE's" : "Mixtral's",
                         " layout has no routing bias, and without it the tokens would go to "
                         "other experts; export the checkpoint in dtrain's names instead");
      out.push_back({m + "gate.weight", get(b + "router")});
      const at::Tensor gate = get(b + "gate"), up = get(b + "up"), down = get(b + "down");
      for (int64_t e = 0; e < s.experts; ++e) {
        const std::string x = m + "experts." + std::to_string(e) + ".";
        out.push_back({x + (s.qwen ? "gate_proj.weight" : "w1.weight"), gate[e]});
        out.push_back({x + (s.qwen ? "down_proj.weight" : "w2.weight"), down[e]});
        out.push_back({x + (s.qwen ? "up_proj.weight" : "w3.weight"), up[e]});
      }
    } else {
      const at::Tensor fc1 = get(block(i) + "fc1.weight").view({s.ffn, 2, s.width});
      out.push_back({layer(i) + "mlp.gate_proj.weight", fc1.select(1, 0)});
      out.push_back({layer(i) + "mlp.up_proj.weight", fc1.select(1, 1)});
      out.push_back({layer(i) + "mlp.down_proj.weight", get(block(i) + "fc2.weight")});
    }
    out.push_back({layer(i) + "input_layernorm.weight", get(block(i) + "ln1.weight")});
    out.push_back({layer(i) + "post_attention_layernorm.weight", get(block(i) + "ln2.weight")});
  }
  out.push_back({"model.norm.weight", get("head.ln.weight")});
  if (!c.tied_embeddings) out.push_back({"lm_head.weight", get("head.out.weight")});
  for (auto& [name, tensor] : out) tensor = tensor.contiguous();
  return out;
}

WeightSource WeightSource::direct(std::shared_ptr<const nn::SafeTensorsSet> weights) {
  WeightSource source;
  for (const auto& name : weights->names()) {
    source.entries_[name] = {weights->info(name).shape, {name}, 1};
  }
  source.weights_ = std::move(weights);
  return source;
}

// A block's experts (`ours`: "blocks.N.moe.") from Mixtral's names under `l` ("model.layers.N."):
// the router, and the experts one by one (the Hub's, save_pretrained's) or stacked as transformers
// 5 holds them (experts.gate_up_proj [E, 2F, W], gate first; experts.down_proj [E, W, F]), under
// block_sparse_moe. or mlp.
template <typename Entries, typename Check>
void moe_entries(Entries& e, const std::string& l, const std::string& ours, const Shapes& s,
                 const nn::SafeTensorsSet& w, Check& check) {
  using Read = WeightSource::Read;
  const int64_t E = s.experts, F = s.expert_ffn, W = s.width;
  const std::string m =
      l + (s.qwen || w.contains(l + "mlp.gate.weight") ? "mlp." : "block_sparse_moe.");
  e[ours + "router"] = {{E, W}, {check(m + "gate.weight", {E, W})}, 1};
  e[ours + "expert_bias"] = {{E}, {}, 1, at::zeros({E})};  // (none in Mixtral's layout)
  if (w.contains(m + "experts.gate_up_proj")) {
    const std::string gate_up = check(m + "experts.gate_up_proj", {E, 2 * F, W});
    for (int64_t half = 0; half < 2; ++half) {
      auto& entry = e[ours + (half == 0 ? "gate" : "up")];
      entry = {{E, F, W}, {gate_up}, 1};
      entry.compose = [gate_up, half, F](const Read& read, int64_t begin, int64_t end) {
        return read(gate_up, begin, end - begin).narrow(1, half * F, F);
      };
    }
    e[ours + "down"] = {{E, W, F}, {check(m + "experts.down_proj", {E, W, F})}, 1};
    return;
  }
  // One tensor per expert: the entry's row j is expert j's whole tensor.
  auto per_expert = [&](const char* ours_name, const char* theirs, std::vector<int64_t> shape) {
    std::vector<std::string> parts;
    for (int64_t j = 0; j < E; ++j) {
      parts.push_back(check(m + "experts." + std::to_string(j) + "." + theirs, shape));
    }
    auto& entry = e[ours + ours_name];
    std::vector<int64_t> stacked{E};
    stacked.insert(stacked.end(), shape.begin(), shape.end());
    entry = {stacked, parts, 1};
    entry.compose = [parts, shape](const Read& read, int64_t begin, int64_t end) {
      std::vector<at::Tensor> experts;
      for (int64_t j = begin; j < end; ++j) experts.push_back(read(parts[j], 0, shape[0]));
      if (experts.empty()) {
        std::vector<int64_t> none{0};
        none.insert(none.end(), shape.begin(), shape.end());
        return at::empty(none, read(parts[0], 0, 0).options());
      }
      return at::stack(experts);
    };
  };
  per_expert("gate", s.qwen ? "gate_proj.weight" : "w1.weight", {F, W});
  per_expert("up", s.qwen ? "up_proj.weight" : "w3.weight", {F, W});
  per_expert("down", s.qwen ? "down_proj.weight" : "w2.weight", {W, F});
}

WeightSource WeightSource::hf_llama(std::shared_ptr<const nn::SafeTensorsSet> weights,
                                    const GptConfig& c) {
  check_llama(c);
  const Shapes s = shapes_of(c);
  const nn::SafeTensorsSet& w = *weights;
  std::set<std::string> used;
  auto check = [&](const std::string& name, std::vector<int64_t> shape) {
    DTRAIN_CHECK_INPUT(w.contains(name), w.origin(), ": tensor '", name,
                       "' is missing (the config asks for ", c.layers, " layers",
                       c.tied_embeddings ? ", tied embeddings" : "", ")");
    const nn::SafeTensorInfo& info = w.info(name);
    DTRAIN_CHECK_INPUT(info.shape == shape, w.origin(), ": tensor '", name, "' has shape ",
                       at::IntArrayRef(info.shape), " where the config gives ",
                       at::IntArrayRef(shape));
    used.insert(name);
    return name;
  };
  WeightSource source;
  auto& e = source.entries_;
  e["embedding.token.weight"] = {
      {c.vocab, s.width}, {check("model.embed_tokens.weight", {c.vocab, s.width})}, 1};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = layer(i), b = block(i);
    const std::string q = check(l + "self_attn.q_proj.weight", {s.attention, s.width});
    const std::string k = check(l + "self_attn.k_proj.weight", {s.groups * s.head_dim, s.width});
    const std::string v = check(l + "self_attn.v_proj.weight", {s.groups * s.head_dim, s.width});
    if (s.rep > 1) {
      e[b + "q.weight"] = {{s.attention, s.width}, {q}, 1};
      e[b + "k.weight"] = {{s.groups * s.head_dim, s.width}, {k}, 1};
      e[b + "v.weight"] = {{s.groups * s.head_dim, s.width}, {v}, 1};
    } else {  // [head, (query, key, value), head dim]
      e[b + "qkv.weight"] = {{3 * s.attention, s.width}, {q, k, v}, s.head_dim};
    }
    if (s.qwen) {
      e[b + "q_norm.weight"] = {
          {s.head_dim}, {check(l + "self_attn.q_norm.weight", {s.head_dim})}, 1};
      e[b + "k_norm.weight"] = {
          {s.head_dim}, {check(l + "self_attn.k_norm.weight", {s.head_dim})}, 1};
    }
    e[b + "proj.weight"] = {
        {s.width, s.attention}, {check(l + "self_attn.o_proj.weight", {s.width, s.attention})}, 1};
    if (is_moe_block(c, i)) {
      moe_entries(e, l, b + "moe.", s, w, check);
    } else {
      // fc1's rows: gate 0, up 0, gate 1, ...
      e[b + "fc1.weight"] = {{2 * s.ffn, s.width},
                             {check(l + "mlp.gate_proj.weight", {s.ffn, s.width}),
                              check(l + "mlp.up_proj.weight", {s.ffn, s.width})},
                             1};
      e[b + "fc2.weight"] = {
          {s.width, s.ffn}, {check(l + "mlp.down_proj.weight", {s.width, s.ffn})}, 1};
    }
    e[b + "ln1.weight"] = {{s.width}, {check(l + "input_layernorm.weight", {s.width})}, 1};
    e[b + "ln2.weight"] = {{s.width}, {check(l + "post_attention_layernorm.weight", {s.width})}, 1};
  }
  e["head.ln.weight"] = {{s.width}, {check("model.norm.weight", {s.width})}, 1};
  if (!c.tied_embeddings) {
    e["head.out.weight"] = {{c.vocab, s.width}, {check("lm_head.weight", {c.vocab, s.width})}, 1};
  }
  for (const auto& name : w.names()) {
    // Rotary tables some exporters save are recomputed, never read.
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    DTRAIN_CHECK_INPUT(used.count(name), w.origin(), ": tensor '", name,
                       "' is not part of the model the config describes",
                       name == "lm_head.weight" ? " (tie_word_embeddings is true)" : "");
  }
  source.weights_ = std::move(weights);
  return source;
}

WeightSource WeightSource::in_memory(const FullTensors& tensors) {
  WeightSource source;
  for (const auto& [name, tensor] : tensors) {
    source.entries_[name] = {tensor.sizes().vec(), {}, 1, tensor};
  }
  return source;
}

const std::string& WeightSource::origin() const {
  static const std::string memory = "(tensors in memory)";
  return weights_ ? weights_->origin() : memory;
}

std::vector<std::string> WeightSource::names() const {
  std::vector<std::string> out;
  for (const auto& item : entries_) out.push_back(item.first);
  return out;
}

const std::vector<int64_t>& WeightSource::shape(const std::string& name) const {
  const auto it = entries_.find(name);
  DTRAIN_CHECK_INPUT(it != entries_.end(), origin(), ": no tensor for the model's ", name);
  return it->second.shape;
}

at::Tensor WeightSource::rows(const std::string& name, int64_t begin, int64_t end) const {
  const auto it = entries_.find(name);
  DTRAIN_CHECK_INPUT(it != entries_.end(), origin(), ": no tensor for the model's ", name);
  const Entry& entry = it->second;
  DTRAIN_CHECK(!entry.shape.empty() && begin >= 0 && begin <= end && end <= entry.shape[0],
               "WeightSource: rows [", begin, ", ", end, ") of ", name, " of shape ",
               at::IntArrayRef(entry.shape));
  if (entry.tensor.defined()) return entry.tensor.narrow(0, begin, end - begin);
  const Read read = [this](const std::string& part, int64_t first, int64_t count) {
    at::Tensor t = weights_->slice(part, 0, first, count);
    *bytes_read_ += static_cast<int64_t>(t.nbytes());
    return t;
  };
  if (entry.compose) return entry.compose(read, begin, end);
  const int64_t parts = static_cast<int64_t>(entry.parts.size());
  if (parts == 1) return read(entry.parts[0], begin, end - begin);
  // Whole groups (one block of every part) covering the rows, then the rows asked for.
  const int64_t group = parts * entry.block;
  const int64_t g0 = begin / group, g1 = end == begin ? g0 : (end - 1) / group + 1;
  std::vector<int64_t> grouped{g1 - g0, entry.block};
  grouped.insert(grouped.end(), entry.shape.begin() + 1, entry.shape.end());
  std::vector<at::Tensor> blocks;
  for (const auto& part : entry.parts) {
    blocks.push_back(read(part, g0 * entry.block, (g1 - g0) * entry.block).view(grouped));
  }
  std::vector<int64_t> flat = entry.shape;
  flat[0] = (g1 - g0) * group;
  return at::stack(blocks, 1).reshape(flat).narrow(0, begin - g0 * group, end - begin);
}

at::Tensor WeightSource::full(const std::string& name) const {
  const std::vector<int64_t>& whole = shape(name);
  if (!whole.empty()) return rows(name, 0, whole[0]);
  if (entries_.at(name).tensor.defined()) return entries_.at(name).tensor;
  at::Tensor t = weights_->get(entries_.at(name).parts.at(0));
  *bytes_read_ += static_cast<int64_t>(t.nbytes());
  return t;
}

FullTensors from_hf_llama(const nn::SafeTensorsSet& weights, const GptConfig& c) {
  // Not owned: the source lives only in this call.
  const WeightSource source =
      WeightSource::hf_llama(std::shared_ptr<const nn::SafeTensorsSet>(&weights, [](auto*) {}), c);
  FullTensors ours;
  for (const auto& name : source.names()) ours[name] = source.full(name);
  return ours;
}

namespace {

// Checks `name` against the source and, unless `target` is a placeholder, copies its local values.
void load_one(const nn::tensor::ParameterSplits& splits, const WeightSource& source,
              const std::string& origin, const std::string& name, at::Tensor target) {
  DTRAIN_CHECK_INPUT(source.contains(name), origin, ": no tensor for the model's ", name);
  const auto split = splits.find(name);
  const std::vector<int64_t>& shape = source.shape(name);
  const std::vector<int64_t> expected =
      split != splits.end() ? split->second.full_shape : target.sizes().vec();
  DTRAIN_CHECK_INPUT(shape == expected, origin, ": ", name, " has shape ", at::IntArrayRef(shape),
                     " where the model's is ", at::IntArrayRef(expected));
  if (nn::is_placeholder(target)) return;
  torch::NoGradGuard no_grad;
  if (split == splits.end()) {
    target.copy_(source.full(name));
  } else if (split->second.dim == 0) {
    target.copy_(
        source.rows(name, split->second.start, split->second.start + split->second.length));
  } else {
    target.copy_(
        source.full(name).narrow(split->second.dim, split->second.start, split->second.length));
  }
}

}  // namespace

void load_weights(torch::nn::Module& module, const WeightSource& source,
                  const std::string& origin) {
  const auto splits = nn::tensor::parameter_splits(module);
  std::set<std::string> seen;
  for (const auto& item : module.named_parameters()) {
    seen.insert(item.key());
    load_one(splits, source, origin, item.key(), item.value());
  }
  for (const auto& item : module.named_buffers()) {
    seen.insert(item.key());
    load_one(splits, source, origin, item.key(), item.value());
  }
  for (const auto& name : source.names()) {
    DTRAIN_CHECK_INPUT(seen.count(name), origin, ": ", name, " is not a tensor of the model");
  }
}

std::function<void(const std::string& name, at::Tensor out)> weights_source(
    const torch::nn::Module& module, WeightSource source, std::string origin) {
  return [splits = nn::tensor::parameter_splits(module), source = std::move(source),
          origin = std::move(origin)](const std::string& name, at::Tensor out) {
    load_one(splits, source, origin, name, std::move(out));
  };
}

void load_full_tensors(torch::nn::Module& module, const FullTensors& full,
                       const std::string& origin) {
  load_weights(module, WeightSource::in_memory(full), origin);
}

}  // namespace dtrain::models
