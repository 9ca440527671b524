// The Llama-style decoder: its logits equal transformers' LlamaForCausalLM on the same weights
// (tests/data/llama_oracle.py in .venv-torch; skipped without it) within 1e-5 in float32 and
// 1e-10 in float64, Hugging Face's names and layout both ways, bad configs and weight files named,
// and data parallelism and ZeRO-3 (with activation checkpointing) training like one process in
// float64, and under tensor and sequence parallelism and the 3D grid too.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "InputErrors.h"
#include "Oracle.h"
#include "RankThreads.h"
#include "TempDir.h"
#include "TensorParallelRuns.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/SafeTensors.h"
#include "dtrain/train/Weights.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/Zero3Strategy.h"

using namespace dtrain;
using namespace dtrain::test;
namespace fs = std::filesystem;

namespace {

const std::string kPeerPython = dtrain::test::peer_python();
const std::string kOracle = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/llama_oracle.py";

bool have_transformers() {
  return std::system((kPeerPython + " -c 'import transformers' > /dev/null 2>&1").c_str()) == 0;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

models::FullTensors full_parameters(const Model& model) {
  models::FullTensors out;
  for (const auto& item : model.module->named_parameters()) {
    out[item.key()] = item.value().detach().clone();
  }
  return out;
}

// The mean next-token cross-entropy's gradients on `ids` against transformers' (llama_oracle.py's
// "grad." tensors, under Hugging Face's names): the largest difference over every tensor, each
// relative to its largest value.
double next_token_gradients(Model& model, const models::GptConfig& config, const at::Tensor& ids,
                            const nn::SafeTensorsFile& expected) {
  for (auto& p : model.module->parameters()) p.mutable_grad().reset();
  const at::Tensor logits = model(ids);
  const at::Tensor loss = at::cross_entropy_loss(
      logits.narrow(1, 0, ids.size(1) - 1).reshape({-1, logits.size(-1)}),
      ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
  EXPECT_NEAR(loss.item<double>(), expected.get("loss64").item<double>(), 1e-12);
  loss.backward();
  models::FullTensors grads;
  for (const auto& item : model.module->named_parameters()) grads[item.key()] = item.value().grad();
  double worst = 0;
  for (const auto& [name, grad] : models::to_hf_llama(grads, config)) {
    const at::Tensor theirs = expected.get("grad." + name);
    const double scale = std::max(theirs.abs().max().item<double>(), 1e-30);
    const double difference = (grad - theirs).abs().max().item<double>() / scale;
    EXPECT_LT(difference, 1e-10) << name;
    worst = std::max(worst, difference);
  }
  return worst;
}

// One process's model of `full`: its logits on the oracle's ids equal transformers' within 1e-5
// in float32 and 1e-10 in float64, the loss's gradients within 1e-10; and the check can fail: the
// logits move once `mutated` is scaled by 1.01.
void expect_transformers_numbers(const models::GptConfig& config, const models::FullTensors& full,
                                 const nn::SafeTensorsFile& expected, const std::string& mutated) {
  const at::Tensor ids = expected.get("ids");
  Model model = models::make_gpt(config);
  models::load_full_tensors(*model.module, full, "model");
  model.module->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LT((model(ids) - expected.get("logits32")).abs().max().item<double>(), 1e-5);
  model.module->to(at::kDouble);
  EXPECT_LT((model(ids) - expected.get("logits64")).abs().max().item<double>(), 1e-10);
  {
    torch::AutoGradMode grad(true);
    EXPECT_NEAR(next_token_gradients(model, config, ids, expected), 0.0, 1e-10);
  }
  model.module->named_parameters()[mutated].mul_(1.01);
  EXPECT_GT((model(ids) - expected.get("logits64")).abs().max().item<double>(), 1e-6) << mutated;
}

models::GptConfig small_llama() {
  models::GptConfig c;
  models::llama_preset(c);
  c.vocab = 13;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.width = 16;
  c.ffn_width = 24;
  c.context = 8;
  return c;
}

}  // namespace

TEST(Llama, LogitsEqualTransformersInFloat32AndFloat64) {
  if (!have_transformers()) GTEST_SKIP() << "no transformers in " << kPeerPython;
  for (bool tied : {false, true}) {
    TempDir dir;
    const std::string command = kPeerPython + " " + kOracle + " " + dir.path() +
                                (tied ? " --tied" : "") + " > " + (dir / "log") + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << read_text(dir / "log");
    const models::GptConfig config =
        models::llama_config_from_hf(read_text(dir / "model/config.json"), "config.json");
    EXPECT_EQ(config.kv_heads, 2);
    EXPECT_EQ(config.rope_theta, 500000.0);
    EXPECT_EQ(config.tied_embeddings, tied);
    const auto weights = nn::SafeTensorsSet::open(dir / "model");
    const models::FullTensors full = models::from_hf_llama(weights, config);
    // Hugging Face's layout back from ours: the same tensors, bit for bit.
    for (const auto& [name, tensor] : models::to_hf_llama(full, config)) {
      EXPECT_TRUE(at::equal(tensor, weights.get(name))) << name;
    }
    Model model = models::make_gpt(config);
    models::load_full_tensors(*model.module, full, "model");
    model.module->eval();
    const auto expected = nn::SafeTensorsFile::open(dir / "expected.safetensors");
    const at::Tensor ids = expected.get("ids");
    {
      torch::NoGradGuard no_grad;
      const at::Tensor logits32 = model(ids);
      const double diff32 = (logits32 - expected.get("logits32")).abs().max().item<double>();
      EXPECT_LT(diff32, 1e-5) << "tied " << tied;
      model.module->to(at::kDouble);
      const at::Tensor logits64 = model(ids);
      const double diff64 = (logits64 - expected.get("logits64")).abs().max().item<double>();
      EXPECT_LT(diff64, 1e-10) << "tied " << tied;
      // The check can fail: the logits are not near zero, and one weight changed moves them.
      EXPECT_GT(expected.get("logits64").abs().max().item<double>(), 0.5);
      model.module->named_parameters()["blocks.1.ln2.weight"].mul_(1.01);
      EXPECT_GT((model(ids) - expected.get("logits64")).abs().max().item<double>(), 1e-6);
    }
  }
}

// Mixtral (transformers' MixtralForCausalLM, its experts one by one as save_pretrained writes
// them): the same logits within 1e-5 in float32 and 1e-10 in float64, its layout both ways bit for
// bit, transformers 5's stacked experts read alike, and an expert-parallel rank reading only its
// experts' rows of the file, its forward (the all-to-all there and back) still transformers'.
TEST(Llama, MixtralLogitsEqualTransformersAndEachExpertRankReadsItsExperts) {
  if (!have_transformers()) GTEST_SKIP() << "no transformers in " << kPeerPython;
  TempDir dir;
  const std::string command =
      kPeerPython + " " + kOracle + " " + dir.path() + " --mixtral > " + (dir / "log") + " 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << read_text(dir / "log");
  const models::GptConfig config =
      models::llama_config_from_hf(read_text(dir / "model/config.json"), "config.json");
  EXPECT_EQ(config.moe_experts, 4);
  EXPECT_EQ(config.moe_top_k, 2);
  EXPECT_EQ(config.moe_ffn_width, 48);
  EXPECT_EQ(config.moe_score, "softmax");
  // Our config.json reads back as the same sizes.
  EXPECT_EQ(models::to_json(models::llama_config_from_hf(models::llama_config_to_hf(config), "c")),
            models::to_json(config));
  const auto weights = nn::SafeTensorsSet::open(dir / "model");
  const models::FullTensors full = models::from_hf_llama(weights, config);
  EXPECT_EQ(full.at("blocks.1.moe.down").sizes(), at::IntArrayRef({4, 32, 48}));
  const nn::NamedTensors back = models::to_hf_llama(full, config);
  EXPECT_EQ(back.size(), weights.names().size());
  for (const auto& [name, tensor] : back) EXPECT_TRUE(at::equal(tensor, weights.get(name))) << name;

  const auto expected = nn::SafeTensorsFile::open(dir / "expected.safetensors");
  const at::Tensor ids = expected.get("ids");
  // (the loss's gradients: the router's and every expert's among them)
  expect_transformers_numbers(config, full, expected, "blocks.0.moe.up");

  // transformers 5's own layout: experts.gate_up_proj [E, 2F, W] (gate first), experts.down_proj,
  // under mlp.
  nn::NamedTensors stacked;
  for (const auto& [name, tensor] : back) {
    if (name.find(".experts.") != std::string::npos) continue;
    std::string renamed = name;
    const auto at = renamed.find("block_sparse_moe.");
    if (at != std::string::npos) renamed.replace(at, 17, "mlp.");
    stacked.push_back({renamed, tensor});
  }
  for (int layer = 0; layer < 2; ++layer) {
    const std::string b = "blocks." + std::to_string(layer) + ".moe.";
    const std::string l = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    stacked.push_back({l + "gate_up_proj", at::cat({full.at(b + "gate"), full.at(b + "up")}, 1)});
    stacked.push_back({l + "down_proj", full.at(b + "down")});
  }
  nn::save_safetensors(dir / "stacked.safetensors", stacked);
  const models::FullTensors from_stacked =
      models::from_hf_llama(nn::SafeTensorsSet::open(dir / "stacked.safetensors"), config);
  ASSERT_EQ(from_stacked.size(), full.size());
  for (const auto& [name, tensor] : full)
    EXPECT_TRUE(at::equal(from_stacked.at(name), tensor)) << name;

  int64_t file_bytes = 0;
  for (const auto& name : weights.names()) file_bytes += weights.get(name).nbytes();
  int64_t expert_bytes = 0;
  for (const auto& [name, tensor] : full) {
    for (const char* stacked_name : {".moe.gate", ".moe.up", ".moe.down"}) {
      if (name.size() > std::strlen(stacked_name) &&
          name.compare(name.size() - std::strlen(stacked_name), std::string::npos, stacked_name) ==
              0)
        expert_bytes += tensor.nbytes();
    }
  }
  test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 1, 1);
    grid->split_experts(2);
    Model model = models::make_gpt(config, nullptr, false, grid->ep());
    const models::WeightSource source = models::WeightSource::hf_llama(
        std::make_shared<const nn::SafeTensorsSet>(nn::SafeTensorsSet::open(dir / "model")),
        config);
    models::load_weights(*model.module, source, "model");
    const auto local = model.module->named_parameters();
    EXPECT_TRUE(local["blocks.1.moe.gate"].equal(
        full.at("blocks.1.moe.gate").narrow(0, 2 * world->rank(), 2)));
    // The rest of the file, and half the experts.
    EXPECT_EQ(source.bytes_read(), file_bytes - expert_bytes / 2) << "rank " << world->rank();
    model.module->eval();
    torch::NoGradGuard no_grad;
    EXPECT_LT((model(ids) - expected.get("logits32")).abs().max().item<double>(), 1e-5)
        << "rank " << world->rank();
  });
}

