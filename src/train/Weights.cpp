// safetensors out of checkpoints and into models (see Weights.h).
#include "dtrain/train/Weights.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "common/Files.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/SafeTensors.h"
#include "dtrain/nn/tensor/Split.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

void write_text(const std::string& path, const std::string& text) {
  write_file_atomically(path, text.data(), text.size());
}

// config.json's sizes against the model's flags: the first that differs, named.
void check_against_flags(const models::GptConfig& file, const models::GptConfig& model,
                         const std::string& origin) {
  auto same = [&](const char* field, const char* flag, auto theirs, auto ours) {
    DTRAIN_CHECK_INPUT(theirs == ours, "--init-from ", origin, ": ", field, " is ", theirs,
                       ", the model's ", flag, " is ", ours);
  };
  same("vocab_size", "vocabulary (--vocab-size, or the data's)", file.vocab, model.vocab);
  same("hidden_size", "--width", file.width, model.width);
  auto on = [](bool value) { return value ? "on" : "off"; };
  same("self_attn.q_norm/k_norm (model_type qwen3, qwen3_moe)", "--qk-norm", on(file.qk_norm),
       on(model.qk_norm));
  same("head_dim", "--head-dim", models::head_dim_of(file), models::head_dim_of(model));
  same(file.qk_norm ? "num_experts" : "num_local_experts", "--moe-experts", file.moe_experts,
       model.moe_experts);
  if (model.moe_experts > 0 && model.qk_norm) {  // Qwen3-MoE: dense blocks possible
    same("moe_intermediate_size", "--moe-ffn-width", models::expert_ffn_width_of(file),
         models::expert_ffn_width_of(model));
    same("intermediate_size", "--ffn-width", models::ffn_width_of(file),
         models::ffn_width_of(model));
    same("num_experts_per_tok", "--moe-top-k", file.moe_top_k, model.moe_top_k);
    same("norm_topk_prob", "normalization (--no-moe-normalize turns it off)",
         on(file.moe_normalize), on(model.moe_normalize));
    same("mlp_only_layers' first sparse layer", "--moe-first-dense", file.moe_first_dense,
         model.moe_first_dense);
    same("mlp_only_layers' period", "--moe-every", file.moe_every, model.moe_every);
  } else if (model.moe_experts > 0) {  // Mixtral: every block routed, intermediate_size each
                                       // expert's
    same("intermediate_size", "--moe-ffn-width", models::expert_ffn_width_of(file),
         models::expert_ffn_width_of(model));
    same("num_experts_per_tok", "--moe-top-k", file.moe_top_k, model.moe_top_k);
  } else {
    same("intermediate_size", "--ffn-width", models::ffn_width_of(file),
         models::ffn_width_of(model));
  }
  same("num_hidden_layers", "--layers", file.layers, model.layers);
  same("num_attention_heads", "--heads", file.heads, model.heads);
  same("num_key_value_heads", "--kv-heads", models::kv_heads_of(file), models::kv_heads_of(model));
  same("tie_word_embeddings", "--tied-embeddings", file.tied_embeddings, model.tied_embeddings);
  same("rope_theta", "--rope-theta", file.rope_theta, model.rope_theta);
  same("rms_norm_eps", "--norm-eps", file.norm_eps, model.norm_eps);
}

}  // namespace

