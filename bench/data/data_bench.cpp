// The data path's speed on one thread, as JSON lines for bench/data/run_data_bench.py:
//   data_bench tokenize --tokenizer FILE INPUT... [--ids-out FILE.npy]
//       byte-level BPE encoding of each document (one BpeEncoder, as one core of `dtrain data
//       prepare` runs it); --ids-out writes every document's ids, in order, for the peer's check
//   data_bench batch --data PREFIX --context C --batch B
//       assembling random global batches from memory-mapped token shards (TokenSamples::get),
//       beside memcpy of the same bytes out of the same mapping: the physical limit
//   data_bench images --folder ROOT --size S
//       ImageNet's training transforms (decode, random-resized-crop, flip, normalize) over
//       ROOT/train's images in batches of 32 (the `images` data set's get)
//   data_bench samples --data PREFIX --context C --samples N --seed S --validation-fraction F
//       --out FILE.npy
//       the training samples a run reads, in its order ([N, C + 1] int64): what a peer trains
//       on to see the same tokens (bench/lm/run_llama_peer.py)
//   data_bench resume --data PREFIX --context C --batch B --samples N --ranks R
//       what a resume costs the loader, at the start, middle and end of the run's samples:
//       opening the token set (its cached indices), the rank's order, the first batch; and an
//       ImageNet-sized shuffled epoch's order (1,281,167 examples)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#ifdef DTRAIN_IMAGES
#include "dtrain/data/images/Image.h"
#include "dtrain/data/images/ImageSet.h"
#endif
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/data/tokens/GptIndex.h"
#include "dtrain/data/tokens/Prepare.h"
#include "dtrain/data/tokens/TokenDataset.h"
#include "dtrain/data/tokens/TokenFiles.h"

using namespace dtrain::data;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int tokenize(const std::string& tokenizer_path, const std::vector<std::string>& inputs,
             const std::string& ids_out, int rounds) {
  const tokenizer::BpeTokenizer tokenizer = tokenizer::BpeTokenizer::load(tokenizer_path);
  std::vector<std::string> documents;
  int64_t bytes = 0;
  tokens::for_each_document({inputs, "text"}, [&](const std::string&, std::string text, int64_t) {
    bytes += static_cast<int64_t>(text.size());
    documents.push_back(std::move(text));
  });
  std::vector<int64_t> all;
  for (int round = 0; round < rounds; ++round) {
    tokenizer::BpeEncoder encoder(tokenizer);  // a cold cache each round
    all.clear();
    const auto start = Clock::now();
    for (const auto& document : documents) encoder.encode(document, all);
    const double seconds = since(start);
    std::printf(
        "{\"bench\": \"tokenize\", \"round\": %d, \"seconds\": %.6f, \"bytes\": %lld, "
        "\"tokens\": %lld, \"documents\": %zu, \"threads\": 1}\n",
        round, seconds, static_cast<long long>(bytes), static_cast<long long>(all.size()),
        documents.size());
    std::fflush(stdout);
  }
  if (!ids_out.empty()) {
    tokens::save_npy(ids_out, all.data(), "<i8", {static_cast<int64_t>(all.size())});
  }
  return 0;
}

int batch(const std::string& data, int64_t context, int64_t batch_size, int rounds, int steps) {
  tokens::TokenSetOptions options;
  options.spec = data;
  options.context = context;
  options.seed = 1234;
  const tokens::TokenSplits splits = tokens::load_token_splits(options);
  const int64_t n = splits.train.size();
  const tokens::MappedFile bin(data + ".bin");
  std::mt19937_64 random(7);
  for (int round = 0; round < rounds; ++round) {
    // The global batches of `steps` steps at random places in the sample order (the trainer
    // reads consecutive positions of a shuffled order: random documents either way).
    std::vector<std::vector<int64_t>> batches(steps);
    for (auto& b : batches) {
      const int64_t first = static_cast<int64_t>(random() % (n - batch_size));
      for (int64_t i = 0; i < batch_size; ++i) b.push_back(first + i);
    }
    auto start = Clock::now();
    int64_t checksum = 0;
    for (const auto& b : batches) checksum += splits.train.get(b).inputs.data_ptr<int64_t>()[0];
    const double ours = since(start);
    // memcpy of the same bytes (batch x (context + 1) int64) from random places of the mapping
    // into one output buffer: what a batch must at least move.
    const int64_t row_bytes = (context + 1) * 8;
    std::vector<uint8_t> out(static_cast<size_t>(batch_size * row_bytes));
    start = Clock::now();
    for (int s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < batch_size; ++i) {
        const int64_t at = static_cast<int64_t>(random() % (bin.size() - row_bytes));
        std::memcpy(out.data() + i * row_bytes, bin.data() + at, row_bytes);
      }
      checksum += out[0];
    }
    const double copy = since(start);
    const double tokens = static_cast<double>(steps) * batch_size * (context + 1);
    std::printf(
        "{\"bench\": \"batch\", \"round\": %d, \"context\": %lld, \"batch\": %lld, "
        "\"steps\": %d, \"seconds\": %.6f, \"memcpy_seconds\": %.6f, "
        "\"tokens_per_s\": %.1f, \"memcpy_tokens_per_s\": %.1f, \"checksum\": %lld}\n",
        round, static_cast<long long>(context), static_cast<long long>(batch_size), steps, ours,
        copy, tokens / ours, tokens / copy, static_cast<long long>(checksum));
    std::fflush(stdout);
  }
  return 0;
}