// Qwen3 and Qwen3-MoE (transformers' Qwen3ForCausalLM, Qwen3MoeForCausalLM): per-head query and
// key norms, heads 12 wide where hidden_size / heads is 8, and the mixture of experts' first layer
// dense (mlp_only_layers), its chosen scores not renormalized (norm_topk_prob false). The config
// and weights read and written back bit for bit; logits within 1e-5 in float32 and 1e-10 in
// float64, the loss's gradients within 1e-10; over 2 tensor-parallel ranks (each its heads,
// the head norms' gradients summed over them) and with the experts over 2 ranks, the logits
// still transformers'.
TEST(Llama, Qwen3AndQwen3MoeEqualTransformers) {
  if (!have_transformers()) GTEST_SKIP() << "no transformers in " << kPeerPython;
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "qwen3_moe" : "qwen3");
    TempDir dir;
    const std::string command = kPeerPython + " " + kOracle + " " + dir.path() +
                                (moe ? " --qwen3-moe" : " --qwen3") + " > " + (dir / "log") +
                                " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << read_text(dir / "log");
    const models::GptConfig config =
        models::llama_config_from_hf(read_text(dir / "model/config.json"), "config.json");
    EXPECT_TRUE(config.qk_norm);
    EXPECT_EQ(config.head_dim, 12);
    EXPECT_EQ(config.kv_heads, 2);
    if (moe) {
      EXPECT_EQ(config.moe_experts, 4);
      EXPECT_EQ(config.moe_top_k, 2);
      EXPECT_EQ(config.moe_ffn_width, 24);
      EXPECT_EQ(config.ffn_width, 48);
      EXPECT_EQ(config.moe_first_dense, 1);
      EXPECT_FALSE(config.moe_normalize);
    }
    // Our config.json reads back as the same sizes, and names the same architecture.
    const std::string ours_json = models::llama_config_to_hf(config);
    EXPECT_EQ(models::to_json(models::llama_config_from_hf(ours_json, "c")),
              models::to_json(config));
    EXPECT_NE(ours_json.find(moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"), std::string::npos);
    const auto weights = nn::SafeTensorsSet::open(dir / "model");
    const models::FullTensors full = models::from_hf_llama(weights, config);
    EXPECT_EQ(full.at("blocks.0.q.weight").sizes(), at::IntArrayRef({48, 32}));
    EXPECT_EQ(full.at("blocks.0.proj.weight").sizes(), at::IntArrayRef({32, 48}));
    const nn::NamedTensors back = models::to_hf_llama(full, config);
    EXPECT_EQ(back.size(), weights.names().size());
    for (const auto& [name, tensor] : back) {
      EXPECT_TRUE(at::equal(tensor, weights.get(name))) << name;
    }
    EXPECT_EQ(models::gpt_parameter_count(config), [&] {
      int64_t n = 0;
      for (const auto& name : weights.names()) n += weights.get(name).numel();
      return n;
    }());

    const auto expected = nn::SafeTensorsFile::open(dir / "expected.safetensors");
    const at::Tensor ids = expected.get("ids");
    expect_transformers_numbers(config, full, expected, "blocks.1.k_norm.weight");
    // Over 2 ranks: tensor-parallel heads (a key/value head each), or the experts split.
    for (const bool experts : {false, true}) {
      if (experts && !moe) continue;
      test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, experts ? 1 : 2, 1);
        if (experts) grid->split_experts(2);
        Model model = models::make_gpt(config, experts ? nullptr : grid->tp(), false,
                                       experts ? grid->ep() : nullptr);
        models::load_weights(
            *model.module,
            models::WeightSource::hf_llama(
                std::make_shared<const nn::SafeTensorsSet>(nn::SafeTensorsSet::open(dir / "model")),
                config),
            "model");
        model.module->eval();
        torch::NoGradGuard no_grad;
        at::Tensor logits = model(ids);
        if (!experts) {  // this rank's block of the vocabulary
          const auto& head = tp::parameter_splits(*model.module).at("head.out.weight");
          EXPECT_LT((logits - expected.get("logits32").narrow(-1, head.start, head.length))
                        .abs()
                        .max()
                        .item<double>(),
                    1e-5)
              << "rank " << world->rank();
          EXPECT_EQ(parallel::tensor_parallel_layout(*model.module, *grid).partial.size(), 4u);
        } else {
          EXPECT_LT((logits - expected.get("logits32")).abs().max().item<double>(), 1e-5)
              << "rank " << world->rank();
        }
      });
    }
  }
}

