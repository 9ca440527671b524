// Training a byte-level BPE (dtrain data tokenizer train): pieces counted on every core with the
// GPT-2 pre-tokenization, then the most frequent pair merged in turn (ties to the pair whose
// tokens sort first), written as a tokenizer.json that Hugging Face tokenizers loads.
#include "BpeModel.h"

#include <algorithm>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <thread>
#include <unordered_set>

namespace dtrain::data::tokenizer {

using Model = BpeTokenizer::Model;

namespace {

using json = nlohmann::json;

// tokenizer.json for a trained byte-level BPE: GPT-2's layout, as tokenizers writes it.
std::string trained_json(const std::vector<std::string>& tokens,
                         const std::vector<std::pair<std::string, std::string>>& merges,
                         const std::vector<std::string>& special) {
  json root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  json added = json::array();
  const int64_t first_special = static_cast<int64_t>(tokens.size() - special.size());
  for (size_t k = 0; k < special.size(); ++k) {
    added.push_back({{"id", first_special + static_cast<int64_t>(k)},
                     {"content", special[k]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", true},
                     {"special", true}});
  }
  root["added_tokens"] = added;
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  root["post_processor"] = {{"type", "ByteLevel"},
                            {"add_prefix_space", true},
                            {"trim_offsets", false},
                            {"use_regex", true}};
  root["decoder"] = {{"type", "ByteLevel"},
                     {"add_prefix_space", true},
                     {"trim_offsets", true},
                     {"use_regex", true}};
  json vocab = json::object();
  for (size_t id = 0; id < tokens.size(); ++id) vocab[tokens[id]] = id;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) merge_list.push_back(a + " " + b);
  root["model"] = {{"type", "BPE"},
                   {"dropout", nullptr},
                   {"unk_token", nullptr},
                   {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr},
                   {"fuse_unk", false},
                   {"byte_fallback", false},
                   {"ignore_merges", false},
                   {"vocab", vocab},
                   {"merges", merge_list}};
  return root.dump(2);
}

}  // namespace

void check_train_options(const BpeTrainOptions& options) {
  const int64_t fixed = 256 + static_cast<int64_t>(options.special_tokens.size());
  DTRAIN_CHECK_INPUT(options.vocab_size >= fixed, "--vocab-size ", options.vocab_size,
                     " is below the ", fixed, " tokens every byte-level BPE holds (256 bytes and ",
                     options.special_tokens.size(), " special)");
  DTRAIN_CHECK_INPUT(options.min_frequency >= 1, "--min-frequency must be >= 1, got ",
                     options.min_frequency);
}

BpeTokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& options) {
  check_train_options(options);
  const int64_t wanted_merges =
      options.vocab_size - 256 - static_cast<int64_t>(options.special_tokens.size());
  // The pieces and their counts, texts shared over the threads.
  BpeTokenizer pieces_only = BpeTokenizer::from_json(trained_json(
                                                         [] {
                                                           std::vector<std::string> t;
                                                           const auto chars = byte_characters();
                                                           for (int b = 0; b < 256; ++b)
                                                             t.push_back(utf8_of(chars[b]));
                                                           return t;
                                                         }(),
                                                         {}, {}),
                                                     "(training)");
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::unordered_map<std::string, int64_t>> counts(threads);
  {
    std::vector<std::thread> workers;
    std::mutex error_mutex;
    std::string error;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        try {
#if DTRAIN_HAVE_PCRE2
          const Model& model = *pieces_only.model_;
          BpeEncoder::State state;
          for (const auto& regex : model.splits) {
            state.matches.push_back(pcre2_match_data_create_from_pattern(regex->code, nullptr));
          }
          for (size_t k = t; k < texts.size(); k += threads) {
            std::vector<std::string_view> out;
            try {
              split_pieces(*model.splits[0], state.matches[0], texts[k], true, out);
            } catch (const InputError& e) {
              const std::string origin =
                  k < options.origins.size() ? options.origins[k] : concat("document ", k + 1);
              std::lock_guard<std::mutex> lock(error_mutex);
              if (error.empty()) error = concat(origin, ": ", e.message());
              break;
            }
            for (std::string_view piece : out) ++counts[t][std::string(piece)];
          }
#endif
        } catch (const Error& e) {
          std::lock_guard<std::mutex> lock(error_mutex);
          error = e.message();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(error_mutex);
          error = e.what();
        }
      });
    }
    for (auto& w : workers) w.join();
    DTRAIN_CHECK_INPUT(error.empty(), "tokenizer training: ", error);
  }
  for (int t = 1; t < threads; ++t) {
    for (auto& [piece, n] : counts[t]) counts[0][piece] += n;
    counts[t].clear();
  }
  // Words as symbol ids (byte b is id b), with their counts.
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  for (const auto& [piece, n] : counts[0]) {
    std::vector<int32_t> symbols;
    for (unsigned char b : piece) symbols.push_back(b);
    words.push_back(std::move(symbols));
    freq.push_back(n);
  }
  counts[0].clear();
  const std::vector<uint32_t> chars = byte_characters();
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(utf8_of(chars[b]));
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::unordered_set<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t key = pair_key(words[w][i], words[w][i + 1]);
      pair_count[key] += freq[w];
      where[key].insert(static_cast<int32_t>(w));
    }
  }
  // The most frequent pair first; among equal counts the pair whose tokens sort first.
  struct Entry {
    int64_t count;
    uint64_t key;
  };
  auto less = [&tokens](const Entry& x, const Entry& y) {
    if (x.count != y.count) return x.count < y.count;
    const auto xa = tokens[x.key >> 32], xb = tokens[x.key & 0xffffffff];
    const auto ya = tokens[y.key >> 32], yb = tokens[y.key & 0xffffffff];
    return std::tie(xa, xb) > std::tie(ya, yb);
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(less)> queue(less);
  for (const auto& [key, n] : pair_count) queue.push({n, key});
  std::vector<std::pair<std::string, std::string>> merges;
  while (static_cast<int64_t>(merges.size()) < wanted_merges && !queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    const auto current = pair_count.find(top.key);
    if (current == pair_count.end() || current->second != top.count) continue;  // stale
    if (top.count < options.min_frequency) break;
    const int32_t a = static_cast<int32_t>(top.key >> 32);
    const int32_t b = static_cast<int32_t>(top.key & 0xffffffff);
    const int32_t merged = static_cast<int32_t>(tokens.size());
    tokens.push_back(tokens[a] + tokens[b]);
    merges.emplace_back(tokens[a], tokens[b]);
    std::unordered_map<uint64_t, int64_t> changed;
    const std::unordered_set<int32_t> holders = std::move(where[top.key]);
    where.erase(top.key);
    for (int32_t w : holders) {
      std::vector<int32_t>& symbols = words[w];
      const int64_t n = freq[w];
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        if (symbols[i] != a || symbols[i + 1] != b) continue;
        if (i > 0) {
          changed[pair_key(symbols[i - 1], a)] -= n;
          changed[pair_key(symbols[i - 1], merged)] += n;
          where[pair_key(symbols[i - 1], merged)].insert(w);
        }
        if (i + 2 < symbols.size()) {
          changed[pair_key(b, symbols[i + 2])] -= n;
          changed[pair_key(merged, symbols[i + 2])] += n;
          where[pair_key(merged, symbols[i + 2])].insert(w);
        }
        changed[top.key] -= n;
        symbols[i] = merged;
        symbols.erase(symbols.begin() + static_cast<int64_t>(i) + 1);
      }
    }
    for (const auto& [key, delta] : changed) {
      int64_t& count = pair_count[key];
      count += delta;
      if (count <= 0) {
        pair_count.erase(key);
      } else if (delta != 0) {
        queue.push({count, key});
      }
    }
    if (options.progress) options.progress(static_cast<int64_t>(merges.size()), wanted_merges);
  }
  for (const auto& special : options.special_tokens) tokens.push_back(special);
  return BpeTokenizer::from_json(trained_json(tokens, merges, options.special_tokens),
                                 "(trained tokenizer)");
}

}  // namespace dtrain::data::tokenizer
