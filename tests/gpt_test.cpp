// Text data (UTF-8, tokenizer, windows, fortunes cleaning), the GPT model (causality, stages,
// weight tying), its distributed training against one process in float64, sampling from a
// trained checkpoint, and token shards resumed at other world sizes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "Oracle.h"
#include "RankThreads.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Text.h"
#include "dtrain/data/tokens/TokenDataset.h"
#include "dtrain/data/tokens/TokenFiles.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Generate.h"
#include "dtrain/train/Job.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/zero/Zero3Strategy.h"
#include "parallel/zero/ZeroStrategy.h"

namespace fs = std::filesystem;
using namespace dtrain;

namespace {

std::string scratch(const std::string& name) {
  const auto dir =
      fs::temp_directory_path() / ("dtrain-gpt-test-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

template <typename F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.message();
  }
  return "(no InputError)";
}

models::GptConfig tiny_gpt(int64_t vocab = 11) {
  models::GptConfig c;
  c.vocab = vocab;
  c.layers = 2;
  c.heads = 2;
  c.width = 8;
  c.context = 6;
  return c;
}

}  // namespace

TEST(Text, Utf8RoundTripsAndNamesTheOffsetOfBadBytes) {
  const std::string text = "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9D\x84\x9E";  // héllo € 𝄞
  const auto cps = data::decode_utf8(text, "t");
  ASSERT_EQ(cps.size(), 9u);
  EXPECT_EQ(cps[1], 0xE9u);
  EXPECT_EQ(cps[6], 0x20ACu);
  EXPECT_EQ(cps[8], 0x1D11Eu);
  EXPECT_EQ(data::encode_utf8(cps), text);
  EXPECT_NE(input_error([] {
              data::decode_utf8(std::string("ab\0c", 4), "f.bin");
            }).find("f.bin is not text: a NUL byte at offset 2"),
            std::string::npos);
  EXPECT_NE(input_error([] {
              data::decode_utf8("abc\xFF", "g");
            }).find("malformed sequence at byte offset 3 (byte 0xFF)"),
            std::string::npos);
  // Overlong '/', a lone continuation byte, a truncated sequence, a surrogate.
  for (const char* bad : {"\xC0\xAF", "\x80", "\xE2\x82", "\xED\xA0\x80"}) {
    EXPECT_NE(input_error([&] { data::decode_utf8(bad, "x"); }).find("malformed"),
              std::string::npos)
        << bad;
  }
}

TEST(Text, TokenizerRoundTripsAndNamesCharactersOutsideItsVocabulary) {
  const auto tokenizer = data::CharTokenizer::fit("hello, w\xC3\xB6rld", "t");
  EXPECT_EQ(tokenizer.size(), 10);  // " ,dehlorwö"
  const auto ids = tokenizer.encode("world");
  EXPECT_EQ(tokenizer.decode(ids), "world");
  const auto again = data::CharTokenizer::from_vocabulary(tokenizer.vocabulary_utf8());
  EXPECT_EQ(again.encode("h\xC3\xB6"), tokenizer.encode("h\xC3\xB6"));
  EXPECT_NE(input_error([&] {
              tokenizer.encode("hex");
            }).find("character 3 ('x', U+0078) is not in the model's vocabulary"),
            std::string::npos);
}