// Qwen3's attention (per-head query/key norms, heads wider than width / heads) under tensor
// parallelism: each rank's head norms see only its heads, their gradients summed over the group
// (a partial gradient, as sequence parallelism's norms); the model equals the serial one and
// trains like one process in float64 over TP, DP x PP x TP and TP with sequence parallelism.
TEST(Llama, Qwen3HeadNormsUnderTensorParallelismTrainLikeOneProcess) {
  const at::Tensor ids = random_tokens(3, 6, 21);
  const at::Tensor targets = random_tokens(3, 6, 22);
  const SerialPass pass = serial_pass(tiny_gpt(false, true, true), ids, targets);
  EXPECT_EQ(pass.grads.at("blocks.0.q_norm.weight").numel(), 6);
  EXPECT_EQ(pass.grads.at("blocks.0.q.weight").sizes(), at::IntArrayRef({24, 16}));
  test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
    Model model = build_gpt(tiny_gpt(false, true, true), grid->tp());
    const auto splits = tp::parameter_splits(*model.module);
    const auto& head = splits.at("head.out.weight");
    const at::Tensor block = model(ids);
    EXPECT_LT((block - pass.logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
              1e-12);
    model.loss(block, targets).backward();
    parallel::TensorParallelLayout layout = parallel::tensor_parallel_layout(*model.module, *grid);
    EXPECT_EQ(layout.partial.size(), 4u);  // q_norm and k_norm of 2 blocks
    EXPECT_LT(max_block_diff(summed_gradients(model, layout), pass.grads, splits), 1e-12);
  });
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false, -1, true, true);
  GridRun run;
  run.llama = run.qwen = true;
  run.world = 2, run.tp = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 2";
  run.world = 8, run.pp = 2, run.micro = 2, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x PP 2 x TP 2";
  run.world = 4, run.pp = 1, run.micro = 1, run.strategy = "ddp", run.sequence_parallel = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, SP";
}

