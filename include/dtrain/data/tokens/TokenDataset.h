// `--dataset tokens:SPEC`: token shards read as Megatron's GPTDataset reads them. SPEC is
// PATH[,PATH...] (one corpus: every file's documents together) or a weighted blend
// PATH:WEIGHT,PATH:WEIGHT (each PATH its own corpus; a path may be a folder). Samples of
// `context` + 1 tokens are packed across document boundaries in a seeded order built once and
// cached beside the data (GptIndex.h); the held-out split is the last documents of each corpus
// (Megatron's "split"), or an llm.c folder's *_val_* shards when it has them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/data/Dataset.h"

namespace dtrain::data::tokens {

struct BlendPart {
  std::vector<std::string> paths;
  double weight = 1.0;
};

/// The parts of a SPEC; InputError naming what is malformed (a weight that is not a positive
/// number, weights on some parts only, an empty path).
std::vector<BlendPart> parse_token_spec(const std::string& spec);

struct TokenSetOptions {
  std::string spec;
  int64_t context = 0;
  /// Training samples wanted (e.g. steps x global batch); 0: `epochs` passes over the corpus.
  int64_t train_samples = 0;
  int64_t epochs = 1;
  double validation_fraction = 0.1;
  uint32_t seed = 0;
  /// Token ids must be below it; 0: the tokenizer's vocabulary, else the largest id + 1.
  int64_t vocabulary = 0;
  /// The tokenizer.json of the shards ("": tokenizer.json beside the first path, if there is
  /// one, as `dtrain data prepare` leaves it).
  std::string tokenizer;
  /// Where the indices are cached ("": a `cache` folder beside the first file).
  std::string cache_dir;
};

struct TokenSplits {
  TensorDataset train;       ///< presampled: Megatron's shuffled order over every epoch
  TensorDataset validation;  ///< one pass over the held-out samples, in their shuffled order
  int64_t vocabulary = 0;
  /// The tokenizer's tokenizer.json text ("" when there is none).
  std::string tokenizer_json;
  int64_t train_tokens = 0;
  int64_t validation_tokens = 0;
  std::string description;
};

/// Opens the corpora (headers and the id range checked first: InputError naming the file),
/// builds or reads the indices.
TokenSplits load_token_splits(const TokenSetOptions& options);

}  // namespace dtrain::data::tokens
