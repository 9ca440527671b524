// Models built as placeholders (nn/DeferredInit.h): initial values drawn from (seed, name,
// element index) alone, so any part equals that part of the whole; a decoder built so equals the
// one built whole; ZeRO-3 draws only its shards and trains like one process in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "Oracle.h"
#include "dtrain/models/Gpt.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/train/Trainer.h"
#include "parallel/zero/Zero3Strategy.h"

using namespace dtrain;

namespace {

at::Tensor drawn(const nn::InitRule& rule, uint64_t key, const std::vector<int64_t>& shape,
                 const nn::tensor::ParameterSplit* split = nullptr, int64_t begin = 0,
                 int64_t count = -1, at::ScalarType dtype = at::kFloat) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  at::Tensor out = at::empty({count < 0 ? numel - begin : count}, dtype);
  nn::fill_keyed(out, rule, key, shape, split, begin);
  return out;
}

// A Llama of two blocks, vocabulary 40, width 16 (4 heads, 2 key/value heads), context 8.
models::GptConfig tiny_llama() {
  models::GptConfig config;
  config.vocab = 40;
  config.layers = 2;
  config.heads = 4;
  config.kv_heads = 2;
  config.width = 16;
  config.context = 8;
  models::llama_preset(config);
  return config;
}

}  // namespace

TEST(DeferredInit, AnyPartOfAParameterIsThatPartOfTheWhole) {
  const nn::InitRule rule = nn::InitRule::normal(0.02);
  const uint64_t key = nn::parameter_key(7, "blocks.0.fc1.weight");
  const at::Tensor whole = drawn(rule, key, {6, 10}).view({6, 10});
  // A column-parallel block (rows 2..4) and a row-parallel one (columns 3..8), drawn alone.
  nn::tensor::ParameterSplit rows{0, 2, 3, {6, 10}};
  EXPECT_TRUE(at::equal(drawn(rule, key, {3, 10}, &rows).view({3, 10}), whole.narrow(0, 2, 3)));
  nn::tensor::ParameterSplit columns{1, 3, 5, {6, 10}};
  const at::Tensor block = drawn(rule, key, {6, 5}, &columns).view({6, 5});
  EXPECT_TRUE(at::equal(block, whole.narrow(1, 3, 5)));
  // A shard of the block: elements 7..18 of its flat values, in float64 (float32's values).
  EXPECT_TRUE(at::equal(drawn(rule, key, {6, 5}, &columns, 7, 12, at::kDouble),
                        block.flatten().narrow(0, 7, 12).to(at::kDouble)));
  // Another name or seed is another stream.
  EXPECT_FALSE(at::equal(drawn(rule, nn::parameter_key(7, "blocks.1.fc1.weight"), {6, 10}),
                         whole.flatten()));
  EXPECT_FALSE(at::equal(drawn(rule, nn::parameter_key(8, "blocks.0.fc1.weight"), {6, 10}),
                         whole.flatten()));
}

TEST(DeferredInit, TheRulesDrawTheirDistributions) {
  const int64_t n = 200000;
  const uint64_t key = nn::parameter_key(1, "w");
  const at::Tensor normal = drawn(nn::InitRule::normal(0.02), key, {n}).to(at::kDouble);
  EXPECT_LT(std::abs(normal.mean().item<double>()), 4 * 0.02 / std::sqrt(double(n)));
  EXPECT_NEAR(normal.std().item<double>(), 0.02, 0.02 * 0.01);
  // Gaussian tails: about 4.55% beyond two standard deviations.
  EXPECT_NEAR((normal.abs() > 0.04).to(at::kDouble).mean().item<double>(), 0.0455, 0.003);
  const at::Tensor uniform = drawn(nn::InitRule::uniform(0.5), key, {n}).to(at::kDouble);
  EXPECT_GE(uniform.min().item<double>(), -0.5);
  EXPECT_LT(uniform.max().item<double>(), 0.5);
  EXPECT_NEAR(uniform.std().item<double>(), 1.0 / std::sqrt(12.0), 0.005);
  EXPECT_TRUE(at::equal(drawn(nn::InitRule::constant(1), key, {5}), at::ones({5})));
}

// Built as placeholders and drawn whole, a Llama equals the one built whole from the same seed;
// the placeholders hold no memory until then.
TEST(DeferredInit, ADecoderBuiltAsPlaceholdersEqualsTheOneBuiltWhole) {
  const models::GptConfig config = tiny_llama();
  torch::manual_seed(5);
  const Model whole = models::make_gpt(config);
  torch::manual_seed(5);
  Model deferred = models::make_gpt(config, nullptr, /*deferred=*/true);
  ASSERT_TRUE(deferred.deferred && deferred.deferred->pending());
  for (const auto& p : deferred.module->parameters()) EXPECT_EQ(p.storage().nbytes(), 0u);
  deferred.deferred->materialize_all();
  const auto a = whole.module->named_parameters(), b = deferred.module->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key(), b[i].key());
    EXPECT_TRUE(at::equal(a[i].value(), b[i].value())) << a[i].key();
  }
  const at::Tensor ids = at::randint(40, {2, 8}, at::kLong);
  EXPECT_TRUE(at::equal(whole(ids), deferred(ids)));
}

