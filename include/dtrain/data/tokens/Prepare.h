// `dtrain data prepare` and `dtrain data tokenizer train`: text (files, folders, JSON Lines)
// read as documents, tokenized on every core, written as token shards in a deterministic order
// (the same output for any number of threads).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain::data::tokens {

struct TextSource {
  /// Files and folders. A folder: its text files, recursively, by name (.txt, .md, .rst, .html,
  /// .htm, .text, .jsonl, .ndjson, and files without an extension). A .jsonl/.ndjson file: one
  /// document per line (its `json_field`); any other file: one document.
  std::vector<std::string> inputs;
  std::string json_field = "text";
};

/// The files a source reads, in order, and their total size.
std::vector<std::string> source_files(const TextSource& source, int64_t* total_bytes);

/// Calls `fn(origin, text)` for each document ("FILE" or "FILE:LINE"), with the bytes read so
/// far. InputError naming the file (and line) for what cannot be read.
void for_each_document(const TextSource& source,
                       const std::function<void(const std::string&, std::string, int64_t)>& fn);

struct PrepareOptions {
  TextSource source;
  /// A tokenizer.json (or a folder holding one).
  std::string tokenizer;
  /// Megatron: PREFIX.bin + PREFIX.idx; llm.c: PREFIX_000000.bin, PREFIX_000001.bin, ...
  std::string output;
  std::string format = "megatron";  ///< or "llmc"
  /// llm.c: tokens per shard.
  int64_t shard_tokens = 100000000;
  /// The tokenizer's end-of-text token after every document (Megatron's --append-eod).
  bool append_eod = true;
  int threads = 0;  ///< 0: every core
  std::function<void(int64_t bytes_done, int64_t bytes_total)> progress;
};

struct PrepareResult {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;
  double seconds = 0;
  std::vector<std::string> files;  ///< what was written
};

PrepareResult prepare_tokens(const PrepareOptions& options);

}  // namespace dtrain::data::tokens