// A mixture of experts in Mixtral's names: a missing expert is named, a routing bias Mixtral
// cannot hold and a layout it has no names for (sigmoid scores, shared experts, dense first
// blocks) are refused, as is a sliding window shorter than the context.
TEST(Llama, MixtralFilesAndModelsThatDoNotFitAreNamed) {
  models::GptConfig config = small_llama();
  config.moe_experts = 4;
  config.moe_ffn_width = 8;
  torch::manual_seed(3);
  models::FullTensors full = full_parameters(models::make_gpt(config));
  const nn::NamedTensors hf = models::to_hf_llama(full, config);
  TempDir dir;
  nn::NamedTensors missing;
  for (const auto& named : hf) {
    if (named.first != "model.layers.1.block_sparse_moe.experts.3.w2.weight")
      missing.push_back(named);
  }
  nn::save_safetensors(dir / "missing.safetensors", missing);
  EXPECT_NE(error_of([&] {
              models::from_hf_llama(nn::SafeTensorsSet::open(dir / "missing.safetensors"), config);
            }).find("tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight' is missing"),
            std::string::npos);
  full["blocks.0.moe.expert_bias"] = at::tensor({0.0, 0.01, 0.0, -0.01});
  EXPECT_NE(error_of([&] {
              models::to_hf_llama(full, config);
            }).find("blocks.0.moe.expert_bias is not zero"),
            std::string::npos);
  for (const auto& change : std::vector<std::function<void(models::GptConfig&)>>{
           [](models::GptConfig& c) { c.moe_score = "sigmoid"; },
           [](models::GptConfig& c) { c.moe_shared_experts = 1; },
           [](models::GptConfig& c) { c.moe_first_dense = 1; },
           [](models::GptConfig& c) { c.moe_normalize = false; }}) {
    models::GptConfig other = config;
    change(other);
    EXPECT_FALSE(models::has_hugging_face_layout(other));
    EXPECT_NE(error_of([&] { models::llama_config_to_hf(other); }).find("is Mixtral's"),
              std::string::npos);
    // With the head norms, dense first blocks and unnormalized scores are Qwen3-MoE's; sigmoid
    // scores and shared experts are nobody's.
    other.qk_norm = true;
    EXPECT_EQ(models::has_hugging_face_layout(other),
              other.moe_score == "softmax" && other.moe_shared_experts == 0);
  }
  // Qwen3-MoE's configs dtrain does not build: named by their fields.
  const std::string qwen = R"({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 16,
      "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 4,
      "max_position_embeddings": 32, "num_experts_per_tok": 2, "num_experts": 4, )";
  for (const auto& [fields, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"("mlp_only_layers": [2]})",
            "mlp_only_layers [2] with decoder_sparse_step 1 make layer 2 dense"},
           {R"("mlp_only_layers": [0, 1, 2, 3]})", "leave no mixture-of-experts layer of 4"},
           {R"("use_sliding_window": true, "sliding_window": 16})",
            "use_sliding_window with sliding_window 16 shorter than max_position_embeddings 32"},
           {R"("num_experts": 0})", "num_experts 0"},
           {R"("num_experts_per_tok": 5})", "num_experts_per_tok 5 is not in [1, num_experts 4]"},
           {R"("head_dim": 7})", "rotary embeddings need an even head width: --head-dim 7"}}) {
    const std::string text =
        fields.rfind("\"num_experts\"", 0) == 0
            ? std::string(qwen).replace(qwen.find("\"num_experts\": 4, "), 19, "") + fields
            : qwen + fields;
    const std::string message = error_of([&] { models::llama_config_from_hf(text, "c.json"); });
    EXPECT_NE(message.find(needle), std::string::npos) << text << "\n" << message;
  }
  // ... and what it does: a sparse layer every 2 after a dense one; Qwen3's head width of 128
  // when none is given.
  const models::GptConfig every_other = models::llama_config_from_hf(
      qwen + R"("mlp_only_layers": [0], "decoder_sparse_step": 2})", "c.json");
  EXPECT_EQ(every_other.moe_first_dense, 1);
  EXPECT_EQ(every_other.moe_every, 2);
  EXPECT_EQ(models::head_dim_of(models::llama_config_from_hf(
                R"({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 16,
                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                    "max_position_embeddings": 32})",
                "c.json")),
            128);
  const std::string windowed = R"({"model_type": "mixtral", "vocab_size": 10, "hidden_size": 16,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
      "max_position_embeddings": 32, "num_local_experts": 4, "sliding_window": 16})";
  EXPECT_NE(error_of([&] {
              models::llama_config_from_hf(windowed, "c.json");
            }).find("sliding_window 16 is shorter than max_position_embeddings 32"),
            std::string::npos);
}

