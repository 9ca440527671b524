// The data commands as a user runs them: a corpus of one's own tokenized, prepared into shards,
// trained on and generated from; images exported, sharded and trained on; bad data named in one
// line with exit code 2.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/nn/SafeTensors.h"

using dtrain::test::TempDir;
using namespace dtrain::test::cli;

// A corpus of the user's own, as the README runs it: a tokenizer trained on it, the text
// prepared into Megatron and llm.c shards, a GPT trained on 2 ranks whose validation loss falls,
// and `dtrain generate` decoding with the tokenizer the checkpoint keeps.
TEST(Cli, DataPrepareTrainAndGenerateOnYourOwnText) {
  TempDir dir;
  const std::string fortunes = "/usr/share/games/fortunes";
  auto out = run(kDtrain + " data tokenizer train " + fortunes + " --vocab-size 1024 --output " +
                 (dir / "tok/tokenizer.json"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "trained a byte-level BPE of 1024 tokens")) << out.text;
  out = run(kDtrain + " data prepare " + fortunes + " --tokenizer " + (dir / "tok") + " --output " +
            (dir / "data/fortunes"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "wrote " + (dir / "data/fortunes.idx"))) << out.text;
  EXPECT_TRUE(std::filesystem::exists(dir / "data/tokenizer.json"));
  out = run(kDtrain + " data prepare " + fortunes + " --tokenizer " + (dir / "tok") +
            " --format llmc --shard-tokens 200000 --output " + (dir / "llmc/fortunes"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "wrote " + (dir / "llmc/fortunes_000001.bin"))) << out.text;

  out = run(kDtrain +
            " train --nproc 2 --threads 1 --model gpt --dataset tokens:" + (dir / "data/fortunes") +
            " --context 32 --layers 1 --width 32 --heads 2 --batch-size 8 --global-batch 16 "
            "--lr 0.01 --warmup-steps 0 --max-steps 80 --eval-every 10 --no-progress --metrics " +
            (dir / "m.jsonl") + " --checkpoint-dir " + (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "vocabulary of 1024 (" + (dir / "data/tokenizer.json") + ")")) << out.text;
  EXPECT_TRUE(has(out, "nats/token")) << out.text;
  std::vector<double> validation;
  std::ifstream metrics(dir / "m.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "eval") validation.push_back(record["val_loss"].get<double>());
  }
  // Falling, and a nat below the uniform guess's log(1024) = 6.93.
  ASSERT_GE(validation.size(), 2u);
  EXPECT_LT(validation.back(), validation.front());
  EXPECT_LT(validation.back(), std::log(1024.0) - 1.0);
  out = run(kDtrain + " generate --checkpoint " + (dir / "ckpt") +
            " --prompt 'The cat' --tokens 20 --seed 3");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_GT(out.text.size(), 20u) << out.text;
  EXPECT_EQ(out.text.rfind("The cat", 0), 0u) << out.text;

  // The llm.c shards train too (one shard held out for validation by --validation-fraction).
  out = run(kDtrain + " train --threads 1 --model gpt --dataset tokens:" + (dir / "llmc") +
            " --validation-fraction 0.2 --context 32 --layers 1 --width 32 --heads 2 "
            "--batch-size 8 --max-steps 3 --no-progress");
  EXPECT_EQ(out.code, 0) << out.text;
}

