// Text to token shards: documents read in batches of about 32 MB, each batch encoded by every
// thread (documents handed out one at a time) and written in document order.
#include "dtrain/data/tokens/Prepare.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/Files.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/data/tokens/TokenFiles.h"

namespace dtrain::data::tokens {

namespace fs = std::filesystem;

namespace {

bool has_suffix(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_lines(const std::string& path) {
  return has_suffix(path, ".jsonl") || has_suffix(path, ".ndjson");
}

bool is_text_name(const fs::path& path) {
  static const char* kText[] = {".txt", ".md",   ".rst",   ".html",
                                ".htm", ".text", ".jsonl", ".ndjson"};
  const std::string ext = path.extension().string();
  if (ext.empty()) return path.filename().string()[0] != '.';
  return std::find(std::begin(kText), std::end(kText), ext) != std::end(kText);
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read ", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

std::vector<std::string> source_files(const TextSource& source, int64_t* total_bytes) {
  DTRAIN_CHECK_INPUT(!source.inputs.empty(), "no text to read: give files or folders");
  std::vector<std::string> files;
  for (const std::string& input : source.inputs) {
    std::error_code error;
    if (fs::is_directory(input, error)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(input, error);
           it != fs::recursive_directory_iterator(); it.increment(error)) {
        if (error) break;
        if (it->is_regular_file() && !it->is_symlink() && is_text_name(it->path())) {
          found.push_back(it->path().string());
        }
      }
      DTRAIN_CHECK_INPUT(!error, "cannot read the folder ", input, ": ", error.message());
      std::sort(found.begin(), found.end());
      DTRAIN_CHECK_INPUT(!found.empty(), input,
                         " holds no text files (.txt, .md, .rst, .html, .jsonl, ... or files "
                         "without an extension)");
      files.insert(files.end(), found.begin(), found.end());
    } else {
      DTRAIN_CHECK_INPUT(fs::is_regular_file(input, error), input,
                         " is not a file or folder that can be read");
      files.push_back(input);
    }
  }
  if (total_bytes != nullptr) {
    *total_bytes = 0;
    for (const auto& file : files) *total_bytes += static_cast<int64_t>(fs::file_size(file));
  }
  return files;
}

void for_each_document(const TextSource& source,
                       const std::function<void(const std::string&, std::string, int64_t)>& fn) {
  int64_t done = 0;
  for (const std::string& file : source_files(source, nullptr)) {
    std::string text = read_whole(file);
    DTRAIN_CHECK_INPUT(text.find('\0') == std::string::npos, file,
                       ": holds a NUL byte (binary data, not text)");
    const int64_t size = static_cast<int64_t>(text.size());
    if (!is_lines(file)) {
      done += size;
      if (!text.empty()) fn(file, std::move(text), done);
      continue;
    }
    size_t start = 0;
    int64_t line = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      ++line;
      const std::string_view row(text.data() + start, end - start);
      start = end + 1;
      if (row.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(row);
      } catch (const nlohmann::json::exception& e) {
        // The parser's own words name the fault (invalid UTF-8, a lone surrogate, a syntax
        // error) and its column.
        DTRAIN_CHECK_INPUT(false, file, ":", line, ": not valid JSON (", json_error_text(e.what()),
                           ")");
      }
      DTRAIN_CHECK_INPUT(record.is_object() && record.contains(source.json_field) &&
                             record[source.json_field].is_string(),
                         file, ":", line, ": no string field \"", source.json_field,
                         "\" (--json-field)");
      fn(concat(file, ":", line), record[source.json_field].get<std::string>(),
         done + static_cast<int64_t>(std::min(start, text.size())));
    }
    done += size;
  }
}

PrepareResult prepare_tokens(const PrepareOptions& options) {
  DTRAIN_CHECK_INPUT(options.format == "megatron" || options.format == "llmc",
                     "--format must be megatron or llmc, got '", options.format, "'");
  DTRAIN_CHECK_INPUT(!options.output.empty(), "--output is required (the shards' path prefix)");
  DTRAIN_CHECK_INPUT(options.shard_tokens >= 1, "--shard-tokens must be >= 1");
  const auto start = std::chrono::steady_clock::now();
  const tokenizer::BpeTokenizer tokenizer = tokenizer::BpeTokenizer::load(options.tokenizer);
  const int64_t eod = tokenizer.end_of_text();
  DTRAIN_CHECK_INPUT(!options.append_eod || eod >= 0, options.tokenizer,
                     " has no end-of-text token (<|endoftext|>, </s>, ...) to put between "
                     "documents: add one, or pass --no-eod");
  const fs::path parent = fs::path(options.output).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  PrepareResult result;
  int64_t total_bytes = 0;
  source_files(options.source, &total_bytes);
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::unique_ptr<tokenizer::BpeEncoder>> encoders;
  for (int t = 0; t < threads; ++t) {
    encoders.push_back(std::make_unique<tokenizer::BpeEncoder>(tokenizer));
  }
  std::unique_ptr<IndexedWriter> megatron;
  if (options.format == "megatron") {
    megatron =
        std::make_unique<IndexedWriter>(options.output, token_type_for(tokenizer.vocab_size()));
  }
  std::vector<int64_t> shard;
  const bool wide = tokenizer.vocab_size() > 65536;
  auto flush_shard = [&](bool last) {
    while (static_cast<int64_t>(shard.size()) >= options.shard_tokens || (last && !shard.empty())) {
      const int64_t n = std::min<int64_t>(options.shard_tokens, static_cast<int64_t>(shard.size()));
      char name[32];
      std::snprintf(name, sizeof(name), "_%06zu.bin", result.files.size());
      const std::string path = options.output + name;
      write_llmc_shard(path, shard.data(), n, wide);
      result.files.push_back(path);
      shard.erase(shard.begin(), shard.begin() + n);
    }
  };

  struct Document {
    std::string origin;
    std::string text;
    std::vector<int64_t> ids;
  };
  std::vector<Document> batch;
  int64_t batch_bytes = 0;
  int64_t bytes_done = 0;
  auto encode_batch = [&] {
    std::atomic<size_t> next{0};
    std::vector<std::thread> workers;
    std::vector<std::string> errors(threads);
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        for (size_t d = next++; d < batch.size(); d = next++) {
          try {
            encoders[t]->encode(batch[d].text, batch[d].ids);
          } catch (const InputError& e) {
            errors[t] = concat(batch[d].origin, ": ", e.message());
            next = batch.size();
          }
        }
      });
    }
    for (auto& w : workers) w.join();
    for (const auto& error : errors) DTRAIN_CHECK_INPUT(error.empty(), error);
    for (Document& doc : batch) {
      if (options.append_eod) doc.ids.push_back(eod);
      if (megatron) {
        megatron->add_document(doc.ids.data(), static_cast<int64_t>(doc.ids.size()));
      } else {
        shard.insert(shard.end(), doc.ids.begin(), doc.ids.end());
        flush_shard(false);
      }
      result.tokens += static_cast<int64_t>(doc.ids.size());
      ++result.documents;
    }
    batch.clear();
    batch_bytes = 0;
    if (options.progress) options.progress(bytes_done, total_bytes);
  };
  for_each_document(options.source, [&](const std::string& origin, std::string text, int64_t done) {
    batch_bytes += static_cast<int64_t>(text.size());
    result.bytes += static_cast<int64_t>(text.size());
    batch.push_back({origin, std::move(text), {}});
    bytes_done = done;
    if (batch_bytes >= (32 << 20)) encode_batch();
  });
  encode_batch();
  DTRAIN_CHECK_INPUT(result.documents > 0, "no documents in the input (every file is empty)");
  if (megatron) {
    megatron->finish();
    result.files = {options.output + ".bin", options.output + ".idx"};
  } else {
    flush_shard(true);
  }
  // The tokenizer beside the shards: `--dataset tokens:` finds it there (vocabulary, decoding).
  const fs::path beside = (parent.empty() ? fs::path(".") : parent) / "tokenizer.json";
  const std::string json = tokenizer.to_json();
  write_file_atomically(beside.string(), json.data(), json.size());
  result.files.push_back(beside.string());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace dtrain::data::tokens