TEST(Text, LoadsSplitsContiguouslyAndShiftsTargetsByOne) {
  const std::string dir = scratch("load");
  std::string text;
  for (int i = 0; i < 50; ++i) text += static_cast<char>('a' + i % 7);
  write(dir + "/corpus.txt", text);
  const auto data = data::load_text(dir + "/corpus.txt", 4, 0.2);
  EXPECT_EQ(data.train_tokens, 40);
  EXPECT_EQ(data.validation_tokens, 10);
  EXPECT_EQ(data.train.size(), 40 - 4);  // every window with a next-token target
  EXPECT_EQ(data.validation.size(), 2);  // non-overlapping: [40,44) and [44,48)
  const auto all = data.tokenizer.encode(text);
  const auto batch = data.train.get({0, 5});
  ASSERT_EQ(batch.inputs.sizes(), (std::vector<int64_t>{2, 4}));
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(batch.inputs[1][t].item<int64_t>(), all[5 + t]);
    EXPECT_EQ(batch.targets[1][t].item<int64_t>(), all[6 + t]);
  }
  EXPECT_TRUE(torch::equal(data.train.get_targets({0, 5}), batch.targets));
  const auto held_out = data.validation.slice(1, 2);
  EXPECT_EQ(held_out.inputs[0][0].item<int64_t>(), all[44]);
  EXPECT_EQ(held_out.targets[0][3].item<int64_t>(), all[48]);

  write(dir + "/short.txt", "abcdefgh");
  EXPECT_NE(input_error([&] {
              data::load_text(dir + "/short.txt", 4, 0.2);
            }).find("too short for windows of --context 4"),
            std::string::npos);
  write(dir + "/empty.txt", "");
  EXPECT_NE(input_error([&] { data::load_text(dir + "/empty.txt", 4); }).find("is empty"),
            std::string::npos);
  write(dir + "/binary", std::string("PK\x03\x04\0\0", 6));
  EXPECT_NE(input_error([&] { data::load_text(dir + "/binary", 4); }).find("NUL byte"),
            std::string::npos);
  EXPECT_NE(input_error([&] { data::load_text(dir + "/missing.txt", 4); }).find("does not exist"),
            std::string::npos);
}

TEST(Text, ReadsAFortuneDirectoryWithoutIndexesSeparatorsOrOverstriking) {
  const std::string dir = scratch("fortunes");
  write(dir + "/b", "second\n%\nthird\n");
  write(dir + "/a", "_\bu_\bn_\bd_\be_\br lined\n%\n");
  write(dir + "/a.dat", std::string("\0\0\0\x02", 4));  // binary index: skipped
  fs::create_symlink(dir + "/a", dir + "/a.u8");
  EXPECT_EQ(data::read_text_corpus(dir), "under lined\n\nsecond\n\nthird\n");
  const std::string empty = scratch("no-text");
  write(empty + "/x.dat", "1");
  EXPECT_NE(input_error([&] { data::read_text_corpus(empty); }).find("has no text files"),
            std::string::npos);
}

TEST(Gpt, EachPositionSeesOnlyItsPast) {
  torch::manual_seed(1);
  Model model = models::make_gpt(tiny_gpt());
  model.module->to(at::kDouble);
  model.module->eval();
  at::Tensor ids = torch::randint(11, {2, 6}, at::kLong);
  at::Tensor changed = ids.clone();
  changed.select(1, 4).fill_((ids[0][4].item<int64_t>() + 1) % 11);
  const at::Tensor a = model(ids), b = model(changed);
  ASSERT_EQ(a.sizes(), (std::vector<int64_t>{2, 6, 11}));
  EXPECT_EQ((a.narrow(1, 0, 4) - b.narrow(1, 0, 4)).abs().max().item<double>(), 0.0);
  EXPECT_GT((a.narrow(1, 4, 2) - b.narrow(1, 4, 2)).abs().max().item<double>(), 1e-6);
  EXPECT_NE(input_error([&] {
              model(torch::zeros({1, 7}, at::kLong));
            }).find("longer than the model's context of 6"),
            std::string::npos);
}