TEST(Cli, DataBadInputIsOneClearLineAndExitCode2) {
  TempDir dir;
  std::filesystem::create_directories(dir / "data");
  std::ofstream(dir / "corpus.txt") << "the cat sat on the mat\n" << std::string(2000, 'a');
  auto out = run(kDtrain + " data tokenizer train " + (dir / "corpus.txt") +
                 " --vocab-size 300 --output " + (dir / "tokenizer.json"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " data prepare " + (dir / "corpus.txt") + " --tokenizer " +
            (dir / "tokenizer.json") + " --output " + (dir / "data/good"));
  ASSERT_EQ(out.code, 0) << out.text;
  {  // the .bin cut short, and a copy of the pair with a foreign magic
    std::filesystem::copy_file(dir / "data/good.idx", dir / "data/cut.idx");
    std::ifstream in(dir / "data/good.bin", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(dir / "data/cut.bin", std::ios::binary) << bytes.substr(0, bytes.size() - 4);
    std::ofstream(dir / "shard.bin", std::ios::binary) << std::string(2048, 'x');
  }
  std::ofstream(dir / "wordpiece.json") << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  std::ofstream(dir / "lines.jsonl") << "{\"text\": \"a\"}\n{\"body\": \"b\"}\n";
  std::ofstream(dir / "broken.jsonl") << "{\"text\": \"a\"}\nnot json\n";
  std::ofstream(dir / "latin1.txt") << "caf\xe9\n";
  // A bad byte at offset 4 of the second file of a folder: the offset is the file's own (it was
  // the batch's, 4 + the first file's size; for a file alone, an uninitialised read).
  std::filesystem::create_directories(dir / "two");
  std::ofstream(dir / "two/a.txt") << "hello world, a good file\n";
  std::ofstream(dir / "two/b.txt") << "abc \x80 def";
  std::ofstream(dir / "surrogate.jsonl") << "{\"text\": \"a\"}\n{\"text\": \"\\ud800\"}\n";
  std::ofstream(dir / "bytes.jsonl") << "{\"text\": \"a\"}\n{\"text\": \"ab\xff\r\"}\n";
  std::ofstream(dir / "nul.txt") << std::string("a\0b", 3);
  const std::string prepare = " data prepare --tokenizer " + (dir / "tokenizer.json") +
                              " --output " + (dir / "out/x") + " ";
  const std::string gpt = " train --model gpt --context 8 --dataset tokens:";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {prepare + (dir / "none"), (dir / "none") + " is not a file or folder"},
      {" data prepare " + (dir / "corpus.txt") + " --output x --tokenizer " +
           (dir / "wordpiece.json"),
       "wordpiece.json: a WordPiece tokenizer; dtrain runs byte-level BPE"},
      {prepare + (dir / "lines.jsonl"), "lines.jsonl:2: no string field \"text\""},
      {prepare + (dir / "broken.jsonl"), "broken.jsonl:2: not valid JSON (parse error"},
      {prepare + (dir / "surrogate.jsonl"),
       "surrogate.jsonl:2: not valid JSON (parse error at line 1, column 17: syntax error while "
       "parsing value - invalid string: surrogate U+D800..U+DBFF must be followed by "
       "U+DC00..U+DFFF"},
      {prepare + (dir / "bytes.jsonl"), "ill-formed UTF-8 byte; last read: '\"ab\\xFF'"},
      {prepare + (dir / "latin1.txt"),
       "latin1.txt: the text is not UTF-8: a malformed sequence at byte offset 3 (byte 0xE9)"},
      {prepare + (dir / "latin1.txt") + " " + (dir / "corpus.txt"),
       "latin1.txt: the text is not UTF-8: a malformed sequence at byte offset 3 (byte 0xE9)"},
      {prepare + (dir / "two"),
       "b.txt: the text is not UTF-8: a malformed sequence at byte offset 4 (byte 0x80)"},
      {prepare + (dir / "nul.txt"), "nul.txt: holds a NUL byte"},
      {prepare + (dir / "corpus.txt") + " --format arrow", "--format must be megatron or llmc"},
      {" data tokenizer train " + (dir / "corpus.txt") + " --vocab-size 100 --output t.json",
       "--vocab-size 100 is below the 257 tokens every byte-level BPE holds"},
      {gpt + (dir / "data/cut"), "disagree"},
      {gpt + (dir / "shard.bin"), "not a token shard"},
      {gpt + (dir / "data/good") + " --vocab-size 5", "at or above the vocabulary of 5"},
      {gpt, "--dataset tokens needs its files"},
      {gpt + (dir / "data/good") + ":x", "is not a positive number"},
      {gpt + (dir / "data/good") + " --tokenizer " + (dir / "wordpiece.json"), "WordPiece"},
  };
  for (const auto& [args, needle] : cases) {
    const auto result = run(kDtrain + args);
    EXPECT_EQ(result.code, 2) << args << "\n" << result.text;
    EXPECT_TRUE(has(result, needle)) << args << "\n" << result.text;
    EXPECT_LE(std::count(result.text.begin(), result.text.end(), '\n'), 1) << args << "\n"
                                                                           << result.text;
  }
  // Tokenizer training names the file too (its progress lines come first).
  const auto training = run(kDtrain + " data tokenizer train " + (dir / "two") +
                            " --vocab-size 300 --output " + (dir / "t.json"));
  EXPECT_EQ(training.code, 2) << training.text;
  EXPECT_TRUE(has(training, "tokenizer training: " + (dir / "two/b.txt") +
                                ": the text is not UTF-8: a malformed sequence at byte offset 4 "
                                "(byte 0x80)\n"))
      << training.text;
  // Nothing written where the input was refused.
  EXPECT_FALSE(std::filesystem::exists(dir / "out/x.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out/x.idx"));
}

#ifdef DTRAIN_IMAGES
namespace {

// Tiny Fashion-MNIST IDX files (n images of each split) in `dir`.
void write_tiny_fashion_mnist(const std::string& dir, int n) {
  std::filesystem::create_directories(dir);
  auto be32 = [](std::string& s, uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>(v >> shift));
  };
  for (const std::string prefix : {"train", "t10k"}) {
    std::string images = {0, 0, 8, 3};
    be32(images, n);
    be32(images, 28);
    be32(images, 28);
    std::string labels = {0, 0, 8, 1};
    be32(labels, n);
    for (int i = 0; i < n; ++i) {
      for (int p = 0; p < 28 * 28; ++p) images.push_back(static_cast<char>((p * (i + 1)) % 256));
      labels.push_back(static_cast<char>(i % 10));
    }
    std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary) << images;
    std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary) << labels;
  }
}

}  // namespace