TEST(Llama, HuggingFaceConfigsAndWeightFilesThatDoNotFitAreNamed) {
  TempDir dir;
  const models::GptConfig config = small_llama();
  torch::manual_seed(3);
  const Model model = models::make_gpt(config);
  const nn::NamedTensors hf = models::to_hf_llama(full_parameters(model), config);
  // Our config.json reads back as the same sizes.
  const models::GptConfig back =
      models::llama_config_from_hf(models::llama_config_to_hf(config), "config.json");
  EXPECT_EQ(models::to_json(back), models::to_json(config));
  auto without = [&](const std::string& left_out) {
    nn::NamedTensors kept;
    for (const auto& named : hf) {
      if (named.first != left_out) kept.push_back(named);
    }
    return kept;
  };
  nn::save_safetensors(dir / "missing.safetensors", without("model.layers.1.mlp.up_proj.weight"));
  EXPECT_NE(error_of([&] {
              models::from_hf_llama(nn::SafeTensorsSet::open(dir / "missing.safetensors"), config);
            }).find("tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
            std::string::npos);
  nn::NamedTensors extra = hf;
  extra.push_back({"model.layers.2.mlp.up_proj.weight", at::zeros({24, 16})});
  nn::save_safetensors(dir / "extra.safetensors", extra);
  EXPECT_NE(error_of([&] {
              models::from_hf_llama(nn::SafeTensorsSet::open(dir / "extra.safetensors"), config);
            }).find("'model.layers.2.mlp.up_proj.weight' is not part of the model"),
            std::string::npos);
  nn::NamedTensors reshaped = hf;
  reshaped[1].second = at::zeros({8, 16});  // q_proj of layer 0
  nn::save_safetensors(dir / "shape.safetensors", reshaped);
  EXPECT_NE(error_of([&] {
              models::from_hf_llama(nn::SafeTensorsSet::open(dir / "shape.safetensors"), config);
            })
                .find("'model.layers.0.self_attn.q_proj.weight' has shape [8, 16] where the config "
                      "gives [16, 16]"),
            std::string::npos);
  const std::vector<std::pair<std::string, std::string>> configs = {
      {R"({"model_type": "mistral"})", "model_type 'mistral'"},
      {R"({"model_type": "mixtral", "vocab_size": 10})", "num_local_experts"},
      {R"({"model_type": "llama", "vocab_size": 10})", "hidden_size"},
      {R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3,
          "max_position_embeddings": 8})",
       "--kv-heads (3) must divide --heads (4)"},
      {R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})",
       "rope_scaling"},
      {R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 8,
          "attention_bias": true})",
       "attention_bias"},
      {"not json", "not JSON"},
  };
  for (const auto& [text, needle] : configs) {
    const std::string message = error_of([&] { models::llama_config_from_hf(text, "c.json"); });
    EXPECT_NE(message.find(needle), std::string::npos) << text << "\n" << message;
    EXPECT_EQ(message.rfind("c.json", 0), 0u) << message;
  }
  // A GPT-2-architecture decoder has no Llama layout.
  EXPECT_NE(error_of([] {
              models::llama_config_to_hf(models::GptConfig{});
            }).find("needs the Llama architecture"),
            std::string::npos);
}