// The FLOPs per token MFU is computed from: 6 per weight of the matrices the built model
// multiplies by (every 2-D parameter but the embeddings', and the tied head's once more) plus
// attention's 12 x layers x width x context, for GPT's and Llama's architectures, tied or not.
TEST(Gpt, TrainingFlopsPerTokenCountEveryMatrixTheModelMultipliesBy) {
  for (bool llama : {false, true}) {
    for (bool tied : {false, true}) {
      auto config = tiny_gpt(13);
      config.tied_embeddings = tied;
      config.heads = 4;
      if (llama) {
        config.norm = "rmsnorm";
        config.position = "rope";
        config.mlp = "swiglu";
        config.bias = false;
        config.kv_heads = 2;
      }
      torch::manual_seed(3);
      Model model = models::make_gpt(config);
      double weights = tied ? static_cast<double>(config.vocab * config.width) : 0.0;
      for (const auto& item : model.module->named_parameters()) {
        if (item.value().dim() == 2 && item.key().rfind("embedding.", 0) != 0) {
          weights += static_cast<double>(item.value().numel());
        }
      }
      const double attention = 12.0 * config.layers * config.width * config.context;
      EXPECT_DOUBLE_EQ(models::gpt_training_flops_per_token(config), 6 * weights + attention)
          << "llama " << llama << " tied " << tied;
    }
  }
}

TEST(Gpt, StagesComposeToTheModelAndTyingSharesTheEmbedding) {
  for (bool tied : {false, true}) {
    auto config = tiny_gpt();
    config.tied_embeddings = tied;
    torch::manual_seed(2);
    Model model = models::make_gpt(config);
    ASSERT_EQ(model.stages.size(), 4u);  // embedding, 2 blocks, head
    EXPECT_EQ(model.stages.front().name, "embedding");
    EXPECT_EQ(model.stages.back().name, "head");
    int64_t count = 0;
    for (const auto& p : model.module->parameters()) count += p.numel();
    EXPECT_EQ(count, models::gpt_parameter_count(config)) << tied;
    at::Tensor ids = torch::randint(11, {3, 5}, at::kLong);
    at::Tensor h = ids;
    for (const auto& stage : model.stages) h = stage.forward(h);
    EXPECT_TRUE(torch::equal(h, model(ids)));
  }
  // Tied: the head's gradient reaches the embedding's weight.
  auto config = tiny_gpt();
  config.tied_embeddings = true;
  Model model = models::make_gpt(config);
  model.stages.back().forward(torch::randn({1, 2, 8})).sum().backward();
  EXPECT_GT(
      model.module->named_parameters()["embedding.token.weight"].grad().abs().sum().item<double>(),
      0);
  EXPECT_NE(input_error([] {
              auto c = tiny_gpt();
              c.width = 9;
              models::make_gpt(c);
            }).find("--width (9) must be a positive multiple of --heads (2)"),
            std::string::npos);
}

namespace {

test::Fixture gpt_fixture(int steps, int64_t global_batch, bool checkpointing = false) {
  test::Fixture f;
  f.spec.name = "gpt";
  f.spec.gpt = tiny_gpt();
  f.spec.gpt.dropout = 0.0;
  if (checkpointing) f.spec.checkpointing = "2";
  f.optimizer = test::adam();
  f.global_batch = global_batch;
  at::Generator generator = at::detail::createCPUGenerator(5);
  at::Tensor tokens = at::randint(11, {global_batch * steps + 8}, generator, at::kLong);
  f.dataset = data::TensorDataset::windows(tokens, 6, 1);
  torch::manual_seed(11);
  f.initial = test::snapshot(test::make_model_as(f.spec, f.dtype));
  return f;
}

}  // namespace

