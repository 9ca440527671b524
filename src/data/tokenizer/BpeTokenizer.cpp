// Byte-level BPE as Hugging Face `tokenizers` runs it (tokenizers/src/models/bpe/word.rs: the
// lowest-ranked pair first, the leftmost of equal ranks; pre_tokenizers/byte_level.rs: GPT-2's
// byte-to-character table and pattern; added_vocabulary.rs: added tokens cut out first,
// leftmost-longest). Its trainer is BpeTrainer.cpp.
#include "dtrain/data/tokenizer/BpeTokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <set>
#include <unordered_map>

#include "BpeModel.h"
#include "common/Files.h"
#include "data/Utf8.h"
#include "dtrain/common/Error.h"

namespace dtrain::data::tokenizer {

namespace {

using json = nlohmann::json;

// GPT-2's pattern (tokenizers' ByteLevel with use_regex).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// String::from_utf8_lossy: each maximal invalid subsequence becomes U+FFFD.
std::string lossy_utf8(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  const size_t n = bytes.size();
  size_t i = 0;
  auto at = [&](size_t k) { return static_cast<uint8_t>(bytes[k]); };
  while (i < n) {
    const uint8_t b = at(i);
    if (b < 0x80) {
      out += static_cast<char>(b);
      ++i;
      continue;
    }
    int length = 0;
    uint8_t low = 0x80;
    uint8_t high = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      length = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      length = 3;
      if (b == 0xE0) low = 0xA0;
      if (b == 0xED) high = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      length = 4;
      if (b == 0xF0) low = 0x90;
      if (b == 0xF4) high = 0x8F;
    }
    if (length == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    int good = 1;
    for (int k = 1; k < length; ++k) {
      if (i + k >= n) break;
      const uint8_t c = at(i + k);
      const bool ok = k == 1 ? (c >= low && c <= high) : (c >= 0x80 && c <= 0xBF);
      if (!ok) break;
      ++good;
    }
    if (good == length) {
      out.append(bytes, i, length);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += good;
  }
  return out;
}

}  // namespace

std::string utf8_of(uint32_t code) {
  std::string out;
  if (code < 0x80) {
    out += static_cast<char>(code);
  } else if (code < 0x800) {
    out += static_cast<char>(0xC0 | (code >> 6));
    out += static_cast<char>(0x80 | (code & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (code >> 12));
    out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code & 0x3F));
  }
  return out;
}

std::vector<uint32_t> byte_characters() {
  std::vector<uint32_t> chars(256, 0);
  std::vector<bool> printable(256, false);
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  int n = 0;
  for (int b = 0; b < 256; ++b) chars[b] = printable[b] ? b : 256 + n++;
  return chars;
}

namespace {

using Model = BpeTokenizer::Model;

// word.rs's merge_all: the lowest-ranked pair first, the leftmost among equal ranks.
void merge_word(const Model& model, BpeEncoder::State& s, std::vector<int32_t>& out) {
  const int32_t n = static_cast<int32_t>(s.id.size());
  s.prev.resize(n);
  s.next.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    s.prev[i] = i - 1;
    s.next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  for (int32_t i = 0; i + 1 < n; ++i) {
    const auto it = model.merges.find(pair_key(s.id[i], s.id[i + 1]));
    if (it != model.merges.end()) queue.push({it->second.first, i, it->second.second});
  }
  std::vector<bool> dead(n, false);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (dead[top.pos] || s.next[top.pos] == -1) continue;
    const int32_t right = s.next[top.pos];
    const auto it = model.merges.find(pair_key(s.id[top.pos], s.id[right]));
    if (it == model.merges.end() || it->second.second != top.new_id) continue;
    s.id[top.pos] = top.new_id;
    dead[right] = true;
    s.next[top.pos] = s.next[right];
    if (s.next[right] != -1) s.prev[s.next[right]] = top.pos;
    if (s.prev[top.pos] != -1) {
      const int32_t left = s.prev[top.pos];
      const auto m = model.merges.find(pair_key(s.id[left], s.id[top.pos]));
      if (m != model.merges.end()) queue.push({m->second.first, left, m->second.second});
    }
    if (s.next[top.pos] != -1) {
      const auto m = model.merges.find(pair_key(s.id[top.pos], s.id[s.next[top.pos]]));
      if (m != model.merges.end()) queue.push({m->second.first, top.pos, m->second.second});
    }
  }
  out.clear();
  for (int32_t i = 0; i != -1; i = s.next[i]) out.push_back(s.id[i]);
}

// One pre-token's ids (cached).
const std::vector<int32_t>& piece_ids(const Model& model, BpeEncoder::State& s,
                                      std::string_view piece) {
  const std::string key(piece);
  auto found = s.cache.find(key);
  if (found != s.cache.end()) return found->second;
  if (s.cache.size() > 200000) s.cache.clear();
  std::vector<int32_t> ids;
  bool whole = false;
  if (model.ignore_merges) {
    s.mapped.clear();
    for (unsigned char b : piece) s.mapped += model.byte_chars[b];
    const auto it = model.vocab.find(s.mapped);
    if (it != model.vocab.end()) {
      ids.push_back(it->second);
      whole = true;
    }
  }
  if (!whole) {
    s.id.clear();
    for (unsigned char b : piece) s.id.push_back(model.byte_ids[b]);
    merge_word(model, s, ids);
  }
  return s.cache.emplace(key, std::move(ids)).first->second;
}

void encode_segment(const Model& model, BpeEncoder::State& s, std::string_view segment,
                    std::vector<int64_t>& out) {
  if (segment.empty()) return;
  std::string with_space;
  if (model.prefix_space && segment.front() != ' ') {
    with_space = " " + std::string(segment);
    segment = with_space;
  }
  s.pieces.assign(1, segment);
#if DTRAIN_HAVE_PCRE2
  for (size_t r = 0; r < model.splits.size(); ++r) {
    s.next_pieces.clear();
    for (std::string_view piece : s.pieces) {
      split_pieces(*model.splits[r], s.matches[r], piece, r == 0, s.next_pieces);
    }
    s.pieces.swap(s.next_pieces);
  }
#endif
  for (std::string_view piece : s.pieces) {
    for (int32_t id : piece_ids(model, s, piece)) out.push_back(id);
  }
}

}  // namespace