std::vector<std::string> export_safetensors(const std::string& checkpoint,
                                            const std::string& output, int64_t max_shard_bytes) {
  const std::string directory = resolve_checkpoint(checkpoint);
  const CheckpointMeta meta = read_meta(directory);
  const std::vector<FullTensor> tensors = read_full_model(directory);
  fs::create_directories(output);
  const auto model_it = meta.extras.find("model");
  std::vector<std::string> written;
  if (model_it != meta.extras.end()) {
    const models::GptConfig config =
        models::gpt_config_from_json(model_it->second, directory + "/meta.json");
    // (a mixture of experts Mixtral's names cannot hold is written in dtrain's)
    if (models::has_hugging_face_layout(config)) {
      models::FullTensors full;
      for (const auto& t : tensors) full[t.name] = t.value;
      const std::string dtype = c10::toString(tensors.front().value.scalar_type());
      written = nn::save_safetensors_folder(output, models::to_hf_llama(full, config),
                                            max_shard_bytes, {{"format", "pt"}});
      const std::string hf_dtype = dtype == "Float"      ? "float32"
                                   : dtype == "Double"   ? "float64"
                                   : dtype == "BFloat16" ? "bfloat16"
                                                         : "float16";
      // The tokenizer's end-of-text token (what dtrain puts between documents, and where
      // dtrain generate stops): transformers' bos and eos, so that its generate() stops there.
      const auto tokenizer = meta.extras.find("tokenizer");
      int64_t eos = -1;
      std::string eos_text;
      if (tokenizer != meta.extras.end()) {
        const auto bpe =
            data::tokenizer::BpeTokenizer::from_json(tokenizer->second, directory + "/meta.json");
        eos = bpe.end_of_text();
        if (eos >= 0) eos_text = bpe.decode({eos});
      }
      auto write = [&](const char* name, const std::string& text) {
        write_text((fs::path(output) / name).string(), text);
        written.push_back((fs::path(output) / name).string());
      };
      write("config.json", models::llama_config_to_hf(config, hf_dtype, eos));
      if (tokenizer != meta.extras.end()) {
        write("tokenizer.json", tokenizer->second);
        nlohmann::json tokenizer_config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                           {"model_max_length", config.context},
                                           {"clean_up_tokenization_spaces", false}};
        if (eos >= 0) {
          tokenizer_config["bos_token"] = eos_text;
          tokenizer_config["eos_token"] = eos_text;
        }
        write("tokenizer_config.json", tokenizer_config.dump(2) + "\n");
      }
      nlohmann::json generation = {{"_from_model_config", true}};
      if (eos >= 0) {
        generation["bos_token_id"] = eos;
        generation["eos_token_id"] = eos;
        generation["pad_token_id"] = eos;
      }
      write("generation_config.json", generation.dump(2) + "\n");
      return written;
    }
  }
  nn::NamedTensors named;
  for (const auto& t : tensors) named.push_back({t.name, t.value});
  return nn::save_safetensors_folder(output, named, max_shard_bytes, {{"format", "dtrain"}});
}

bool is_safetensors(const std::string& path) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    return fs::exists(fs::path(path) / "model.safetensors", error) ||
           fs::exists(fs::path(path) / "model.safetensors.index.json", error);
  }
  return fs::path(path).extension() == ".safetensors";
}

models::WeightSource open_weights(const models::ModelSpec& spec, const std::string& path) {
  auto weights = std::make_shared<const nn::SafeTensorsSet>(nn::SafeTensorsSet::open(path));
  const bool decoder = models::model_info(spec.name).language_model;
  if (!decoder || !weights->contains("model.embed_tokens.weight")) {
    return models::WeightSource::direct(std::move(weights));
  }
  const models::GptConfig config = models::decoder_config(spec);
  DTRAIN_CHECK_INPUT(models::is_llama_architecture(config), "--init-from ", path,
                     " holds Hugging Face Llama weights; --model ", spec.name,
                     " is not a Llama-architecture decoder (--model llama)");
  // The folder's config.json first: a flag that differs is named before what it makes.
  const fs::path folder = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  const fs::path config_path = folder / "config.json";
  std::error_code error;
  if (fs::exists(config_path, error)) {
    std::ifstream in(config_path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    check_against_flags(models::llama_config_from_hf(text, config_path.string()), config,
                        config_path.string());
  }
  std::string why;
  DTRAIN_CHECK_INPUT(models::has_hugging_face_layout(config, &why), "--init-from ", path,
                     " holds Hugging Face weights: ", why);
  return models::WeightSource::hf_llama(std::move(weights), config);
}

void init_from_safetensors(Model& model, const models::ModelSpec& spec, const std::string& path) {
  models::load_weights(*model.module, open_weights(spec, path), "--init-from " + path);
}

namespace {

void check_finite_tensor(const std::string& name, const at::Tensor& tensor, int64_t offset,
                         const std::string& origin) {
  if (!tensor.defined() || !tensor.is_floating_point() || tensor.numel() == 0) return;
  const at::Tensor bad = tensor.detach().reshape({-1}).isfinite().logical_not();
  const int64_t count = bad.sum().item<int64_t>();
  if (count == 0) return;
  const int64_t first = bad.nonzero()[0][0].item<int64_t>();
  const double value = tensor.detach().reshape({-1})[first].item<double>();
  DTRAIN_THROW(InputError, origin, ": ", name, " holds ", std::isnan(value) ? "NaN" : "Inf", " (",
               count, " of its values are not finite, the first at index ", offset + first,
               "): training from it would diverge; pass --allow-non-finite-weights to load it "
               "anyway");
}

}  // namespace

void check_finite_weights(torch::nn::Module& module, const std::string& origin) {
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters()) {
    // (a pipeline rank's other stages are placeholders: nothing of them was read)
    if (!nn::is_placeholder(item.value())) check_finite_tensor(item.key(), item.value(), 0, origin);
  }
  for (const auto& item : module.named_buffers()) {
    check_finite_tensor(item.key(), item.value(), 0, origin);
  }
}