TEST(Gpt, DataParallelAndZero3TrainLikeOneProcessInFloat64) {
  const int steps = 3;
  for (bool checkpointing : {false, true}) {
    const auto f = gpt_fixture(steps, 8, checkpointing);
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
    // ZeRO-2 with small buckets and the parameter gathers left running into the next forward,
    // which runs the stages (each checkpointed one a segment of its own) waiting bucket by
    // bucket.
    parallel::StrategyOptions overlapped;
    overlapped.bucket_cap_bytes = 4096;
    overlapped.first_bucket_cap_bytes = 1024;
    overlapped.of<parallel::zero::ZeroOverlapOptions>().param_gather = true;
    const auto zero2 = test::train_distributed(
        f, 2, steps, [&] { return std::make_unique<parallel::zero::ZeroStrategy>(overlapped, 2); },
        2);
    EXPECT_LT(test::max_abs_diff(single, zero2), test::kTightBound) << checkpointing;
    // The oracle notices one rank's gradient left out.
    const auto dropped = test::train_distributed(
        f, 2, steps,
        [] { return std::make_unique<parallel::ddp::DdpStrategy>(parallel::StrategyOptions{}); }, 1,
        [](const comm::CommunicatorPtr& comm) { return test::drop_rank_gradient(1, comm); });
    EXPECT_GT(test::max_abs_diff(single, dropped), 1e-6);
  }
}

TEST(Gpt, TrainsOnTextCheckpointsItsVocabularyAndGenerates) {
  const std::string dir = scratch("job");
  std::string text;
  for (int i = 0; i < 40; ++i) text += "the cat sat on the mat. ";
  write(dir + "/corpus.txt", text);
  train::JobConfig job;
  job.model.name = "gpt";
  job.dataset = "text";
  job.data.text_file = dir + "/corpus.txt";
  job.model.gpt.layers = 1;
  job.model.gpt.heads = 2;
  job.model.gpt.width = 16;
  job.model.gpt.context = 8;
  job.trainer.optimizer.name = "adam";
  job.trainer.optimizer.lr = 1e-2;
  job.trainer.optimizer.momentum = 0;
  job.trainer.optimizer.weight_decay = 0;
  job.trainer.batch_size = 16;
  job.trainer.max_steps = 150;
  job.trainer.eval_every = 10;
  job.trainer.progress = false;
  job.trainer.checkpoint_dir = dir + "/ckpt";
  job.threads = 1;
  train::validate_job(job);
  const auto result = train::run_job(job);
  ASSERT_TRUE(result.fit.validation.has_value());
  // The text is a repeated sentence: a model that learned anything beats the uniform guess.
  EXPECT_LT(result.fit.validation->loss, std::log(10.0) - 0.5);
  const auto meta = train::read_meta(train::resolve_checkpoint(dir + "/ckpt"));
  EXPECT_EQ(meta.extras.at("vocabulary"), " .acehmnost");
  EXPECT_EQ(models::gpt_config_from_json(meta.extras.at("model"), "m").width, 16);

  train::GenerateOptions options;
  options.checkpoint = dir + "/ckpt";
  options.prompt = "the c";
  options.tokens = 12;
  options.temperature = 0;
  options.threads = 1;
  std::string streamed;
  const std::string greedy =
      train::generate_text(options, [&](const std::string& piece) { streamed += piece; });
  EXPECT_EQ(greedy, streamed);
  EXPECT_EQ(greedy.size(), 5u + 12u);
  // The trained weights were loaded: the greedy continuation is the repeated sentence.
  EXPECT_EQ(greedy, "the cat sat on th") << greedy;
  EXPECT_EQ(greedy.rfind("the c", 0), 0u);
  EXPECT_EQ(train::generate_text(options), greedy);  // greedy is deterministic
  options.temperature = 1.0;
  options.top_k = 3;
  options.seed = 4;
  const std::string sampled = train::generate_text(options);
  EXPECT_EQ(sampled, train::generate_text(options));  // so is a seeded sample
  options.prompt = "dog";
  EXPECT_NE(input_error([&] {
              train::generate_text(options);
            }).find("character 1 ('d', U+0064) is not in the model's vocabulary"),
            std::string::npos);
  // The consolidated file loads into a fresh GPT (whose Dropout modules hold no tensors, so
  // torch::load refuses it) and gives the trained model: the same greedy continuation.
  train::consolidate_checkpoint(train::resolve_checkpoint(dir + "/ckpt"), dir + "/whole.pt");
  torch::manual_seed(99);
  Model fresh = models::make_gpt(models::gpt_config_from_json(meta.extras.at("model"), "m"));
  train::load_consolidated(*fresh.module, dir + "/whole.pt");
  fresh.module->eval();
  {
    torch::NoGradGuard no_grad;
    const auto tokenizer = data::CharTokenizer::from_vocabulary(meta.extras.at("vocabulary"));
    auto ids = tokenizer.encode("the c");
    for (int i = 0; i < 12; ++i) {
      const auto first = ids.end() - static_cast<std::ptrdiff_t>(std::min<size_t>(ids.size(), 8));
      at::Tensor window =
          at::tensor(std::vector<int64_t>(first, ids.end()), at::kLong).unsqueeze(0);
      ids.push_back(fresh(window).select(1, window.size(1) - 1).argmax(-1).item<int64_t>());
    }
    EXPECT_EQ(tokenizer.decode(ids), greedy);
  }

  // A checkpoint of a model that is not a language model (no sizes or vocabulary recorded).
  const std::string other = dir + "/not-a-language-model";
  fs::copy(train::resolve_checkpoint(dir + "/ckpt"), other);
  auto stripped = train::read_meta(other);
  stripped.extras.clear();
  train::write_meta(other, stripped);
  train::GenerateOptions elsewhere = options;
  elsewhere.checkpoint = other;
  elsewhere.prompt = "the";
  EXPECT_NE(input_error([&] { train::generate_text(elsewhere); }).find("holds no language model"),
            std::string::npos);
  options.prompt = "the";
  options.top_k = -1;
  EXPECT_NE(input_error([&] { train::generate_text(options); }).find("--top-k must be >= 0"),
            std::string::npos);

  // Flags that cannot work together are named before anything runs.
  train::JobConfig bad = job;
  bad.dataset = "fashion-mnist";
  EXPECT_NE(input_error([&] {
              train::validate_job(bad);
            }).find("--model gpt is a language model: use it with --dataset text"),
            std::string::npos);
  bad = job;
  bad.model.name = "mlp";
  EXPECT_NE(input_error([&] { train::validate_job(bad); }).find("--dataset text needs --model gpt"),
            std::string::npos);
  bad = job;
  bad.model.gpt.context = 4000;
  EXPECT_NE(input_error([&] { train::validate_job(bad); }).find("too short"), std::string::npos);
}