namespace {

// The offset of the first malformed UTF-8 sequence in `text` (npos: none).
size_t first_malformed_utf8(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    char32_t cp = 0;
    const int length = utf8_sequence(bytes, i, n, cp);
    if (length == 0) return i;
    i += static_cast<size_t>(length);
  }
  return std::string_view::npos;
}

std::string malformed_utf8_message(std::string_view text, size_t offset) {
  char hex[8];
  std::snprintf(hex, sizeof(hex), "0x%02X", static_cast<unsigned char>(text[offset]));
  return concat("the text is not UTF-8: a malformed sequence at byte offset ", offset, " (byte ",
                hex, ")");
}

}  // namespace

#if DTRAIN_HAVE_PCRE2
void split_pieces(const Regex& regex, pcre2_match_data* match, std::string_view text,
                  bool check_utf, std::vector<std::string_view>& out) {
  PCRE2_SIZE start = 0;
  size_t kept = 0;
  uint32_t options = check_utf ? 0 : PCRE2_NO_UTF_CHECK;
  while (start < text.size()) {
    const int rc = pcre2_match(regex.code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                               start, options, match, nullptr);
    options = PCRE2_NO_UTF_CHECK;
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // (PCRE2 leaves the match's offsets unset on a UTF error: the offset is our own scan's.)
      const size_t bad = first_malformed_utf8(text);
      DTRAIN_CHECK_INPUT(bad == std::string_view::npos, malformed_utf8_message(text, bad));
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      DTRAIN_CHECK_INPUT(false, "the tokenizer's pattern failed on the text (",
                         reinterpret_cast<const char*>(message), ")");
    }
    const PCRE2_SIZE* range = pcre2_get_ovector_pointer(match);
    if (range[0] > kept) out.push_back(text.substr(kept, range[0] - kept));
    if (range[1] > range[0]) {
      out.push_back(text.substr(range[0], range[1] - range[0]));
      start = range[1];
    } else {
      // An empty match: step over one character.
      start = range[0] + 1;
      while (start < text.size() && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) ++start;
      continue;
    }
    kept = range[1];
  }
  if (kept < text.size()) out.push_back(text.substr(kept));
}
#endif