void check_finite_weights(const std::vector<parallel::PieceRef>& pieces,
                          const std::string& origin) {
  torch::NoGradGuard no_grad;
  for (const auto& piece : pieces)
    check_finite_tensor(piece.name, piece.tensor, piece.offset, origin);
}

void load_weight_pieces(const std::vector<parallel::PieceRef>& pieces, torch::nn::Module& module,
                        const models::WeightSource& source, const std::string& origin) {
  torch::NoGradGuard no_grad;
  const auto splits = nn::tensor::parameter_splits(module);
  std::map<std::string, std::vector<int64_t>> local_shapes;
  std::set<std::string> seen;
  auto check = [&](const std::string& name, const std::vector<int64_t>& local) {
    DTRAIN_CHECK_INPUT(source.contains(name), origin, ": no tensor for the model's ", name);
    const auto split = splits.find(name);
    const std::vector<int64_t> expected = split != splits.end() ? split->second.full_shape : local;
    DTRAIN_CHECK_INPUT(source.shape(name) == expected, origin, ": ", name, " has shape ",
                       at::IntArrayRef(source.shape(name)), " where the model's is ",
                       at::IntArrayRef(expected));
    seen.insert(name);
  };
  for (const auto& item : module.named_parameters()) {
    local_shapes[item.key()] = item.value().sizes().vec();
    check(item.key(), item.value().sizes().vec());
  }
  for (const auto& item : module.named_buffers()) {
    check(item.key(), item.value().sizes().vec());
    item.value().copy_(source.full(item.key()));
  }
  for (const auto& name : source.names()) {
    DTRAIN_CHECK_INPUT(seen.count(name), origin, ": ", name, " is not a tensor of the model");
  }
  for (const auto& piece : pieces) {
    const std::vector<int64_t>& local = local_shapes.at(piece.name);
    const int64_t numel = piece.tensor.numel();
    if (numel == 0) continue;
    if (local.empty()) {
      piece.tensor.copy_(source.full(piece.name).reshape({-1}));
      continue;
    }
    int64_t row = 1;
    for (size_t d = 1; d < local.size(); ++d) row *= local[d];
    const int64_t first = piece.offset / row, last = (piece.offset + numel + row - 1) / row;
    const auto split = splits.find(piece.name);
    at::Tensor rows;
    if (split == splits.end()) {
      rows = source.rows(piece.name, first, last);
    } else if (split->second.dim == 0) {
      rows = source.rows(piece.name, split->second.start + first, split->second.start + last);
    } else {
      rows = source.rows(piece.name, first, last)
                 .narrow(split->second.dim, split->second.start, split->second.length);
    }
    piece.tensor.copy_(rows.reshape({-1}).narrow(0, piece.offset - first * row, numel));
  }
}

}  // namespace dtrain::train
