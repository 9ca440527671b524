// The byte-level BPE tokenizer: ids equal to Hugging Face `tokenizers` on tokenizer.json files
// it trained (GPT-2's pre-tokenization, and Llama 3's Split + ByteLevel with ignore_merges),
// decoding as it decodes, a tokenizer trained by dtrain that `tokenizers` loads and runs to the
// same ids, and tokenizer.json files of other kinds refused by name. The oracle runs from
// .venv-torch (scripts/setup --torch pip installs `tokenizers` there); without it those tests
// are skipped, saying so.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Text.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/data/tokens/GptIndex.h"

using namespace dtrain;
using namespace dtrain::data::tokenizer;
using dtrain::test::TempDir;

namespace {

const std::string kPeerPython = std::string(DTRAIN_SOURCE_DIR) + "/.venv-torch/bin/python";
const std::string kOracle = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/hf_tokenizer_oracle.py";

bool have_oracle() {
  return std::system((kPeerPython + " -c 'import tokenizers' > /dev/null 2>&1").c_str()) == 0;
}

// Text that exercises the pre-tokenizers' corners: contractions in both cases, Unicode letters,
// digits and spaces (U+0085 and U+3000 among them), CJK,
// emoji with joiners, combining marks, CR LF, runs of spaces and tabs, an added token inside.
const std::string kTricky =
    "I'm sure we'LL see it's THEY'RE   \t\n\r\n  x  \n\n\n"
    "caf\xC3\xA9 cafe\xCC\x81 na\xC3\xAFve \xC7\x85ungla \xE2\x85\xA7 \xD9\xA3\xD9\xA4 12345678 "
    "3.14159\xC2\x85next \xC2\x85x !\xC2\x85\xC2\x85 "
    "y\xE3\x80\x80wide\xE2\x80\x89thin\xE2\x80\x8Bzero "
    "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9\xE3\x83"
    "\x88 "
    "\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x92\xBB \xF0\x9F\x98\x80!!! ...?? <|endoftext|>after"
    "<|endoftext|><|endoftext|> end\n";

std::string corpus_text() {
  // Debian's fortunes (setup installs them), and the corners above a few times.
  std::string text = data::read_text_corpus(data::kFortunesDir);
  for (int i = 0; i < 3; ++i) text += kTricky;
  return text;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<int64_t> oracle_ids(const std::string& tokenizer, const std::string& text_file,
                                const std::string& out) {
  const std::string command =
      kPeerPython + " " + kOracle + " encode " + tokenizer + " " + text_file + " " + out;
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  EXPECT_TRUE(data::tokens::load_npy(out, "<i8", shape, bytes)) << out;
  std::vector<int64_t> ids(bytes.size() / 8);
  std::memcpy(ids.data(), bytes.data(), bytes.size());
  return ids;
}

// The first position where two id lists differ, for the failure message.
std::string first_difference(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "equal";
  return concat("differ at id ", i, " of ", a.size(), " and ", b.size());
}

std::string error_of(const std::string& json) {
  try {
    BpeTokenizer::from_json(json, "t.json");
  } catch (const InputError& e) {
    return e.message();
  }
  return "(no error)";
}

}  // namespace

TEST(BpeTokenizer, TrainsEncodesAndDecodesBackToTheText) {
  BpeTrainOptions options;
  options.vocab_size = 600;
  const std::string text = corpus_text().substr(0, 400000);
  const BpeTokenizer tokenizer = train_bpe({text}, options);
  EXPECT_EQ(tokenizer.vocab_size(), 600);
  EXPECT_EQ(tokenizer.end_of_text(), 599);
  const std::vector<int64_t> ids = tokenizer.encode(text);
  EXPECT_LT(ids.size() * 2, text.size());  // merges compress English at least 2x
  EXPECT_EQ(tokenizer.decode(ids), text);
  const std::vector<int64_t> tricky = tokenizer.encode(kTricky);
  EXPECT_EQ(tokenizer.decode(tricky), kTricky);
  // The added token is one id wherever it stands.
  EXPECT_EQ(tokenizer.encode("<|endoftext|>"), (std::vector<int64_t>{599}));
  // Saved and loaded: the same ids.
  const BpeTokenizer again = BpeTokenizer::from_json(tokenizer.to_json(), "saved");
  EXPECT_EQ(again.encode(kTricky), tricky);
}

TEST(BpeTokenizer, RefusesTokenizersOfOtherKindsByName) {
  EXPECT_NE(error_of("{").find("t.json: not JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"type": "WordPiece", "vocab": {}}})").find("WordPiece"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"type": "Unigram", "vocab": []}})").find("Unigram"),
            std::string::npos);
  const std::string bpe = R"("model": {"type": "BPE", "vocab": {"a": 0}, "merges": []})";
  EXPECT_NE(error_of(R"({"normalizer": {"type": "NFC"}, )" + bpe + "}").find("normalizer"),
            std::string::npos);
  EXPECT_NE(
      error_of(R"({"pre_tokenizer": {"type": "Whitespace"}, )" + bpe + "}").find("not byte-level"),
      std::string::npos);
  EXPECT_NE(error_of(R"({"pre_tokenizer": {"type": "ByteLevel"}, )" + bpe + "}")
                .find("no token for byte 0"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"model": {"type": "BPE", "byte_fallback": true, "vocab": {}}})")
                .find("byte_fallback"),
            std::string::npos);
}

TEST(BpeTokenizer, EncodesAsHuggingFaceTokenizers) {
  if (!have_oracle()) GTEST_SKIP() << "no `tokenizers` in " << kPeerPython;
  TempDir dir;
  write_text(dir / "corpus.txt", corpus_text());
  write_text(dir / "tricky.txt", kTricky);
  const std::string train =
      kPeerPython + " " + kOracle + " train " + (dir / "corpus.txt") + " 2000 " + dir.path();
  ASSERT_EQ(std::system(train.c_str()), 0) << train;
  for (const std::string kind : {"gpt2-style", "llama3-style"}) {
    const BpeTokenizer tokenizer = BpeTokenizer::load(dir / (kind + ".json"));
    for (const std::string file : {"corpus.txt", "tricky.txt"}) {
      const std::string text = read_text(dir / file);
      const std::vector<int64_t> theirs =
          oracle_ids(dir / (kind + ".json"), dir / file, dir / (kind + "-" + file + ".npy"));
      const std::vector<int64_t> ours = tokenizer.encode(text);
      EXPECT_EQ(first_difference(ours, theirs), "equal") << kind << " on " << file;
      EXPECT_EQ(tokenizer.decode(ours), read_text(dir / (kind + "-" + file + ".npy.decoded")))
          << kind << " on " << file;
    }
  }
}

TEST(BpeTokenizer, ItsTrainedTokenizerRunsInHuggingFaceToTheSameIds) {
  if (!have_oracle()) GTEST_SKIP() << "no `tokenizers` in " << kPeerPython;
  TempDir dir;
  const std::string text = corpus_text();
  write_text(dir / "corpus.txt", text);
  BpeTrainOptions options;
  options.vocab_size = 1500;
  const BpeTokenizer tokenizer = train_bpe({text}, options);
  write_text(dir / "tokenizer.json", tokenizer.to_json());
  const std::vector<int64_t> theirs =
      oracle_ids(dir / "tokenizer.json", dir / "corpus.txt", dir / "ids.npy");
  EXPECT_EQ(first_difference(tokenizer.encode(text), theirs), "equal");
  EXPECT_EQ(read_text(dir / "ids.npy.decoded"), text);
}