BpeTokenizer::BpeTokenizer() = default;
BpeTokenizer::~BpeTokenizer() = default;
BpeTokenizer::BpeTokenizer(const BpeTokenizer&) = default;
BpeTokenizer& BpeTokenizer::operator=(const BpeTokenizer&) = default;
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;

bool tokenizer_available() { return DTRAIN_HAVE_PCRE2 != 0; }

BpeEncoder::BpeEncoder(const BpeTokenizer& tokenizer)
    : model_(tokenizer.model_), state_(std::make_unique<State>()) {
  DTRAIN_CHECK(model_ != nullptr, "BpeEncoder: an empty tokenizer");
#if DTRAIN_HAVE_PCRE2
  for (const auto& regex : model_->splits) {
    state_->matches.push_back(pcre2_match_data_create_from_pattern(regex->code, nullptr));
  }
#endif
}

BpeEncoder::~BpeEncoder() = default;

void BpeEncoder::encode(std::string_view text, std::vector<int64_t>& out) {
  try {
    encode_checked(text, out);
  } catch (const InputError&) {
    // Malformed UTF-8 is found in a piece of the text: its offset is named in the whole text.
    const size_t bad = first_malformed_utf8(text);
    if (bad != std::string_view::npos) DTRAIN_THROW(InputError, malformed_utf8_message(text, bad));
    throw;
  }
}

