// UTF-8 corpus reading, the code-point tokenizer and the train/validation split.
#include "dtrain/data/Text.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/Utf8.h"
#include "dtrain/common/Error.h"

namespace dtrain::data {

namespace fs = std::filesystem;

std::vector<char32_t> decode_utf8(const std::string& text, const std::string& origin) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char lead = bytes[i];
    DTRAIN_CHECK_INPUT(lead != 0, origin, " is not text: a NUL byte at offset ", i,
                       " (binary data?)");
    char32_t cp = 0;
    const int length = utf8_sequence(bytes, i, n, cp);
    if (length == 0) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", lead);
      DTRAIN_THROW(InputError, origin, " is not UTF-8 text: malformed sequence at byte offset ", i,
                   " (byte ", hex, ")");
    }
    out.push_back(cp);
    i += length;
  }
  return out;
}

std::string encode_utf8(const std::vector<char32_t>& code_points) {
  std::string out;
  out.reserve(code_points.size());
  for (char32_t cp : code_points) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

CharTokenizer CharTokenizer::fit(const std::string& text, const std::string& origin) {
  std::vector<char32_t> cps = decode_utf8(text, origin);
  std::sort(cps.begin(), cps.end());
  cps.erase(std::unique(cps.begin(), cps.end()), cps.end());
  CharTokenizer tokenizer;
  tokenizer.vocabulary_ = std::move(cps);
  return tokenizer;
}

CharTokenizer CharTokenizer::from_vocabulary(const std::string& utf8) {
  CharTokenizer tokenizer = fit(utf8, "the saved vocabulary");
  DTRAIN_CHECK_INPUT(tokenizer.size() > 0, "the saved vocabulary is empty");
  return tokenizer;
}

std::vector<int64_t> CharTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  const auto cps = decode_utf8(text, "the text to encode");
  ids.reserve(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) {
    const auto it = std::lower_bound(vocabulary_.begin(), vocabulary_.end(), cps[i]);
    if (it == vocabulary_.end() || *it != cps[i]) {
      char code[16];
      std::snprintf(code, sizeof(code), "U+%04X", static_cast<unsigned>(cps[i]));
      DTRAIN_THROW(InputError, "character ", i + 1, " ('", encode_utf8({cps[i]}), "', ", code,
                   ") is not in the model's vocabulary of ", size(), " characters");
    }
    ids.push_back(it - vocabulary_.begin());
  }
  return ids;
}

std::string CharTokenizer::decode(const std::vector<int64_t>& tokens) const {
  std::vector<char32_t> cps;
  cps.reserve(tokens.size());
  for (int64_t t : tokens) {
    DTRAIN_CHECK(t >= 0 && t < size(), "token ", t, " is outside the vocabulary of ", size());
    cps.push_back(vocabulary_[t]);
  }
  return encode_utf8(cps);
}

std::string CharTokenizer::vocabulary_utf8() const { return encode_utf8(vocabulary_); }

namespace {

std::string read_whole(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read ", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fortune file's "%" lines separate the fortunes: each becomes a blank line. Overstruck
// characters ("_\bX", underlining for terminals) keep only what is printed last.
std::string clean_fortunes(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line == "%") line.clear();
    for (char c : line) {
      if (c == '\b') {
        if (!out.empty() && out.back() != '\n') out.pop_back();
      } else {
        out += c;
      }
    }
    out += '\n';
  }
  return out;
}

}  // namespace

std::string read_text_corpus(const std::string& path) {
  std::error_code error;
  DTRAIN_CHECK_INPUT(fs::exists(path, error), "text corpus ", path, " does not exist",
                     path == kFortunesDir ? " (install Debian's fortunes package, or give "
                                            "--text-file FILE)"
                                          : "");
  std::string text;
  if (fs::is_directory(path, error)) {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(path)) {
      if (!entry.is_regular_file() || entry.is_symlink()) continue;
      if (entry.path().has_extension()) continue;  // .dat indexes, .u8 links
      files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    DTRAIN_CHECK_INPUT(!files.empty(), "text corpus directory ", path,
                       " has no text files (files without an extension)");
    for (const auto& file : files) {
      const std::string part = read_whole(file);
      decode_utf8(part, file.string());  // name the file that is not text
      text += clean_fortunes(part);
    }
  } else {
    text = read_whole(path);
    decode_utf8(text, path);
  }
  DTRAIN_CHECK_INPUT(!text.empty(), "text corpus ", path, " is empty");
  return text;
}

TextData load_text(const std::string& path, int64_t context, double validation_fraction) {
  DTRAIN_CHECK_INPUT(context >= 1, "--context must be >= 1, got ", context);
  DTRAIN_CHECK_INPUT(validation_fraction > 0 && validation_fraction < 1,
                     "the validation fraction must be in (0, 1), got ", validation_fraction);
  TextData data;
  data.origin = path.empty() ? kFortunesDir : path;
  const std::string text = read_text_corpus(data.origin);
  data.tokenizer = CharTokenizer::fit(text, data.origin);
  const std::vector<int64_t> ids = data.tokenizer.encode(text);
  const auto n = static_cast<int64_t>(ids.size());
  const auto train_n = static_cast<int64_t>(static_cast<double>(n) * (1 - validation_fraction));
  const int64_t needed = context + 1;
  DTRAIN_CHECK_INPUT(train_n >= needed && n - train_n >= needed, "text corpus ", data.origin,
                     " has ", n, " characters: too short for windows of --context ", context,
                     " in both its training part (", train_n, ") and its validation part (",
                     n - train_n, "); each needs at least ", needed);
  at::Tensor tokens = at::tensor(ids, at::kLong);
  data.train = TensorDataset::windows(tokens.slice(0, 0, train_n).clone(), context, 1);
  data.validation = TensorDataset::windows(tokens.slice(0, train_n, n).clone(), context, context);
  data.train_tokens = train_n;
  data.validation_tokens = n - train_n;
  return data;
}

}  // namespace dtrain::data