// Backward is the loss's derivative: in float64 a central difference of the loss along a random
// direction of every parameter equals the gradient's projection on it. The strategy oracles
// compare runs that share the model's backward (its SwiGLU and attention functions), so a wrong
// gradient there would pass them; this would not.
TEST(Llama, GradientsAreTheLossesDerivativeInFloat64) {
  for (bool llama : {true, false}) {
    Model model = build_gpt(tiny_gpt(false, llama), nullptr);
    at::Generator generator = at::detail::createCPUGenerator(3);
    const at::Tensor tokens = at::randint(11, {3, 7}, generator, at::kLong);
    const at::Tensor inputs = tokens.narrow(1, 0, 6), targets = tokens.narrow(1, 1, 6);
    auto loss = [&] {
      return at::cross_entropy_loss(model(inputs).reshape({-1, 11}), targets.reshape({-1}));
    };
    std::vector<at::Tensor> parameters = model.module->parameters();
    std::vector<at::Tensor> direction;
    for (const auto& p : parameters)
      direction.push_back(at::randn(p.sizes(), generator, p.options()));
    loss().backward();
    double projected = 0;
    for (size_t i = 0; i < parameters.size(); ++i) {
      projected += (parameters[i].grad() * direction[i]).sum().item<double>();
    }
    const double step = 1e-5;
    auto moved = [&](double by) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < parameters.size(); ++i) parameters[i].add_(direction[i], by);
      const double value = loss().item<double>();
      for (size_t i = 0; i < parameters.size(); ++i) parameters[i].sub_(direction[i], by);
      return value;
    };
    const double difference = (moved(step) - moved(-step)) / (2 * step);
    EXPECT_NEAR(difference, projected, 1e-6 * std::abs(projected)) << (llama ? "llama" : "gpt");
  }
}

TEST(Llama, DataParallelAndZero3TrainLikeOneProcessInFloat64) {
  const int steps = 3;
  for (bool checkpointing : {false, true}) {
    test::Fixture f;
    f.spec.name = "llama";
    f.spec.gpt = small_llama();
    f.spec.gpt.norm = "layernorm";  // the registry entry's preset decides, not the spec
    if (checkpointing) f.spec.checkpointing = "2";
    f.optimizer = test::adam();
    f.global_batch = 8;
    at::Generator generator = at::detail::createCPUGenerator(5);
    at::Tensor tokens = at::randint(13, {8 * steps + 8}, generator, at::kLong);
    f.dataset = data::TensorDataset::windows(tokens, 8, 1);
    torch::manual_seed(11);
    const Model built = test::make_model_as(f.spec, f.dtype);
    EXPECT_EQ(built.module->named_parameters().find("blocks.0.ln1.bias"), nullptr);  // RMSNorm
    f.initial = test::snapshot(built);
    const auto single = test::train_single(f, steps);
    const auto ddp = test::train_distributed(f, 2, steps, [] {
      return std::make_unique<parallel::ddp::DdpStrategy>(parallel::StrategyOptions{});
    });
    EXPECT_LT(test::max_abs_diff(single, ddp), test::kTightBound) << checkpointing;
    const auto zero3 = test::train_distributed(
        f, 2, steps,
        [] { return std::make_unique<parallel::zero::Zero3Strategy>(parallel::StrategyOptions{}); },
        2);
    EXPECT_LT(test::max_abs_diff(single, zero3), test::kTightBound) << checkpointing;
  }
}
TEST(Llama, TensorAndSequenceParallelEqualTheSerialModelAndTrainLikeOneProcess) {
  const at::Tensor ids = random_tokens(3, 6, 21);
  const at::Tensor targets = random_tokens(3, 6, 22);
  for (bool sequence_parallel : {false, true}) {
    const SerialPass pass = serial_pass(tiny_gpt(false, true), ids, targets);
    const at::Tensor& logits = pass.logits;
    const Named& serial_grads = pass.grads;
    test::run_ranks(2, [&](const comm::CommunicatorPtr& world) {
      auto grid = std::make_shared<comm::ProcessGrid>(world, 2, 1);
      auto config = tiny_gpt(false, true);
      config.sequence_parallel = sequence_parallel;
      Model model = build_gpt(config, grid->tp());
      const auto splits = tp::parameter_splits(*model.module);
      const auto& head = splits.at("head.out.weight");
      const at::Tensor block = model(ids);
      EXPECT_LT((block - logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
                1e-12);
      model.loss(block, targets).backward();
      parallel::TensorParallelLayout layout =
          parallel::tensor_parallel_layout(*model.module, *grid);
      // RMSNorm has no bias, the linear layers none: 2 norms per block and the final one.
      EXPECT_EQ(layout.partial.size(), sequence_parallel ? 1u + 2u * 2 : 0u);
      EXPECT_LT(max_block_diff(summed_gradients(model, layout), serial_grads, splits), 1e-12)
          << sequence_parallel;
    });
  }
  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false, -1, true);
  GridRun run;
  run.llama = true;
  run.world = 2, run.tp = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 2";
  run.world = 8, run.pp = 2, run.micro = 2, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x PP 2 x TP 2";
  // Zero bubble: the column- and row-parallel layers and q, k, v defer their weight gradients
  // to W; RMSNorm's and the embedding's come from B.
  run.world = 4, run.strategy = "ddp", run.schedule = "zb-h1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2, zb-h1";
  // ZB-V: rank 0 holds the embedding's stage and the head's (the V's two ends).
  run.schedule = "zb-v";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 2, zb-v";
  run.schedule = "1f1b";
  run.world = 4, run.pp = 1, run.micro = 1, run.sequence_parallel = true;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 2, SP";
}