// Images of one's own: Fashion-MNIST exported as a JPEG tree, the tree as tar shards, a CNN
// trained on each; bad image data named, exit 2.
TEST(Cli, ImagesExportShardAndTrain) {
  TempDir dir;
  write_tiny_fashion_mnist(dir / "idx", 40);
  auto out = run(kDtrain + " data export-fashion-mnist --data-dir " + (dir / "idx") + " --output " +
                 (dir / "fm"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "wrote 80 JPEG images")) << out.text;
  EXPECT_TRUE(std::filesystem::exists(dir / "fm/val/9-boot/00039.jpg"));
  for (const std::string split : {"train", "val"}) {
    out = run(kDtrain + " data prepare --images " + (dir / ("fm/" + split)) +
              " --shard-bytes 20000" + " --output " + (dir / ("tars/" + split + "/fm")));
    ASSERT_EQ(out.code, 0) << out.text;
    EXPECT_TRUE(has(out, "wrote " + (dir / ("tars/" + split + "/fm-000001.tar")))) << out.text;
  }
  for (const std::string root : {"fm", "tars"}) {
    const std::string augment = root == "fm" ? "none" : "imagenet";
    out = run(kDtrain + " train --threads 1 --model cnn --dataset images:" + (dir / root) +
              " --image-size 28 --batch-size 8 --max-steps 4 --no-progress --augment " + augment);
    EXPECT_EQ(out.code, 0) << root << "\n" << out.text;
    EXPECT_TRUE(has(out, "images: 40 for training")) << out.text;
    EXPECT_TRUE(has(out, "10 classes, 28x28, --augment " + augment)) << out.text;
    EXPECT_TRUE(has(out, "test accuracy")) << out.text;
  }
  // A federated party's own image folders (issue 78): the simulation partitions them by their
  // labels, read from the class folders without decoding a picture.
  out = run(
      kDtrain + " fl simulate --threads 1 --model cnn --dataset images:" + (dir / "fm") +
      " --image-size 28 --clients 2 --client-examples 20 --fraction 1 --rounds 2 --local-batch 8 "
      "--no-progress");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "2 rounds")) << out.text;
  // Bad image data: one line, exit 2, before training.
  std::ofstream(dir / "fm/train/3-dress/00003.jpg") << "truncated";
  std::filesystem::create_directories(dir / "fm/train/x-empty");
  const std::string train = " train --model cnn --image-size 28 --dataset images:" + (dir / "fm");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {train, "x-empty is an empty class folder"},
      {" train --model cnn --dataset images:" + (dir / "none"), "is not a folder"},
      // The split given as the root: the form that fits, named.
      {" train --model cnn --dataset images:" + (dir / "fm/train"),
       "ROOT must hold train/ and val/ (in each a folder per class, or .tar shards), or give the "
       "two folders as images:TRAIN,VAL (did you mean --dataset images:" +
           (dir / "fm") + "?)"},
      {" train --model cnn --dataset images:", "--dataset images needs its folder"},
      {train + " --image-size 4", "--image-size must be in [8, 4096]"},
      {train + " --augment crop", "--augment must be imagenet, flip or none, got 'crop'"},
  };
  for (const auto& [args, needle] : cases) {
    const auto result = run(kDtrain + args);
    EXPECT_EQ(result.code, 2) << args << "\n" << result.text;
    EXPECT_TRUE(has(result, needle)) << args << "\n" << result.text;
    EXPECT_LE(std::count(result.text.begin(), result.text.end(), '\n'), 1) << result.text;
  }
  std::filesystem::remove_all(dir / "fm/train/x-empty");
  out = run(kDtrain + train);
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "1 damaged image in the training split, more than --max-bad-samples 0"))
      << out.text;
  out = run(kDtrain + train +
            " --threads 1 --max-bad-samples 1 --batch-size 8 --max-steps 2 "
            "--no-progress");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "left out 1 damaged training image")) << out.text;
}

