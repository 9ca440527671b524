// Token shards: Megatron's indexed files and llm.c's shards read and written, their bad forms
// refused by name, and the samples (packing, shuffle, epochs, blends, held-out split) equal to
// Megatron's GPTDataset and BlendedDataset, with tests/data/megatron_oracle.py (NumPy, written
// from Megatron's code) as the oracle.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "InputErrors.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/tokens/GptIndex.h"
#include "dtrain/data/tokens/TokenDataset.h"
#include "dtrain/data/tokens/TokenFiles.h"

using namespace dtrain;
using namespace dtrain::data::tokens;
using dtrain::test::error_of;
using dtrain::test::TempDir;

namespace {

std::string oracle() { return std::string(DTRAIN_SOURCE_DIR) + "/tests/data/megatron_oracle.py"; }

int run_oracle(const std::string& arguments) {
  const std::string command = std::string(DTRAIN_PYTHON) + " " + oracle() + " " + arguments;
  return std::system(command.c_str());
}

// Every sample of a split, [n, context + 1], for the oracle to compare.
void save_samples(const data::TensorDataset& set, const std::string& path) {
  std::vector<int64_t> all(set.size());
  for (int64_t i = 0; i < set.size(); ++i) all[i] = i;
  const data::Batch batch = set.get(all);
  at::Tensor rows = at::cat({batch.inputs, batch.targets.narrow(1, -1, 1)}, 1).contiguous();
  save_npy(path, rows.data_ptr<int64_t>(), "<i8", {rows.size(0), rows.size(1)});
}

void write_case(const TempDir& dir, const std::string& name, const std::string& json) {
  std::ofstream(dir / (name + ".json")) << json;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(NumpyRandomState, ShufflesAsNumpy) {
  // numpy.random.RandomState(1234).shuffle(numpy.arange(10)) and the first randint draws.
  NumpyRandomState random(1234);
  std::vector<int> values{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  random.shuffle(values);
  EXPECT_EQ(values, (std::vector<int>{7, 2, 9, 1, 0, 8, 4, 5, 6, 3}));
}

TEST(TokenFiles, ReadsWhatMegatronAndLlmcWrite) {
  TempDir dir;
  ASSERT_EQ(run_oracle("write " + dir.path()), 0);
  const TokenCorpus a = TokenCorpus::open({dir / "a_text_document"});
  EXPECT_EQ(a.documents(), 50);
  const TokenCorpus b = TokenCorpus::open({dir / "b_text_document.idx"});
  EXPECT_EQ(b.documents(), 30);
  EXPECT_GE(b.max_token().id, 65536);  // int32 ids above uint16's range
  const TokenCorpus shards = TokenCorpus::open({dir / "shards"});
  EXPECT_EQ(shards.documents(), 3);
  EXPECT_EQ(shards.document_length(0), 300);
  const TokenCorpus wide = TokenCorpus::open({dir / "wide.bin"});
  std::vector<int64_t> ids(4);
  wide.read(0, 0, 4, ids.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 100000, 2147483647}));
  EXPECT_EQ(wide.max_token().id, 2147483647);
  EXPECT_EQ(wide.max_token().position, 3);
}

TEST(TokenFiles, WritesWhatItReadsByteForByte) {
  TempDir dir;
  ASSERT_EQ(run_oracle("write " + dir.path()), 0);
  // Megatron: the same documents rewritten give the same two files.
  const TokenCorpus a = TokenCorpus::open({dir / "a_text_document"});
  IndexedWriter writer(dir / "copy", TokenType::kUInt16);
  for (int64_t d = 0; d < a.documents(); ++d) {
    std::vector<int64_t> tokens(a.document_length(d));
    a.read(d, 0, a.document_length(d), tokens.data());
    writer.add_document(tokens.data(), static_cast<int64_t>(tokens.size()));
  }
  writer.finish();
  EXPECT_EQ(read_bytes(dir / "copy.bin"), read_bytes(dir / "a_text_document.bin"));
  EXPECT_EQ(read_bytes(dir / "copy.idx"), read_bytes(dir / "a_text_document.idx"));
  // llm.c, both widths.
  for (const std::string name : {"shards/c_val_000000.bin", "wide.bin"}) {
    const TokenCorpus shard = TokenCorpus::open({dir / name});
    std::vector<int64_t> tokens(shard.document_length(0));
    shard.read(0, 0, shard.document_length(0), tokens.data());
    write_llmc_shard(dir / "copy-llmc.bin", tokens.data(), static_cast<int64_t>(tokens.size()),
                     name == "wide.bin");
    EXPECT_EQ(read_bytes(dir / "copy-llmc.bin"), read_bytes(dir / name)) << name;
  }
}

TEST(TokenFiles, RefusesBadFilesByName) {
  TempDir dir;
  ASSERT_EQ(run_oracle("write " + dir.path()), 0);
  const std::string idx = read_bytes(dir / "a_text_document.idx");
  const std::string bin = read_bytes(dir / "a_text_document.bin");
  auto megatron = [&](const std::string& index, const std::string& tokens) {
    write_bytes(dir / "bad.idx", index);
    write_bytes(dir / "bad.bin", tokens);
    return error_of([&] { TokenCorpus::open({dir / "bad"}); });
  };
  EXPECT_NE(megatron(idx, bin.substr(0, bin.size() - 2)).find("disagree"), std::string::npos);
  EXPECT_NE(megatron(idx, bin + "xx").find("disagree"), std::string::npos);
  EXPECT_NE(megatron(idx.substr(0, 100), bin).find("truncated"), std::string::npos);
  EXPECT_NE(megatron(idx.substr(0, 20), bin).find("truncated"), std::string::npos);
  std::string magic = idx;
  magic[0] = 'X';
  EXPECT_NE(megatron(magic, bin).find("not a Megatron index"), std::string::npos);
  std::string version = idx;
  version[9] = 2;
  EXPECT_NE(megatron(version, bin).find("version 2"), std::string::npos);
  std::string dtype = idx;
  dtype[17] = 6;  // float64
  EXPECT_NE(megatron(dtype, bin).find("dtype code 6"), std::string::npos);
  // Each message names the file.
  EXPECT_NE(megatron(magic, bin).find(dir / "bad.idx"), std::string::npos);

  const std::string shard = read_bytes(dir / "shards/c_val_000000.bin");
  auto llmc = [&](const std::string& bytes) {
    write_bytes(dir / "bad-shard.bin", bytes);
    return error_of([&] { TokenCorpus::open({dir / "bad-shard.bin"}); });
  };
  EXPECT_NE(llmc(shard.substr(0, shard.size() - 2)).find("truncated"), std::string::npos);
  std::string wrong = shard;
  wrong[0] = 1;
  EXPECT_NE(llmc(wrong).find("not a token shard"), std::string::npos);
  std::string shard_version = shard;
  shard_version[4] = 3;
  EXPECT_NE(llmc(shard_version).find("version 3"), std::string::npos);
  EXPECT_NE(llmc("short").find("truncated"), std::string::npos);
  EXPECT_NE(error_of([&] { TokenCorpus::open({dir / "missing"}); }).find("missing"),
            std::string::npos);

  // A token id at or above the vocabulary, named with its file and position.
  TokenSetOptions options;
  options.spec = dir / "a_text_document";
  options.context = 8;
  options.vocabulary = 500;
  options.cache_dir = dir / "cache";
  const std::string vocabulary = error_of([&] { load_token_splits(options); });
  EXPECT_NE(vocabulary.find("at or above the vocabulary of 500"), std::string::npos) << vocabulary;
  EXPECT_NE(vocabulary.find("a_text_document.bin"), std::string::npos) << vocabulary;
}

TEST(TokenSpec, ParsesPathsAndBlends) {
  auto one = parse_token_spec("a,b/c");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].paths, (std::vector<std::string>{"a", "b/c"}));
  auto blend = parse_token_spec("a:0.7,b:0.3");
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_DOUBLE_EQ(blend[1].weight, 0.3);
  EXPECT_NE(error_of([] { parse_token_spec("a:0.7,b"); }).find("every path a weight"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_token_spec("a:-1"); }).find("not a positive number"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_token_spec("a,,b"); }).find("empty path"), std::string::npos);
}