void BpeEncoder::encode_checked(std::string_view text, std::vector<int64_t>& out) {
  const Model& model = *model_;
  size_t begin = 0;
  size_t i = 0;
  while (i < text.size() && !model.added.empty()) {
    if (!model.added_first[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    const Model::Added* hit = nullptr;
    for (const auto& added : model.added) {  // longest first
      if (text.compare(i, added.content.size(), added.content) == 0) {
        hit = &added;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    encode_segment(model, *state_, text.substr(begin, i - begin), out);
    out.push_back(hit->id);
    i += hit->content.size();
    begin = i;
  }
  encode_segment(model, *state_, text.substr(begin), out);
}

std::vector<int64_t> BpeTokenizer::encode(std::string_view text) const {
  BpeEncoder encoder(*this);
  std::vector<int64_t> ids;
  encoder.encode(text, ids);
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  const Model& model = *model_;
  std::string bytes;
  std::string out;
  std::unordered_map<int32_t, const Model::Added*> added;
  for (const auto& a : model.added) added[a.id] = &a;
  for (int64_t id : ids) {
    DTRAIN_CHECK_INPUT(id >= 0 && id < vocab_size(), "token id ", id,
                       " is outside the tokenizer's vocabulary of ", vocab_size());
    const auto special = added.find(static_cast<int32_t>(id));
    if (special != added.end()) {
      out += lossy_utf8(bytes);
      bytes.clear();
      out += special->second->content;
      continue;
    }
    const std::string& token = model.tokens[id];
    for (size_t k = 0; k < token.size();) {
      // Decode one UTF-8 character of the token (all below U+0144).
      uint32_t code = static_cast<uint8_t>(token[k]);
      int length = 1;
      if (code >= 0xC0) {
        length = code >= 0xE0 ? 3 : 2;
        code &= length == 2 ? 0x1F : 0x0F;
        for (int j = 1; j < length && k + j < token.size(); ++j) {
          code = (code << 6) | (static_cast<uint8_t>(token[k + j]) & 0x3F);
        }
      }
      if (code < 324) bytes += static_cast<char>(model.char_byte[code]);
      k += length;
    }
  }
  return out + lossy_utf8(bytes);
}

int64_t BpeTokenizer::vocab_size() const {
  return model_ ? static_cast<int64_t>(model_->tokens.size()) : 0;
}

int64_t BpeTokenizer::token_id(const std::string& token) const {
  for (const auto& a : model_->added) {
    if (a.content == token) return a.id;
  }
  const auto it = model_->vocab.find(token);
  return it == model_->vocab.end() ? -1 : it->second;
}

int64_t BpeTokenizer::end_of_text() const {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    for (const auto& a : model_->added) {
      if (a.special && a.content == name) return a.id;
    }
  }
  return -1;
}

std::string BpeTokenizer::to_json() const { return model_->json_text; }

void BpeTokenizer::save(const std::string& path) const {
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code error;
  if (!parent.empty()) std::filesystem::create_directories(parent, error);
  write_file_atomically(path, model_->json_text.data(), model_->json_text.size());
}

namespace {

// The checks of a tokenizer.json's parts: what dtrain runs exactly, or one line naming what it
// does not.
void check_kind(const json& root, const std::string& origin) {
  auto is_null_or = [](const json& j, const char* key, const char* type) {
    return !j.contains(key) || j[key].is_null() ||
           (j[key].is_object() && j[key].value("type", "") == type);
  };
  DTRAIN_CHECK_INPUT(root.is_object() && root.contains("model") && root["model"].is_object(),
                     origin, ": not a tokenizer.json (no \"model\")");
  const json& model = root["model"];
  const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
  DTRAIN_CHECK_INPUT(type == "BPE", origin, ": a ", type.empty() ? "model without a type" : type,
                     " tokenizer; dtrain runs byte-level BPE (GPT-2's kind) only");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    DTRAIN_CHECK_INPUT(!model.contains(key) || model[key].is_null() || model[key] == "", origin,
                       ": model.", key, " is set (a BPE that is not byte-level)");
  }
  DTRAIN_CHECK_INPUT(!model.value("byte_fallback", false), origin,
                     ": model.byte_fallback (SentencePiece-style BPE) is not byte-level BPE");
  DTRAIN_CHECK_INPUT(!model.contains("dropout") || model["dropout"].is_null(), origin,
                     ": model.dropout is set (BPE dropout makes encoding random)");
  DTRAIN_CHECK_INPUT(!root.contains("normalizer") || root["normalizer"].is_null(), origin,
                     ": the normalizer ", root.value("normalizer", json()).dump(),
                     " is not supported (byte-level BPE has none)");
  DTRAIN_CHECK_INPUT(is_null_or(root, "decoder", "ByteLevel"), origin, ": the decoder ",
                     root["decoder"].value("type", "?"), " is not byte-level");
}

}  // namespace

BpeTokenizer BpeTokenizer::from_json(const std::string& text, const std::string& origin) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    DTRAIN_CHECK_INPUT(false, origin, ": not JSON (", json_error_text(e.what()), ")");
  }
  check_kind(root, origin);
  auto model = std::make_shared<Model>();
  model->json_text = text;
  // The pre-tokenizer: ByteLevel (GPT-2's pattern unless use_regex is false), or a Sequence of
  // Splits ("Isolated") ending in ByteLevel.
  const json pre = root.value("pre_tokenizer", json());
  std::vector<json> steps;
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    for (const json& step : pre.value("pretokenizers", json::array())) steps.push_back(step);
  } else {
    steps.push_back(pre);
  }
  DTRAIN_CHECK_INPUT(
      !steps.empty() && steps.back().is_object() && steps.back().value("type", "") == "ByteLevel",
      origin, ": the pre-tokenizer ", pre.dump().substr(0, 120),
      " is not byte-level (dtrain runs ByteLevel, after Splits)");
  for (size_t k = 0; k + 1 < steps.size(); ++k) {
    const json& step = steps[k];
    DTRAIN_CHECK_INPUT(step.value("type", "") == "Split" &&
                           step.value("behavior", "") == "Isolated" && !step.value("invert", false),
                       origin, ": pre-tokenizer step ", step.dump().substr(0, 120),
                       " is not supported (dtrain runs Split with behavior Isolated)");
    const json& pattern = step["pattern"];
    const bool literal = pattern.contains("String");
    model->splits.push_back(
        std::make_shared<Regex>(pattern.value(literal ? "String" : "Regex", ""), literal, origin));
  }
  const json& byte_level = steps.back();
  model->prefix_space = byte_level.value("add_prefix_space", false);
  if (byte_level.value("use_regex", true)) {
    model->splits.push_back(std::make_shared<Regex>(kGpt2Pattern, false, origin));
  }
  const json& m = root["model"];
  model->ignore_merges = m.value("ignore_merges", false);
  DTRAIN_CHECK_INPUT(m.contains("vocab") && m["vocab"].is_object(), origin,
                     ": model.vocab is missing");
  int64_t size = 0;
  for (const auto& [token, id] : m["vocab"].items()) {
    DTRAIN_CHECK_INPUT(
        id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < (int64_t{1} << 31),
        origin, ": model.vocab[\"", token, "\"] is not an id");
    model->vocab[token] = id.get<int32_t>();
    size = std::max<int64_t>(size, id.get<int64_t>() + 1);
  }
  if (root.contains("added_tokens") && root["added_tokens"].is_array()) {
    for (const json& a : root["added_tokens"]) {
      const std::string content = a.value("content", "");
      DTRAIN_CHECK_INPUT(!content.empty() && a.contains("id"), origin,
                         ": an added token without content or id");
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        DTRAIN_CHECK_INPUT(!a.value(flag, false), origin, ": added token ", content, " sets ", flag,
                           ", which dtrain does not run");
      }
      model->added.push_back({content, a["id"].get<int32_t>(), a.value("special", false)});
      size = std::max<int64_t>(size, a["id"].get<int64_t>() + 1);
    }
  }
  std::sort(model->added.begin(), model->added.end(),
            [](const auto& x, const auto& y) { return x.content.size() > y.content.size(); });
  for (const auto& a : model->added) model->added_first[static_cast<uint8_t>(a.content[0])] = true;
  model->tokens.assign(size, std::string());
  for (const auto& [token, id] : model->vocab) model->tokens[id] = token;
  for (const auto& a : model->added) model->tokens[a.id] = a.content;

  const std::vector<uint32_t> chars = byte_characters();
  for (int b = 0; b < 256; ++b) {
    model->byte_chars[b] = utf8_of(chars[b]);
    model->char_byte[chars[b]] = static_cast<uint8_t>(b);
    const auto it = model->vocab.find(model->byte_chars[b]);
    DTRAIN_CHECK_INPUT(it != model->vocab.end(), origin, ": model.vocab has no token for byte ", b,
                       " (\"", model->byte_chars[b],
                       "\"): not a byte-level BPE over all 256 bytes");
    model->byte_ids[b] = it->second;
  }
  DTRAIN_CHECK_INPUT(m.contains("merges") && m["merges"].is_array(), origin,
                     ": model.merges is missing");
  int32_t rank = 0;
  for (const json& merge : m["merges"]) {
    std::string a;
    std::string b;
    if (merge.is_string()) {
      const std::string pair = merge.get<std::string>();
      const size_t space = pair.find(' ');
      DTRAIN_CHECK_INPUT(
          space != std::string::npos && pair.find(' ', space + 1) == std::string::npos, origin,
          ": merge ", rank, " (\"", pair, "\") is not two tokens");
      a = pair.substr(0, space);
      b = pair.substr(space + 1);
    } else {
      DTRAIN_CHECK_INPUT(merge.is_array() && merge.size() == 2, origin, ": merge ", rank,
                         " is not a pair");
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    }
    const auto ia = model->vocab.find(a);
    const auto ib = model->vocab.find(b);
    const auto ij = model->vocab.find(a + b);
    DTRAIN_CHECK_INPUT(
        ia != model->vocab.end() && ib != model->vocab.end() && ij != model->vocab.end(), origin,
        ": merge ", rank, " (", a, " ", b, ") names a token not in the vocab");
    model->merges.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, ij->second));
    model->merge_list.emplace_back(a, b);
    ++rank;
  }

  BpeTokenizer tokenizer;
  tokenizer.model_ = std::move(model);
  return tokenizer;
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::error_code error;
  const std::string file = std::filesystem::is_directory(path, error)
                               ? (std::filesystem::path(path) / "tokenizer.json").string()
                               : path;
  std::ifstream in(file, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read the tokenizer ", file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return from_json(text, file);
}

}  // namespace dtrain::data::tokenizer