// A JPEG cut inside its scan data (its header intact: start-up's check passes) is found by the
// rank that draws it, mid-training: the job exits 2, and the launcher blames that rank with its
// own message, not the rank whose collective then failed on the closed connection (it did, in
// 4 of 4 runs: "failed: rank 0 ... exited with code 1").
TEST(Cli, ADamagedImageFoundMidTrainingIsBlamedOnTheRankThatFoundIt) {
  TempDir dir;
  write_tiny_fashion_mnist(dir / "idx", 20);
  auto out = run(kDtrain + " data export-fashion-mnist --data-dir " + (dir / "idx") + " --output " +
                 (dir / "fm"));
  ASSERT_EQ(out.code, 0) << out.text;
  const std::string victim = dir / "fm/train/1-trouser/00001.jpg";
  std::string bytes;
  {
    std::ifstream in(victim, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 400u);
  std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 120);
  for (int run_index = 0; run_index < 3; ++run_index) {
    out = run(kDtrain +
              " train --model mlp --threads 1 --image-size 32 --augment flip "
              "--batch-size 1 --epochs 2 --no-progress --nproc 2 --dataset images:" +
              (dir / "fm"));
    EXPECT_EQ(out.code, 2) << out.text;
    EXPECT_TRUE(has(out, "dtrain train: failed: rank ")) << out.text;
    EXPECT_TRUE(has(out, "exited with code 2: " + victim + ": a damaged JPEG")) << out.text;
    EXPECT_FALSE(has(out, "exited with code 1")) << out.text;
  }
}
#endif

namespace {

// transformers' greedy decoding of "The cat" on the Hugging Face folder dir/hf, 12 new tokens at
// most, as `dtrain generate` prints it; nullopt without .venv-torch's transformers (the check is
// skipped). `stops_at_eos`: generate() as configured by the folder (it must end at the eos
// token, left out of the text); otherwise exactly 12 tokens, special ones printed.
std::optional<std::string> transformers_greedy(const TempDir& dir, bool stops_at_eos) {
  const std::string python = std::string(DTRAIN_SOURCE_DIR) + "/.venv-torch/bin/python";
  if (std::system((python + " -c 'import transformers' > /dev/null 2>&1").c_str()) != 0) {
    return std::nullopt;
  }
  std::ofstream(dir / "greedy.py")
      << "import sys, torch\n"
         "from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast\n"
         "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
         "tok = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1] + '/tokenizer.json')\n"
         "ids = torch.tensor([tok.encode('The cat')])\n"
      << (stops_at_eos
              ? "out = model.generate(ids, max_new_tokens=12, do_sample=False)\n"
                "assert out[0, -1].item() == model.generation_config.eos_token_id, out\n"
                "text = tok.decode(out[0], skip_special_tokens=True)\n"
              : "out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)\n"
                "text = tok.decode(out[0])\n")
      << "open(sys.argv[2], 'w').write(text + '\\n')\n";
  const auto out =
      run(python + " " + (dir / "greedy.py") + " " + (dir / "hf") + " " + (dir / "greedy.txt"));
  EXPECT_EQ(out.code, 0) << out.text;
  std::ifstream in(dir / "greedy.txt");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A BPE tokenizer of 512 tokens trained on fortunes (dir/tok.json) and fortunes as its token
// shards (dir/data/fortunes).
void prepare_fortunes(const TempDir& dir) {
  const std::string fortunes = "/usr/share/games/fortunes";
  auto out = run(kDtrain + " data tokenizer train " + fortunes + " --vocab-size 512 --output " +
                 (dir / "tok.json"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " data prepare " + fortunes + " --tokenizer " + (dir / "tok.json") +
            " --output " + (dir / "data/fortunes"));
  ASSERT_EQ(out.code, 0) << out.text;
}

// A tiny mixture of experts on prepare_fortunes' shards: moe-tiny's blocks, 4 experts (no shared
// one), 2 blocks of width 32, with `extra` flags (its first dense blocks, Qwen3's attention).
std::string tiny_moe_shape(const TempDir& dir, const std::string& extra) {
  return " --config " + std::string(DTRAIN_SOURCE_DIR) +
         "/configs/moe-tiny.toml --moe-shared-experts 0 --moe-experts 4 --dataset tokens:" +
         (dir / "data/fortunes") +
         " --context 16 --layers 2 --width 32 --heads 4 --kv-heads 2 --moe-ffn-width 32 "
         "--threads 1 --no-progress --batch-size 8 --warmup-steps 0 " +
         extra + " ";
}

const std::string kGenerate = " generate --prompt 'The cat' --tokens 12 --temperature 0";

// Trains `shape` 300 steps with its experts over 2 ranks (dir/ckpt), exports it (dir/hf) and
// returns `dtrain generate`'s greedy text, which must be more than one token repeated and equal
// transformers' greedy decoding of the folder (where .venv-torch has transformers).
std::string trained_exported_generated(const TempDir& dir, const std::string& shape) {
  auto out = run(kDtrain + " train --nproc 2 --expert-parallel 2" + shape +
                 "--max-steps 300 --lr 0.005 --checkpoint-dir " + (dir / "ckpt"));
  EXPECT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "hf"));
  EXPECT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + kGenerate + " --checkpoint " + (dir / "ckpt"));
  EXPECT_EQ(out.code, 0) << out.text;
  const std::string ours = out.text;
  EXPECT_EQ(ours.rfind("The cat", 0), 0u) << ours;
  if (ours.size() > 7) {  // not one token
    EXPECT_GT(std::set<char>(ours.begin() + 7, ours.end()).size(), 3u) << ours;
  }
  const auto theirs = transformers_greedy(dir, /*stops_at_eos=*/false);
  if (theirs) {
    EXPECT_EQ(*theirs, ours);
  }
  return ours;
}

}  // namespace

