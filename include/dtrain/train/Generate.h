// Sampling text from a trained language-model checkpoint (`dtrain generate`): the GPT sizes and
// the tokenizer's vocabulary come from the checkpoint's meta.json, the weights from its shards
// (any strategy, world size or parallel layout).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dtrain::train {

struct GenerateOptions {
  std::string checkpoint;    ///< a checkpoint, or a checkpoint directory (its newest)
  std::string prompt;        ///< "" = start from a newline (or the first character)
  int64_t tokens = 200;      ///< characters to add
  double temperature = 1.0;  ///< 0 = always the most likely character
  int64_t top_k = 0;         ///< > 0: sample among the k most likely only
  uint64_t seed = 0;
  int threads = 0;  ///< 0 = all cores
  /// Go on past the tokenizer's end-of-text token (by default sampling stops at it, as
  /// transformers' generate() stops at eos_token_id: `dtrain ckpt export` writes it there).
  bool ignore_eos = false;
};

/// The prompt followed by the sampled continuation; `on_token` (optional) sees the prompt once
/// it is accepted, then each new piece of text as it is sampled. InputError for a checkpoint
/// without a language model, a prompt with characters outside its vocabulary, or bad options.
std::string generate_text(const GenerateOptions& options,
                          const std::function<void(const std::string&)>& on_token = nullptr);

}  // namespace dtrain::train
