// A byte-level BPE tokenizer (GPT-2's kind, as Hugging Face `tokenizers` runs it): text is cut
// at added (special) tokens, pre-tokenized by a regular expression (GPT-2's pattern, or a
// Split's, e.g. Llama 3's; PCRE2 runs it), each piece's bytes mapped to GPT-2's printable
// characters and merged by rank. Loading a tokenizer.json of that kind and encoding gives the
// ids `tokenizers` gives (tests/tokenizer_test.cpp compares); a tokenizer.json of another kind
// (WordPiece, Unigram, a normalizer) is refused by name. dtrain also trains one
// (train_bpe) and saves it as a tokenizer.json that `tokenizers` loads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::data::tokenizer {

class BpeTokenizer {
 public:
  BpeTokenizer();
  ~BpeTokenizer();
  BpeTokenizer(const BpeTokenizer&);
  BpeTokenizer& operator=(const BpeTokenizer&);
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;

  /// From tokenizer.json's text; InputError naming `origin` and the field when it is not a
  /// byte-level BPE tokenizer dtrain can run exactly.
  static BpeTokenizer from_json(const std::string& json, const std::string& origin);
  /// A tokenizer.json file, or a folder holding one.
  static BpeTokenizer load(const std::string& path);
  /// tokenizer.json's text (what `tokenizers` loads; what a checkpoint keeps).
  std::string to_json() const;
  /// Writes to_json() to `path` (atomically; its folder made if missing).
  void save(const std::string& path) const;

  /// Ids of `text` (as tokenizers' encode(text, add_special_tokens=False)).
  std::vector<int64_t> encode(std::string_view text) const;
  /// Text of `ids` (bytes that do not make UTF-8 become U+FFFD, as tokenizers' decode).
  std::string decode(const std::vector<int64_t>& ids) const;

  /// Ids run from 0 to vocab_size() - 1 (the model's vocabulary and the added tokens).
  int64_t vocab_size() const;
  /// The id of a token's text (-1: none).
  int64_t token_id(const std::string& token) const;
  /// The end-of-document token dtrain puts between documents: an added special token named
  /// like one (`<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>`), else -1.
  int64_t end_of_text() const;

  struct Model;

 private:
  friend class BpeEncoder;
  friend BpeTokenizer train_bpe(const std::vector<std::string>& texts,
                                const struct BpeTrainOptions& options);
  std::shared_ptr<const Model> model_;
};

/// Encodes with a cache of the pieces seen (as tokenizers does): one per thread.
class BpeEncoder {
 public:
  explicit BpeEncoder(const BpeTokenizer& tokenizer);
  ~BpeEncoder();
  /// Appends the ids of `text` to `out`; InputError naming the byte offset of malformed UTF-8.
  void encode(std::string_view text, std::vector<int64_t>& out);

  struct State;  ///< the cache and scratch space (BpeTokenizer.cpp)

 private:
  void encode_checked(std::string_view text, std::vector<int64_t>& out);
  std::shared_ptr<const BpeTokenizer::Model> model_;
  std::unique_ptr<State> state_;
};

struct BpeTrainOptions {
  /// The vocabulary wanted: 256 bytes + merges + the special tokens.
  int64_t vocab_size = 8192;
  /// Pairs seen fewer times are not merged (training may stop below vocab_size).
  int64_t min_frequency = 2;
  std::vector<std::string> special_tokens{"<|endoftext|>"};
  /// Where each text came from ("FILE", "FILE:LINE"), for messages; may be empty.
  std::vector<std::string> origins;
  /// Threads counting pieces (0: every core).
  int threads = 0;
  /// Called with (merges done, merges wanted) as training goes.
  std::function<void(int64_t, int64_t)> progress;
};

/// InputError naming what is wrong with the options (before any text is read).
void check_train_options(const BpeTrainOptions& options);

/// Trains a byte-level BPE on `texts` with GPT-2's pre-tokenization.
BpeTokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& options);

/// Whether this build runs pre-tokenization (PCRE2 found when it was configured).
bool tokenizer_available();

}  // namespace dtrain::data::tokenizer