// Fewer key/value heads than tensor-parallel ranks: each is held by T / KV ranks (k and v
// replicated among them, their gradients summed), the model still equals the serial one, trains
// like one process (clipping counts the shared heads once), and its checkpoints resume at
// another layout; layouts it cannot serve are refused by name.
TEST(Llama, KeyValueHeadsSharedByTensorParallelRanksEqualTheSerialModel) {
  const at::Tensor ids = random_tokens(3, 8, 21);
  const at::Tensor targets = random_tokens(3, 8, 22);
  // (key/value heads, ranks): 2 heads over 4 ranks; one head (multi-query) over 2 and 4.
  for (const auto& [kv_heads, ranks] :
       std::vector<std::pair<int64_t, int>>{{2, 4}, {1, 2}, {1, 4}}) {
    for (bool sequence_parallel : {false, true}) {
      auto config = tiny_gpt(false, true);
      config.kv_heads = kv_heads;
      config.context = 8;
      const SerialPass pass = serial_pass(config, ids, targets);
      const at::Tensor& logits = pass.logits;
      const Named& serial_grads = pass.grads;
      const Named& serial_values = pass.values;
      const std::string what = "kv " + std::to_string(kv_heads) + " over " + std::to_string(ranks) +
                               (sequence_parallel ? ", SP" : "");
      test::run_ranks(ranks, [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, ranks, 1);
        auto local = config;
        local.sequence_parallel = sequence_parallel;
        Model model = build_gpt(local, grid->tp());
        const auto splits = tp::parameter_splits(*model.module);
        const auto& k = splits.at("blocks.0.k.weight");
        EXPECT_EQ(k.replicas, ranks / kv_heads) << what;
        EXPECT_EQ(k.replica, world->rank() % (ranks / kv_heads)) << what;
        const auto& head = splits.at("head.out.weight");
        const at::Tensor block = model(ids);
        EXPECT_LT((block - logits.narrow(-1, head.start, head.length)).abs().max().item<double>(),
                  1e-12)
            << what;
        model.loss(block, targets).backward();
        parallel::TensorParallelLayout layout =
            parallel::tensor_parallel_layout(*model.module, *grid);
        EXPECT_TRUE(layout.has_shared_blocks());
        std::vector<at::Tensor> params;
        std::vector<std::string> names;
        for (const auto& [name, p] : named_parameters(model)) {
          params.push_back(p);
          names.push_back(name);
        }
        // Before the sum a shared head's gradient is this rank's query heads' part only.
        Named grads;
        for (size_t i = 0; i < params.size(); ++i) grads[names[i]] = params[i].grad().clone();
        EXPECT_GT((grads.at("blocks.0.k.weight") -
                   block_of(serial_grads.at("blocks.0.k.weight"), splits, "blocks.0.k.weight"))
                      .abs()
                      .max()
                      .item<double>(),
                  1e-6)
            << what;
        layout.sum_partial_gradients(params, names);
        for (size_t i = 0; i < params.size(); ++i) grads[names[i]] = params[i].grad();
        EXPECT_LT(max_block_diff(grads, serial_grads, splits), 1e-12) << what;
        // Full tensors (a Hugging Face file's) load into the blocks, shared ones included.
        Model other = build_gpt(local, grid->tp());
        {
          torch::NoGradGuard no_grad;
          for (auto& p : other.module->parameters()) p.zero_();
        }
        models::load_full_tensors(*other.module, serial_values, what);
        EXPECT_LT(max_block_diff(named_values(other), serial_values, splits), 1e-15) << what;
      });
    }
  }

  const int steps = 3;
  const GptData d = gpt_data(steps);
  const Named serial = train_serial(d, steps, 0.0, false, -1, true);
  GridRun run;
  run.llama = true;
  run.world = 4, run.tp = 4;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "TP 4";
  // (Sequence parallelism with shared heads is checked above: these windows are 6 long.)
  run.world = 8, run.strategy = "zero1";
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "DP 2 x TP 4";
  run.world = 8, run.pp = 2, run.micro = 2;
  EXPECT_LT(train_on_grid(d, steps, run, serial), test::kTightBound) << "PP 2 x TP 4";
  // Clipping that bites: the shared heads' gradients count once in the norm.
  const Named clipped = train_serial(d, steps, 0.05, false, -1, true);
  GridRun clipping;
  clipping.llama = true, clipping.world = 4, clipping.tp = 4, clipping.max_grad_norm = 0.05;
  EXPECT_LT(train_on_grid(d, steps, clipping, clipped), test::kTightBound) << "TP 4, clipped";

  // A step at TP 4 saved (a shared head written once), two more at TP 2 and at TP 1 x DP 2.
  test::TempDir dir;
  GridRun writer;
  writer.llama = true, writer.world = 4, writer.tp = 4, writer.save_to = dir.path();
  train_on_grid(d, 1, writer, serial);
  for (int tp_size : {2, 1}) {
    GridRun reader;
    reader.llama = true, reader.world = 2, reader.tp = tp_size, reader.first_step = 1;
    reader.load_from = dir.path();
    EXPECT_LT(train_on_grid(d, steps, reader, serial), test::kTightBound)
        << "resumed at TP " << tp_size;
  }

  // zero2 shards the gradients it would sum first; heads neither side divides.
  test::run_ranks(4, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 4, 1);
    Model model = build_gpt(tiny_gpt(false, true), grid->tp());
    auto strategy = parallel::make_strategy("zero2", {});
    EXPECT_NE(
        test::error_of([&] {
          strategy->setup(model, optim::optimizer_factory(test::adam()), grid);
        }).find("zero2 shards the gradients of key/value heads that tensor-parallel ranks share"),
        std::string::npos);
  });
  test::run_ranks(6, [&](const comm::CommunicatorPtr& world) {
    auto grid = std::make_shared<comm::ProcessGrid>(world, 6, 1);
    auto config = tiny_gpt(false, true);
    config.heads = 12, config.kv_heads = 4, config.width = 24;
    EXPECT_NE(test::error_of([&] {
                build_gpt(config, grid->tp());
              }).find("--kv-heads (4) and --tensor-parallel (6): one must divide the other"),
              std::string::npos);
  });
}