// dtrain's samples against Megatron's: one epoch, several epochs (the last shuffled apart),
// and a blend of two corpora of different dtypes.
TEST(TokenSamples, EqualMegatronsGptAndBlendedDatasets) {
  TempDir dir;
  ASSERT_EQ(run_oracle("write " + dir.path()), 0);
  struct Case {
    std::string name;
    std::string spec;
    int64_t samples;
    std::string json;
  };
  const std::vector<Case> cases = {
      {"one-epoch", dir / "a_text_document", 0,
       R"({"prefixes": ["a_text_document"], "context": 16, "seed": 1234, "fraction": 0.1,
           "samples": 0})"},
      // 3.1 epochs: the fourth holds under 80% of one, so it is shuffled apart.
      {"epochs", dir / "a_text_document", 240,
       R"({"prefixes": ["a_text_document"], "context": 16, "seed": 1234, "fraction": 0.1,
           "samples": 240})"},
      {"blend", (dir / "a_text_document") + ":0.7," + (dir / "b_text_document") + ":0.3", 200,
       R"({"prefixes": ["a_text_document", "b_text_document"], "context": 16, "seed": 1234,
           "fraction": 0.1, "samples": 200, "weights": [0.7, 0.3]})"},
  };
  for (const Case& c : cases) {
    TokenSetOptions options;
    options.spec = c.spec;
    options.context = 16;
    options.train_samples = c.samples;
    options.seed = 1234;
    options.cache_dir = dir / (c.name + "-cache");
    const TokenSplits splits = load_token_splits(options);
    EXPECT_TRUE(splits.train.presampled());
    save_samples(splits.train, dir / (c.name + "-train.npy"));
    save_samples(splits.validation, dir / (c.name + "-valid.npy"));
    write_case(dir, c.name, c.json);
    EXPECT_EQ(run_oracle("check " + dir.path() + " " + c.name), 0) << c.name;
    // Built once: a second load reads the cached indices and gives the same samples.
    const TokenSplits again = load_token_splits(options);
    EXPECT_TRUE(at::equal(again.train.get({0, 5, 7}).inputs, splits.train.get({0, 5, 7}).inputs));
  }
}

TEST(TokenSamples, LlmcValidationShardsAreTheHeldOutSplit) {
  TempDir dir;
  ASSERT_EQ(run_oracle("write " + dir.path()), 0);
  TokenSetOptions options;
  options.spec = dir / "shards";
  options.context = 32;
  options.cache_dir = dir / "cache";
  const TokenSplits splits = load_token_splits(options);
  EXPECT_EQ(splits.validation_tokens, 380);  // c_val_000000.bin
  EXPECT_EQ(splits.train_tokens, 300 + 340);
  EXPECT_EQ(splits.validation.size(), (380 - 1) / 32);
  EXPECT_EQ(splits.vocabulary, TokenCorpus::open({dir / "shards"}).max_token().id + 1);
}