// Weights out to the Python world and back in: a Llama trained on 2 ranks, exported as Hugging
// Face's folder (config.json, model.safetensors, tokenizer.json), greedy-decoded by transformers
// to the text `dtrain generate` gives (.venv-torch; that part skipped without it), then the
// folder starting a tensor-parallel run that generates the same; a config.json that disagrees
// with the flags is named.
TEST(Cli, LlamaExportsToTransformersAndStartsFromItsWeights) {
  TempDir dir;
  prepare_fortunes(dir);
  Output out;
  // The named tiny shape, its width and context narrowed by flags (the command line wins).
  const std::string shape =
      " --config " + std::string(DTRAIN_SOURCE_DIR) +
      "/configs/llama-tiny.toml --dataset tokens:" + (dir / "data/fortunes") +
      " --context 16 --layers 2 --width 32 --heads 4 --kv-heads 2 --threads 1 --no-progress"
      " --batch-size 8 --warmup-steps 0 ";
  out = run(kDtrain + " train --nproc 2" + shape + "--max-steps 150 --lr 0.005 --checkpoint-dir " +
            (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "hf"));
  ASSERT_EQ(out.code, 0) << out.text;
  for (const char* file : {"config.json", "model.safetensors", "tokenizer.json",
                           "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir / ("hf/" + std::string(file)))) << file << "\n"
                                                                            << out.text;
  }
  // The end-of-text token dtrain puts between documents is transformers' eos (and bos): its
  // generate() stops where dtrain's does.
  const auto json_of = [&](const char* file) {
    return nlohmann::json::parse(std::ifstream(dir / ("hf/" + std::string(file))));
  };
  const auto tokenizer = nlohmann::json::parse(std::ifstream(dir / "tok.json"));
  int64_t eos = -1;
  for (const auto& added : tokenizer.at("added_tokens")) {
    if (added.at("content") == "<|endoftext|>") eos = added.at("id").get<int64_t>();
  }
  ASSERT_GE(eos, 0) << tokenizer.dump().substr(0, 400);
  EXPECT_EQ(json_of("config.json").at("eos_token_id").get<int64_t>(), eos);
  EXPECT_EQ(json_of("generation_config.json").at("eos_token_id").get<int64_t>(), eos);
  EXPECT_EQ(json_of("tokenizer_config.json").at("eos_token").get<std::string>(), "<|endoftext|>");
  const std::string& generate = kGenerate;
  out = run(kDtrain + generate + " --checkpoint " + (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  const std::string ours = out.text;
  EXPECT_EQ(ours.rfind("The cat", 0), 0u) << ours;
  EXPECT_GT(std::set<char>(ours.begin() + 7, ours.end()).size(), 3u) << ours;  // not one token

  const auto theirs = transformers_greedy(dir, /*stops_at_eos=*/false);
  if (theirs) EXPECT_EQ(*theirs, ours);

  // A run at another layout started from `from` with a learning rate of 1e-12: its checkpoint
  // (in `folder`) generates the same text.
  const auto starts_from = [&](const std::string& layout, const std::string& from,
                               const std::string& folder, const std::string& extra = "") {
    auto trained = run(kDtrain + " train --nproc 2 " + layout + shape +
                       "--max-steps 1 --lr 1e-12 --init-from " + from + " --checkpoint-dir " +
                       (dir / folder) + extra);
    ASSERT_EQ(trained.code, 0) << layout << " from " << from << "\n" << trained.text;
    EXPECT_EQ(run(kDtrain + generate + " --checkpoint " + (dir / folder)).text, ours)
        << layout << " from " << from;
  };
  // The folder, at 2 tensor-parallel ranks; and with ZeRO-3, each rank cutting its shards from
  // the file.
  starts_from("--tensor-parallel 2", dir / "hf", "again");
  starts_from("--strategy zero3", dir / "hf", "zero3");
  // The training checkpoint itself: ZeRO-3's ranks read their shards of it into a model they
  // never build whole; tensor-parallel ranks their blocks of it.
  starts_from("--strategy zero3", dir / "ckpt", "zero3-ckpt",
              " --metrics " + (dir / "zero3.jsonl"));
  int64_t setup_peak = 0;  // the run's summary says what setup took
  std::ifstream summary(dir / "zero3.jsonl");
  for (std::string line; std::getline(summary, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "summary")
      setup_peak = record.value("setup_peak_resident_bytes", int64_t{0});
  }
  EXPECT_GT(setup_peak, 0);
  starts_from("--tensor-parallel 2", dir / "ckpt", "tp-ckpt");
  // Pipeline ranks: each builds and reads only its stages of the checkpoint; from the
  // safetensors folder, the model filled whole.
  starts_from("--pipeline-parallel 2 --micro-batches 2", dir / "ckpt", "pp-ckpt");
  starts_from("--pipeline-parallel 2 --micro-batches 2", dir / "hf", "pp-hf");
  // A checkpoint of another shape: one line naming the parameter, exit 2, nothing written.
  out = run(kDtrain + " train --nproc 2 --strategy zero3" + shape +
            "--ffn-width 96 --max-steps 1 --init-from " + (dir / "ckpt") + " --checkpoint-dir " +
            (dir / "zero3-other"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "does not match the model: 'blocks.0.fc1.weight' has shape")) << out.text;
  EXPECT_FALSE(std::filesystem::exists(dir / "zero3-other/latest")) << out.text;
  // A checkpoint holding NaN (saved by a run told to load it): every layout refuses it by name,
  // exit 2, whether its ranks keep shards (zero3), blocks (TP: the row is the second rank's) or
  // whole stages (a pipeline: only the first stage's rank reads the embedding).
  {
    const auto file = dtrain::nn::SafeTensorsFile::open(dir / "hf/model.safetensors");
    dtrain::nn::NamedTensors tensors;
    for (const auto& name : file.names()) {
      at::Tensor t = file.get(name).clone();
      // The last token's row: no batch of the one step below holds it, so the step is finite
      // (a run writes no checkpoint after a non-finite one) and the row stays NaN.
      if (name == "model.embed_tokens.weight") t[t.size(0) - 1][3] = NAN;
      tensors.emplace_back(name, t);
    }
    std::filesystem::create_directories(dir / "nan-hf");
    for (const auto& entry : std::filesystem::directory_iterator(dir / "hf")) {
      if (entry.path().filename() != "model.safetensors")
        std::filesystem::copy(entry.path(), dir / "nan-hf" / entry.path().filename());
    }
    dtrain::nn::save_safetensors(dir / "nan-hf/model.safetensors", tensors);
  }
  out = run(kDtrain + " train" + shape + "--max-steps 1 --init-from " + (dir / "nan-hf") +
            " --allow-non-finite-weights --checkpoint-dir " + (dir / "nan-ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  ASSERT_TRUE(std::filesystem::exists(dir / "nan-ckpt/latest")) << out.text;
  for (const std::string layout :
       {"--strategy zero3", "--tensor-parallel 2", "--pipeline-parallel 2 --micro-batches 2"}) {
    out = run(kDtrain + " train --nproc 2 " + layout + shape + "--max-steps 1 --init-from " +
              (dir / "nan-ckpt") + " --checkpoint-dir " + (dir / "nan-run"));
    EXPECT_EQ(out.code, 2) << layout << "\n" << out.text;
    EXPECT_TRUE(has(out, "--init-from " + (dir / "nan-ckpt"))) << layout << "\n" << out.text;
    EXPECT_TRUE(has(out, " holds NaN (")) << layout << "\n" << out.text;
    EXPECT_FALSE(std::filesystem::exists(dir / "nan-run/latest")) << layout;
  }
  // Flags that disagree with config.json: named, exit 2.
  out = run(kDtrain + " train" + shape + "--max-steps 1 --kv-heads 4 --init-from " + (dir / "hf"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "config.json: num_key_value_heads is 2, the model's --kv-heads is 4"))
      << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "x") + " --format onnx");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "--format must be safetensors")) << out.text;
}

// A mixture of experts out to transformers and back in: trained with its experts over 2 ranks,
// exported as Mixtral's folder, greedy-decoded by transformers' MixtralForCausalLM to the text
// `dtrain generate` gives; the folder starts runs with the experts over 2 ranks (each reading its
// own) and over none, which generate the same. A layout Mixtral has no names for is exported in
// dtrain's names, and starts a run from them.
TEST(Cli, MixtralExportsToTransformersAndStartsFromItsWeights) {
  TempDir dir;
  prepare_fortunes(dir);
  Output out;
  const std::string shape = tiny_moe_shape(dir, "--moe-first-dense 0");
  const std::string ours = trained_exported_generated(dir, shape);
  const auto config = nlohmann::json::parse(std::ifstream(dir / "hf/config.json"));
  EXPECT_EQ(config.at("model_type"), "mixtral");
  EXPECT_EQ(config.at("num_local_experts"), 4);
  EXPECT_EQ(config.at("intermediate_size"), 32);
  EXPECT_TRUE(dtrain::nn::SafeTensorsFile::open(dir / "hf/model.safetensors")
                  .contains("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  const std::string generate = kGenerate;

  const auto starts_from = [&](const std::string& layout, const std::string& extra_shape,
                               const std::string& from, const std::string& folder) {
    auto trained =
        run(kDtrain + " train --nproc 2 " + layout + shape + extra_shape +
            "--max-steps 1 --lr 1e-12 --init-from " + from + " --checkpoint-dir " + (dir / folder));
    ASSERT_EQ(trained.code, 0) << layout << " from " << from << "\n" << trained.text;
    EXPECT_EQ(run(kDtrain + generate + " --checkpoint " + (dir / folder)).text, ours)
        << layout << " from " << from;
  };
  starts_from("--expert-parallel 2", "", dir / "hf", "ep");
  starts_from("", "", dir / "hf", "ddp");
  // Flags that do not match the folder's config.json: named, exit 2.
  out = run(kDtrain + " train --nproc 1" + shape + "--moe-top-k 1 --max-steps 1 --init-from " +
            (dir / "hf") + " --checkpoint-dir " + (dir / "other"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "num_experts_per_tok is 2, the model's --moe-top-k is 1")) << out.text;

  // A shared expert: no Mixtral names for it, so dtrain's names, which start a run as they are.
  const std::string with_shared = "--moe-shared-experts 1 ";
  out = run(kDtrain + " train --nproc 2 --expert-parallel 2" + shape + with_shared +
            "--max-steps 20 --lr 0.005 --checkpoint-dir " + (dir / "shared"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "shared") + " -o " + (dir / "shared-st"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_FALSE(std::filesystem::exists(dir / "shared-st/config.json"));
  EXPECT_TRUE(dtrain::nn::SafeTensorsFile::open(dir / "shared-st/model.safetensors")
                  .contains("blocks.1.moe.shared_gate"));
  const std::string shared_text =
      run(kDtrain + generate + " --checkpoint " + (dir / "shared")).text;
  auto trained = run(kDtrain + " train --nproc 2 " + shape + with_shared +
                     "--max-steps 1 --lr 1e-12 --init-from " + (dir / "shared-st") +
                     " --checkpoint-dir " + (dir / "shared-again"));
  ASSERT_EQ(trained.code, 0) << trained.text;
  EXPECT_EQ(run(kDtrain + generate + " --checkpoint " + (dir / "shared-again")).text, shared_text);
}

// Qwen3-MoE out to transformers and back in: a mixture of experts with per-head query/key norms,
// heads wider than width / heads and a dense first block (the oracle test in llama_test.cpp
// covers norm_topk_prob false), trained
// with its experts over 2 ranks, exported as Qwen3-MoE's folder, greedy-decoded by transformers'
// Qwen3MoeForCausalLM to the text `dtrain generate` gives; the folder starts runs over 2 tensor-
// parallel ranks and with the experts over 2 ranks, which generate the same. Flags that leave out
// the head norms are named.
TEST(Cli, Qwen3MoeExportsToTransformersAndStartsFromItsWeights) {
  TempDir dir;
  prepare_fortunes(dir);
  Output out;
  const std::string shape = tiny_moe_shape(dir, "--moe-first-dense 1 --head-dim 12");
  const std::string ours = trained_exported_generated(dir, shape + "--qk-norm ");
  const auto config = nlohmann::json::parse(std::ifstream(dir / "hf/config.json"));
  EXPECT_EQ(config.at("model_type"), "qwen3_moe");
  EXPECT_EQ(config.at("num_experts"), 4);
  EXPECT_EQ(config.at("head_dim"), 12);
  EXPECT_EQ(config.at("norm_topk_prob"), true);
  EXPECT_EQ(config.at("mlp_only_layers"), nlohmann::json::array({0}));
  const auto file = dtrain::nn::SafeTensorsFile::open(dir / "hf/model.safetensors");
  EXPECT_TRUE(file.contains("model.layers.1.mlp.experts.3.down_proj.weight"));
  EXPECT_TRUE(file.contains("model.layers.0.mlp.up_proj.weight"));  // the dense block
  EXPECT_TRUE(file.contains("model.layers.0.self_attn.q_norm.weight"));
  const std::string& generate = kGenerate;

  for (const char* layout : {"--tensor-parallel 2", "--expert-parallel 2"}) {
    const std::string folder = std::string("from-") + (layout[2] == 't' ? "tp" : "ep");
    auto trained = run(kDtrain + " train --nproc 2 " + layout + shape +
                       "--qk-norm --max-steps 1 --lr 1e-12 --init-from " + (dir / "hf") +
                       " --checkpoint-dir " + (dir / folder));
    ASSERT_EQ(trained.code, 0) << layout << "\n" << trained.text;
    EXPECT_EQ(run(kDtrain + generate + " --checkpoint " + (dir / folder)).text, ours) << layout;
  }
  // Flags that leave out the head norms: named, exit 2.
  out = run(kDtrain + " train --nproc 1" + shape + "--max-steps 1 --init-from " + (dir / "hf") +
            " --checkpoint-dir " + (dir / "other"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out,
                  "self_attn.q_norm/k_norm (model_type qwen3, qwen3_moe) is on, the "
                  "model's --qk-norm is off"))
      << out.text;
}

// Generation ends where the document does: a Llama trained on one-sentence documents (the
// end-of-text token between them) stops `dtrain generate` at the end of the sentence (with
// --ignore-eos it goes on into the next), and transformers' generate() on the exported folder,
// with the generation_config.json the export wrote, stops at the same token (.venv-torch; that
// part skipped without it).
TEST(Cli, GenerationStopsAtTheEndOfTextAsTransformersDoes) {
  TempDir dir;
  std::filesystem::create_directories(dir / "docs");
  int n = 0;
  for (const char* who : {"The cat", "The dog", "A bird", "The fox", "My friend", "The child"}) {
    for (const char* did : {"sat", "ran", "sang", "slept", "smiled", "jumped"}) {
      for (const char* when : {"today.", "at noon.", "again.", "quietly."}) {
        std::ofstream(dir / ("docs/d" + std::to_string(n++) + ".txt"))
            << who << " " << did << " " << when << "\n";
      }
    }
  }
  auto out = run(kDtrain + " data tokenizer train " + (dir / "docs") +
                 " --vocab-size 320 --output " + (dir / "tok.json"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " data prepare " + (dir / "docs") + " --tokenizer " + (dir / "tok.json") +
            " --output " + (dir / "data/docs"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " train --config " + std::string(DTRAIN_SOURCE_DIR) +
            "/configs/llama-tiny.toml --dataset tokens:" + (dir / "data/docs") +
            " --context 16 --layers 2 --width 32 --heads 4 --kv-heads 2 --threads 1 --no-progress "
            "--no-run-dir --batch-size 8 --warmup-steps 0 --max-steps 150 --lr 0.005 "
            "--checkpoint-dir " +
            (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "hf"));
  ASSERT_EQ(out.code, 0) << out.text;
  const std::string generate =
      kDtrain + " generate --prompt 'The cat' --tokens 12 --temperature 0 --checkpoint " +
      (dir / "ckpt");
  const auto stopped = run(generate);
  const auto on = run(generate + " --ignore-eos");
  ASSERT_EQ(stopped.code, 0) << stopped.text;
  ASSERT_EQ(on.code, 0) << on.text;
  // "The cat slept again.\n" and, past the end of text, more.
  EXPECT_EQ(stopped.text.rfind("The cat ", 0), 0u) << stopped.text;
  ASSERT_LT(stopped.text.size(), on.text.size()) << stopped.text << "\n" << on.text;
  EXPECT_EQ(on.text.rfind(stopped.text.substr(0, stopped.text.size() - 1), 0), 0u) << on.text;
  EXPECT_TRUE(has(on, "<|endoftext|>")) << on.text;

  const auto theirs = transformers_greedy(dir, /*stops_at_eos=*/true);
  if (theirs) EXPECT_EQ(*theirs, stopped.text);
}