// ZeRO-3 from a Hugging Face folder: each rank reads the rows its shards lie in (about 1/N of
// the file's bytes) and the gathered model equals the weights, for grouped-query (q, k, v as the
// file has them) and multi-head attention (qkv and fc1 interleaved from several tensors).
TEST(Llama, Zero3CutsItsShardsFromTheFile) {
  for (const int64_t kv_heads : {2, 4}) {
    auto config = small_llama();
    config.kv_heads = kv_heads, config.width = 64, config.ffn_width = 96, config.vocab = 50;
    models::ModelSpec spec;
    spec.name = "llama";
    spec.gpt = config;
    torch::manual_seed(11);
    const models::FullTensors serial = full_parameters(models::make_gpt(config));
    test::TempDir dir;
    nn::save_safetensors_folder(dir.path(), models::to_hf_llama(serial, config), 1LL << 30, {});
    int64_t file_bytes = 0;
    for (const auto& [name, t] : serial) file_bytes += static_cast<int64_t>(t.nbytes());
    for (const int ranks : {2, 3}) {
      std::vector<int64_t> read(ranks, 0);
      test::run_ranks(ranks, [&](const comm::CommunicatorPtr& world) {
        auto grid = std::make_shared<comm::ProcessGrid>(world, 1, 1);
        Model model = [&] {
          static std::mutex mutex;
          std::lock_guard<std::mutex> lock(mutex);
          torch::manual_seed(99);  // not the file's weights
          return models::make_gpt(config);
        }();
        parallel::zero::Zero3Strategy strategy(parallel::StrategyOptions{});
        strategy.setup(model, optim::optimizer_factory(test::adam()), grid);
        const models::WeightSource source = models::WeightSource::hf_llama(
            std::make_shared<const nn::SafeTensorsSet>(nn::SafeTensorsSet::open(dir.path())),
            config);
        train::load_weight_pieces(strategy.parameter_pieces(), *strategy.model().module, source,
                                  "test");
        read[world->rank()] = source.bytes_read();
        strategy.materialize();
        for (const auto& item : strategy.model().module->named_parameters()) {
          EXPECT_TRUE(item.value().equal(serial.at(item.key())))
              << item.key() << " kv " << kv_heads << " ranks " << ranks;
        }
      });
      int64_t total = 0;
      for (int r = 0; r < ranks; ++r) {
        // A shard's share, and a few rows at the edges of its runs.
        EXPECT_LT(read[r], file_bytes / ranks + file_bytes / 8) << "rank " << r << " of " << ranks;
        total += read[r];
      }
      EXPECT_GE(total, file_bytes);
    }
  }
}