// Started from a weights file, a model of placeholders takes each parameter's values from the
// file as it is built, and only then (a pipeline rank builds its stages alone): the file's names
// and shapes are checked first, placeholders are not read, and the built parameters equal the
// file's.
TEST(DeferredInit, PlaceholdersBuiltFromAWeightsFileReadOnlyWhatIsBuilt) {
  const models::GptConfig config = tiny_llama();
  torch::manual_seed(9);
  const Model other = models::make_gpt(config);  // the file's values: another seed's model
  models::FullTensors file;
  for (const auto& item : other.module->named_parameters()) file[item.key()] = item.value();
  for (const auto& item : other.module->named_buffers()) file[item.key()] = item.value();
  const models::WeightSource source = models::WeightSource::in_memory(file);
  torch::manual_seed(5);
  Model model = models::make_gpt(config, nullptr, /*deferred=*/true);
  models::load_weights(*model.module, source, "weights");  // checks; reads no placeholder
  std::vector<std::string> read;
  auto from_file = models::weights_source(*model.module, source, "weights");
  model.deferred->set_source([&](const std::string& name, at::Tensor out) {
    read.push_back(name);
    from_file(name, std::move(out));
  });
  std::vector<at::Tensor> stage;  // the second block's parameters, as a pipeline rank's
  std::vector<std::string> names;
  for (const auto& item : model.module->named_parameters()) {
    if (item.key().rfind("blocks.1.", 0) != 0) continue;
    stage.push_back(item.value());
    names.push_back(item.key());
  }
  ASSERT_FALSE(stage.empty());
  model.deferred->materialize(stage);
  std::sort(read.begin(), read.end());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(read, names);
  for (const auto& item : model.module->named_parameters()) {
    if (item.key().rfind("blocks.1.", 0) == 0) {
      EXPECT_TRUE(at::equal(item.value(), file.at(item.key()))) << item.key();
    } else {
      EXPECT_TRUE(nn::is_placeholder(item.value())) << item.key();
    }
  }
  // A file with a tensor of another shape is refused before anything is built.
  models::FullTensors wrong = file;
  wrong.at(names.front()) = at::zeros({3});
  torch::manual_seed(5);
  Model again = models::make_gpt(config, nullptr, /*deferred=*/true);
  EXPECT_THROW(models::load_weights(*again.module, models::WeightSource::in_memory(wrong), "w"),
               InputError);
}

// ZeRO-3 given a model of placeholders draws each rank's shard of each parameter (the others
// are never drawn) and trains exactly as one process that built the whole model, in float64.
TEST(DeferredInit, Zero3DrawsItsShardsAndTrainsLikeOneProcessInFloat64) {
  for (bool llama : {false, true}) {
    test::Fixture f;
    f.spec.name = llama ? "llama" : "gpt";
    f.spec.gpt.vocab = 11;
    f.spec.gpt.layers = 2;
    f.spec.gpt.heads = 2;
    f.spec.gpt.width = 8;
    f.spec.gpt.context = 6;
    f.optimizer = test::adam();
    f.global_batch = 8;
    const int steps = 3;
    at::Generator generator = at::detail::createCPUGenerator(5);
    const at::Tensor tokens = at::randint(11, {f.global_batch * steps + 8}, generator, at::kLong);
    f.dataset = data::TensorDataset::windows(tokens, 6, 1);
    torch::manual_seed(11);
    f.initial = test::snapshot(test::make_model_as(f.spec, f.dtype));
    const auto single = test::train_single(f, steps);
    models::ModelSpec placeholders = f.spec;
    placeholders.deferred = true;
    auto build = [&] {
      torch::manual_seed(11);
      Model model = test::make_model_as(placeholders, f.dtype);
      EXPECT_TRUE(model.deferred && model.deferred->pending());
      return model;
    };
    auto zero3 = [] {
      return std::make_unique<parallel::zero::Zero3Strategy>(parallel::StrategyOptions{});
    };
    for (int world : {2, 4}) {
      const auto sharded = test::train_distributed(f, world, steps, zero3, 1, nullptr, build);
      EXPECT_LT(test::max_abs_diff(single, sharded), test::kTightBound)
          << f.spec.name << " on " << world;
    }
    // The bound notices a model drawn from another seed.
    auto other = [&] {
      torch::manual_seed(12);
      return test::make_model_as(placeholders, f.dtype);
    };
    EXPECT_GT(
        test::max_abs_diff(single, test::train_distributed(f, 2, steps, zero3, 1, nullptr, other)),
        1e-3);
  }
}

// Trainer::prepare (your own loop) with a model of placeholders and a strategy that does not
// draw its parts (ddp): the strategy gets the whole model, equal to one built whole.
TEST(DeferredInit, AStrategyThatDoesNotDrawThemGetsTheWholeModel) {
  models::GptConfig config;
  config.vocab = 11;
  config.layers = 1;
  config.heads = 2;
  config.width = 8;
  config.context = 6;
  torch::manual_seed(5);
  const Model whole = models::make_gpt(config);
  torch::manual_seed(5);
  Model deferred = models::make_gpt(config, nullptr, /*deferred=*/true);
  train::TrainerOptions options;
  options.strategy = "ddp";
  options.progress = false;
  train::Trainer trainer(options);
  const at::Tensor ids = at::randint(11, {2, 7}, at::kLong);
  parallel::Strategy& strategy =
      trainer.prepare(deferred, {ids.narrow(1, 0, 6), ids.narrow(1, 1, 6)});
  const auto a = whole.module->named_parameters();
  const auto b = strategy.model().module->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i].value(), b[i].value())) << a[i].key();
  }
  strategy.train_step({{ids.narrow(1, 0, 6), ids.narrow(1, 1, 6)}}, parallel::cross_entropy);
}
