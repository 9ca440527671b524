// Text for character-level language models: a UTF-8 corpus (one file, or a directory such as
// Debian's fortunes), a tokenizer over its Unicode code points, and the token stream split
// contiguously into training and validation windows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/data/Dataset.h"

namespace dtrain::data {

/// Where Debian's `fortunes` package installs the English fortune files.
constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

/// One token per Unicode code point of a vocabulary (sorted, distinct).
class CharTokenizer {
 public:
  CharTokenizer() = default;
  /// The vocabulary of every code point in `text` (UTF-8, checked: InputError naming `origin`).
  static CharTokenizer fit(const std::string& text, const std::string& origin);
  /// From a saved vocabulary (vocabulary_utf8()).
  static CharTokenizer from_vocabulary(const std::string& utf8);

  int64_t size() const { return static_cast<int64_t>(vocabulary_.size()); }
  /// Token ids; InputError naming the first character outside the vocabulary.
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& tokens) const;
  /// The vocabulary as UTF-8 text (what a checkpoint saves).
  std::string vocabulary_utf8() const;

 private:
  std::vector<char32_t> vocabulary_;
};

/// UTF-8 -> code points; InputError naming `origin` and the byte offset for a NUL byte (binary
/// data) or a malformed sequence.
std::vector<char32_t> decode_utf8(const std::string& text, const std::string& origin);
std::string encode_utf8(const std::vector<char32_t>& code_points);

/// The corpus at `path`: a file's text, or for a directory the text of every regular file in
/// it whose name has no extension (the fortune files; their `.dat` indexes and `.u8` links are
/// skipped), in name order, with the fortune files' `%` separator lines as blank lines and
/// overstruck characters (X backspace Y) as Y. InputError
/// when the path is missing, unreadable, empty, or not UTF-8 text.
std::string read_text_corpus(const std::string& path);

struct TextData {
  CharTokenizer tokenizer;
  TensorDataset train;       ///< every window of `context` tokens (stride 1)
  TensorDataset validation;  ///< non-overlapping windows (each token predicted once)
  int64_t train_tokens = 0;
  int64_t validation_tokens = 0;
  std::string origin;
};

/// Reads `path` ("" = the fortunes directory), fits the tokenizer on all of it, and splits the
/// stream: the first 1 - validation_fraction for training, the rest for validation. InputError
/// when either part is shorter than one window plus its target.
TextData load_text(const std::string& path, int64_t context, double validation_fraction = 0.1);

}  // namespace dtrain::data