// Token shards through the Trainer: a run checkpointed at 4 ranks, resumed at 2, then at 3
// (global batch 12 throughout) reads the same global samples in the same order as the
// uninterrupted 2-rank run, so a float64 GPT ends with the same weights and losses.
TEST(Gpt, TokenShardsResumeAtOtherWorldSizesOnTheSameSamples) {
  at::set_num_threads(1);
  const std::string dir = scratch("tokens");
  {
    data::tokens::IndexedWriter writer(dir + "/corpus", data::tokens::TokenType::kUInt16);
    at::Generator generator = at::detail::createCPUGenerator(3);
    for (int d = 0; d < 60; ++d) {
      const int64_t length = 1 + at::randint(20, {1}, generator, at::kLong).item<int64_t>();
      at::Tensor tokens = at::randint(11, {length}, generator, at::kLong);
      writer.add_document(tokens.data_ptr<int64_t>(), length);
    }
    writer.finish();
  }
  data::tokens::TokenSetOptions token_options;
  token_options.spec = dir + "/corpus";
  token_options.context = 6;
  token_options.train_samples = 12 * 12;
  token_options.seed = 5;
  const data::tokens::TokenSplits splits = data::tokens::load_token_splits(token_options);
  ASSERT_TRUE(splits.train.presampled());
  models::ModelSpec spec;
  spec.name = "gpt";
  spec.gpt = tiny_gpt(splits.vocabulary);
  spec.gpt.dropout = 0;
  train::TrainerOptions options;
  options.token_loss = true;
  options.optimizer.name = "adam";
  options.optimizer.lr = 1e-2;
  options.optimizer.momentum = 0;
  options.max_steps = 12;
  options.progress = false;
  struct Out {
    std::vector<double> losses;
    std::vector<at::Tensor> weights;
  };
  auto run = [&](int world, const train::TrainerOptions& o) {
    Out out;
    std::vector<Model> models;
    for (int r = 0; r < world; ++r) {
      torch::manual_seed(17);
      models.push_back(models::make_model(spec));
      models.back().module->to(at::kDouble);
    }
    test::run_ranks(
        world,
        [&](const comm::CommunicatorPtr& comm) {
          train::TrainerOptions mine = o;
          mine.batch_size = 12 / world;
          train::Trainer trainer(mine, comm);
          auto result = trainer.fit(models[comm->rank()], splits.train, nullptr);
          if (comm->rank() == 0) {
            out.losses = result.losses;
            for (const auto& p : trainer.strategy().model().module->parameters()) {
              out.weights.push_back(p.detach().clone());
            }
          }
        },
        std::chrono::seconds(60));
    return out;
  };
  const Out full = run(2, options);
  options.checkpoint_dir = dir + "/ckpt";
  options.checkpoint_every = 4;
  options.stop_at_step = 4;
  const Out first = run(4, options);
  options.stop_at_step = 8;
  const Out second = run(2, options);
  options.stop_at_step = 0;
  const Out third = run(3, options);
  std::vector<double> resumed = first.losses;
  resumed.insert(resumed.end(), second.losses.begin(), second.losses.end());
  resumed.insert(resumed.end(), third.losses.begin(), third.losses.end());
  ASSERT_EQ(resumed.size(), full.losses.size());
  for (size_t s = 0; s < resumed.size(); ++s) {
    EXPECT_NEAR(resumed[s], full.losses[s], 1e-12) << "step " << s + 1;
  }
  for (size_t i = 0; i < full.weights.size(); ++i) {
    EXPECT_LE((full.weights[i] - third.weights[i]).abs().max().item<double>(), 1e-10);
  }
}