int image_bench(const std::string& folder, int size, int rounds) {
#ifdef DTRAIN_IMAGES
  images::ImageSetOptions options;
  options.spec = folder;
  options.size = size;
  options.test = false;
  const images::ImageSplits splits = images::load_image_splits(options);
  const int64_t n = splits.train.size();
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(folder + "/train")) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files.emplace_back(entry.path().string(), std::string((std::istreambuf_iterator<char>(in)),
                                                          std::istreambuf_iterator<char>()));
  }
  for (int round = 0; round < rounds; ++round) {
    splits.train.set_epoch(round);
    const auto start = Clock::now();
    for (int64_t first = 0; first < n; first += 32) {
      std::vector<int64_t> batch;
      for (int64_t i = first; i < std::min(n, first + 32); ++i) batch.push_back(i);
      splits.train.get(batch);
    }
    const double seconds = since(start);
    // The limit: libjpeg-turbo decoding each whole file, nothing else (files already in memory).
    double decode_seconds = 0;
    for (const auto& path : files) {
      const auto t = Clock::now();
      images::decode_image(reinterpret_cast<const uint8_t*>(path.second.data()), path.second.size(),
                           path.first);
      decode_seconds += since(t);
    }
    std::printf(
        "{\"bench\": \"images\", \"round\": %d, \"images\": %lld, \"seconds\": %.6f, "
        "\"images_per_s\": %.1f, \"decode_only_images_per_s\": %.1f, \"size\": %d, "
        "\"threads\": 1}\n",
        round, static_cast<long long>(n), seconds, n / seconds, files.size() / decode_seconds,
        size);
    std::fflush(stdout);
  }
  return 0;
#else
  (void)folder, (void)size, (void)rounds;
  std::fprintf(stderr, "data_bench: built without libjpeg/libpng\n");
  return 2;
#endif
}

}  // namespace

// A resume's loader work at sample position `at` of the run: everything the trainer does before
// its first step's batch is ready (the token set opened from its cached indices, this rank's
// order, the batch).
int resume(const std::string& data, int64_t context, int64_t batch_size, int64_t samples, int ranks,
           int rounds) {
  tokens::TokenSetOptions options;
  options.spec = data;
  options.context = context;
  options.seed = 1234;
  options.train_samples = samples;
  auto start = Clock::now();
  tokens::load_token_splits(options);  // builds and caches the indices (the first run's work)
  const double build = since(start);
  for (int round = 0; round < rounds; ++round) {
    for (const double fraction : {0.0, 0.5, 0.999}) {
      start = Clock::now();
      const tokens::TokenSplits splits = tokens::load_token_splits(options);
      const double open = since(start);
      const DistributedSampler sampler(splits.train.size(), ranks, 0, {false, 1234, true});
      const std::vector<int64_t> order = sampler.indices();
      const double ordered = since(start);
      const int64_t local_batch = batch_size / ranks;
      const int64_t step = static_cast<int64_t>(fraction * (order.size() / local_batch - 1));
      const std::vector<int64_t> indices(order.begin() + step * local_batch,
                                         order.begin() + (step + 1) * local_batch);
      const int64_t checksum = splits.train.get(indices).inputs.data_ptr<int64_t>()[0];
      const double total = since(start);
      std::printf(
          "{\"bench\": \"resume\", \"round\": %d, \"set\": \"tokens\", \"samples\": %lld, "
          "\"ranks\": %d, \"step\": %lld, \"fraction\": %.3f, \"build_seconds\": %.4f, "
          "\"open_seconds\": %.4f, \"order_seconds\": %.4f, \"seconds\": %.4f, "
          "\"checksum\": %lld}\n",
          round, static_cast<long long>(splits.train.size()), ranks, static_cast<long long>(step),
          fraction, build, open, ordered - open, total, static_cast<long long>(checksum));
    }
    // A shuffled set's resume: the epoch's permutation, whatever the step.
    start = Clock::now();
    const DistributedSampler imagenet(1281167, ranks, 0, {true, 1234, true});
    const int64_t first = imagenet.indices().back();
    std::printf(
        "{\"bench\": \"resume\", \"round\": %d, \"set\": \"shuffled\", \"samples\": "
        "1281167, \"ranks\": %d, \"seconds\": %.4f, \"checksum\": %lld}\n",
        round, ranks, since(start), static_cast<long long>(first));
    std::fflush(stdout);
  }
  return 0;
}

