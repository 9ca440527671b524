// Token shards on disk, read through a memory mapping (nothing of the corpus is copied into
// memory) and written by `dtrain data prepare`. Two formats the field reads:
// - Megatron-LM's indexed data set: PREFIX.idx ("MMIDIDX\0\0", version 1, a dtype code, the
//   sequence lengths, byte offsets and document indices) beside PREFIX.bin (the tokens);
// - llm.c's shards: 256 int32 of header (magic 20240520 with uint16 tokens, version 1; magic
//   20240801 with uint32 tokens, version 7; the token count) and the tokens.
// A corpus is one or more such files; its documents are Megatron's sequences, and an llm.c
// shard (which keeps no boundaries) is one document.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::data::tokens {

/// A read-only memory mapping of a whole file (InputError naming it when it cannot be opened).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

/// Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType).
enum class TokenType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt16 = 8,
};
int token_type_size(TokenType type);
const char* token_type_name(TokenType type);
/// The smallest unsigned type that holds ids below `vocabulary` (Megatron's choice: uint16 up
/// to 65500, else int32).
TokenType token_type_for(int64_t vocabulary);

enum class ShardFormat { kMegatron, kLlmc };

/// The documents of one or more token files, memory-mapped.
class TokenCorpus {
 public:
  /// Each path: a Megatron prefix (PREFIX.idx + PREFIX.bin; PREFIX.idx or PREFIX.bin names
  /// the same pair), an llm.c shard, or a folder holding such files (all of them, by name).
  /// Every header is checked against its file's size; InputError naming the file and what is
  /// wrong.
  static TokenCorpus open(const std::vector<std::string>& paths);

  int64_t documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t document_length(int64_t document) const { return lengths_[document]; }
  const std::vector<int32_t>& document_lengths() const { return lengths_; }
  int64_t total_tokens() const { return total_tokens_; }
  /// Tokens [offset, offset + count) of a document, as int64, into `out`.
  void read(int64_t document, int64_t offset, int64_t count, int64_t* out) const;
  /// The largest token id and where it is (a full pass over the tokens at memory speed).
  struct MaxToken {
    int64_t id = -1;
    std::string file;
    int64_t position = 0;  ///< the token's index in its file
  };
  MaxToken max_token() const;
  /// The file holding a document (its .bin).
  const std::string& document_file(int64_t document) const {
    return files_[file_of_[document]].tokens->path();
  }
  /// The files read, for messages ("a.bin, b.bin").
  std::string origin() const;
  /// What identifies the contents for caches (paths, sizes, modification times).
  std::string fingerprint() const;

 private:
  struct File {
    std::shared_ptr<MappedFile> tokens;
    std::shared_ptr<MappedFile> index;  ///< Megatron's .idx; null for llm.c
    ShardFormat format = ShardFormat::kMegatron;
    TokenType type = TokenType::kUInt16;
    int64_t first_document = 0;
  };
  std::vector<File> files_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;  ///< byte offset of each document in its file's tokens
  std::vector<int32_t> file_of_;   ///< which file holds each document
  int64_t total_tokens_ = 0;
};

/// Writes a Megatron indexed data set (PREFIX.bin, PREFIX.idx), one document at a time; the
/// files appear complete at finish() (written beside, then renamed).
class IndexedWriter {
 public:
  IndexedWriter(std::string prefix, TokenType type);
  ~IndexedWriter();
  /// Appends one document (every id checked against the type's range).
  void add_document(const int64_t* tokens, int64_t count);
  void finish();
  int64_t documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  TokenType type_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  int64_t tokens_ = 0;
  std::vector<uint8_t> buffer_;
};

/// Writes an llm.c shard of `count` tokens (uint16 with magic 20240520 when `wide` is false,
/// uint32 with 20240801 otherwise).
void write_llmc_shard(const std::string& path, const int64_t* tokens, int64_t count, bool wide);

}  // namespace dtrain::data::tokens
