// The byte-level BPE's insides, shared by the tokenizer (BpeTokenizer.cpp) and its trainer
// (BpeTrainer.cpp): the loaded model, an encoder's scratch state, the pre-tokenizer's pattern
// (PCRE2) and GPT-2's byte-to-character table. Private to the library.
#pragma once

#ifndef DTRAIN_HAVE_PCRE2
#define DTRAIN_HAVE_PCRE2 0
#endif
#define PCRE2_CODE_UNIT_WIDTH 8
#if DTRAIN_HAVE_PCRE2
#include <pcre2.h>
#endif

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"

namespace dtrain::data::tokenizer {

/// A code point as UTF-8 (below U+10000: what the byte table needs).
std::string utf8_of(uint32_t code);

/// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n.
std::vector<uint32_t> byte_characters();

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

#if DTRAIN_HAVE_PCRE2
struct Regex {
  explicit Regex(const std::string& pattern, bool literal, const std::string& origin) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // With UCP, PCRE2's \s, \p{L} and \p{N} are Unicode's, as Oniguruma's are in tokenizers
    // (U+0085 and U+3000 among the spaces: the tests' text has both).
    const std::string& source = pattern;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                         PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0), &error, &offset,
                         nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      DTRAIN_CHECK_INPUT(false, origin, ": the pre-tokenizer's pattern does not compile at ",
                         offset, ": ", reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code); }
  pcre2_code* code = nullptr;
};
#else
struct Regex {
  Regex(const std::string&, bool, const std::string& origin) {
    DTRAIN_CHECK_INPUT(false, origin,
                       ": this dtrain was built without PCRE2, which byte-level BPE's "
                       "pre-tokenization needs (install libpcre2-dev and rebuild)");
  }
};
#endif

struct BpeTokenizer::Model {
  std::vector<std::string> tokens;  // by id ("" for unused ids)
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // -> (rank, new id)
  std::vector<std::pair<std::string, std::string>> merge_list;
  int32_t byte_ids[256] = {};
  std::string byte_chars[256];
  uint8_t char_byte[324] = {};
  struct Added {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<Added> added;  // longest first
  bool added_first[256] = {};
  std::vector<std::shared_ptr<Regex>> splits;  // applied in turn
  bool prefix_space = false;
  bool ignore_merges = false;
  std::string json_text;
};

struct BpeEncoder::State {
#if DTRAIN_HAVE_PCRE2
  std::vector<pcre2_match_data*> matches;
  ~State() {
    for (auto* m : matches) pcre2_match_data_free(m);
  }
#endif
  std::unordered_map<std::string, std::vector<int32_t>> cache;
  std::vector<std::string_view> pieces;
  std::vector<std::string_view> next_pieces;
  std::string mapped;
  // Word merging: symbol ids and the links between live symbols.
  std::vector<int32_t> id;
  std::vector<int32_t> prev;
  std::vector<int32_t> next;
};

#if DTRAIN_HAVE_PCRE2
/// Cuts `text` by a pattern, keeping what lies between matches (Split's "Isolated").
void split_pieces(const Regex& regex, pcre2_match_data* match, std::string_view text,
                  bool check_utf, std::vector<std::string_view>& out);
#endif

}  // namespace dtrain::data::tokenizer