int dump_samples(const std::string& data, int64_t context, int64_t count, uint64_t seed,
                 double validation_fraction, const std::string& out) {
  tokens::TokenSetOptions options;
  options.spec = data;
  options.context = context;
  options.seed = seed;
  options.train_samples = count;
  options.validation_fraction = validation_fraction;
  const tokens::TokenSplits splits = tokens::load_token_splits(options);
  std::vector<int64_t> indices(count);
  for (int64_t i = 0; i < count; ++i) indices[i] = i;
  const Batch batch = splits.train.get(indices);
  const at::Tensor rows = at::cat({batch.inputs, batch.targets.narrow(1, context - 1, 1)}, 1);
  tokens::save_npy(out, rows.contiguous().data_ptr<int64_t>(), "<i8", {count, context + 1});
  return 0;
}

int main(int argc, char** argv) {
  at::set_num_threads(1);
  CLI::App app{"dtrain's data path on one thread"};
  app.require_subcommand(1);
  std::string tokenizer_path, ids_out, data;
  std::vector<std::string> inputs;
  int rounds = 5;
  int steps = 200;
  int64_t context = 1024, batch_size = 16;
  auto* tok = app.add_subcommand("tokenize", "Encode documents with a tokenizer.json");
  tok->add_option("--tokenizer", tokenizer_path)->required();
  tok->add_option("inputs", inputs)->required();
  tok->add_option("--ids-out", ids_out);
  tok->add_option("--rounds", rounds);
  auto* bat = app.add_subcommand("batch", "Assemble batches from token shards");
  bat->add_option("--data", data)->required();
  bat->add_option("--context", context);
  bat->add_option("--batch", batch_size);
  bat->add_option("--rounds", rounds);
  bat->add_option("--steps", steps);
  std::string folder;
  int size = 224;
  auto* img = app.add_subcommand("images", "ImageNet training transforms over a folder");
  img->add_option("--folder", folder)->required();
  img->add_option("--size", size);
  img->add_option("--rounds", rounds);
  int64_t samples = 0;
  int ranks = 8;
  auto* res = app.add_subcommand("resume", "A resume's loader time at the start, middle, end");
  res->add_option("--data", data)->required();
  res->add_option("--context", context);
  res->add_option("--batch", batch_size);
  res->add_option("--samples", samples)->required();
  res->add_option("--ranks", ranks);
  res->add_option("--rounds", rounds);
  uint64_t seed = 1;
  double validation_fraction = 0.1;
  std::string out;
  auto* smp = app.add_subcommand("samples", "The training samples a run reads, as .npy");
  smp->add_option("--data", data)->required();
  smp->add_option("--context", context);
  smp->add_option("--samples", samples)->required();
  smp->add_option("--seed", seed);
  smp->add_option("--validation-fraction", validation_fraction);
  smp->add_option("--out", out)->required();
  CLI11_PARSE(app, argc, argv);
  try {
    if (tok->parsed()) return tokenize(tokenizer_path, inputs, ids_out, rounds);
    if (img->parsed()) return image_bench(folder, size, rounds);
    if (res->parsed()) return resume(data, context, batch_size, samples, ranks, rounds);
    if (smp->parsed()) return dump_samples(data, context, samples, seed, validation_fraction, out);
    return batch(data, context, batch_size, rounds, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_bench: %s\n", e.what());
    return 2;
  }
}