// Activation checkpointing changes memory, not numbers: with dropout on (drawn from the model's
// own generators, which the recomputation must replay), whole-block segments and selective
// recomputation of attention's core give the gradients of no checkpointing, in float64, for a
// GPT and a Llama (rotary, grouped-query attention).
TEST(Gpt, CheckpointingReplaysDropoutAndEqualsNoCheckpointing) {
  at::set_num_threads(1);
  for (const bool llama : {false, true}) {
    auto gradients = [llama](const std::string& checkpointing) {
      auto c = tiny_gpt();
      c.layers = 3;
      c.dropout = 0.25;
      c.checkpointing = checkpointing;
      if (llama) {
        c.heads = 4;
        c.kv_heads = 2;
        models::llama_preset(c);
      }
      torch::manual_seed(7);
      Model model = models::make_gpt(c);
      model.module->to(at::kDouble);
      model.module->train();
      const at::Tensor ids = at::randint(11, {3, 6}, at::kLong);
      const at::Tensor logits = model(ids);
      at::cross_entropy_loss(logits.reshape({-1, 11}), ids.reshape({-1})).backward();
      std::vector<at::Tensor> grads;
      for (const auto& p : model.module->parameters()) grads.push_back(p.grad().clone());
      return grads;
    };
    const auto plain = gradients("none");
    for (const std::string checkpointing : {"2", "selective"}) {
      const auto recomputed = gradients(checkpointing);
      ASSERT_EQ(recomputed.size(), plain.size());
      double worst = 0;
      for (size_t i = 0; i < plain.size(); ++i) {
        worst = std::max(worst, (plain[i] - recomputed[i]).abs().max().item<double>());
      }
      EXPECT_LT(worst, 1e-12) << (llama ? "llama " : "gpt ") << checkpointing;
    }
  }
}
