// Megatron's indexed format and llm.c's shards: parsing with every field checked against the
// file's size before any pointer into the mapping is taken, and writing.
#include "dtrain/data/tokens/TokenFiles.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/Files.h"
#include "dtrain/common/Error.h"

namespace dtrain::data::tokens {

namespace fs = std::filesystem;

namespace {

constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeader = 9 + 8 + 1 + 8 + 8;
constexpr int32_t kLlmcMagic16 = 20240520;
constexpr int32_t kLlmcMagic32 = 20240801;
constexpr int64_t kLlmcHeader = 256 * 4;

template <typename T>
T read_at(const uint8_t* base, int64_t offset) {
  T value;
  std::memcpy(&value, base + offset, sizeof(T));
  return value;
}

bool valid_type(uint8_t code) { return (code >= 1 && code <= 5) || code == 8; }

// Token `i` of a typed array, as int64.
inline int64_t token_at(const uint8_t* base, TokenType type, int64_t i) {
  switch (type) {
    case TokenType::kUInt8:
      return base[i];
    case TokenType::kInt8:
      return reinterpret_cast<const int8_t*>(base)[i];
    case TokenType::kInt16:
      return read_at<int16_t>(base, i * 2);
    case TokenType::kInt32:
      return read_at<int32_t>(base, i * 4);
    case TokenType::kInt64:
      return read_at<int64_t>(base, i * 8);
    case TokenType::kUInt16:
      return read_at<uint16_t>(base, i * 2);
  }
  return 0;
}

template <typename T>
int64_t max_of(const uint8_t* base, int64_t count, int64_t* where) {
  const T* p = reinterpret_cast<const T*>(base);
  T best = count > 0 ? p[0] : T(0);
  for (int64_t i = 1; i < count; ++i) best = std::max(best, p[i]);
  for (int64_t i = 0; i < count; ++i) {
    if (p[i] == best) {
      *where = i;
      break;
    }
  }
  return static_cast<int64_t>(best);
}

std::string strip_suffix(const std::string& path) {
  for (const char* suffix : {".idx", ".bin"}) {
    const size_t n = std::strlen(suffix);
    if (path.size() > n && path.compare(path.size() - n, n, suffix) == 0) {
      return path.substr(0, path.size() - n);
    }
  }
  return path;
}

bool is_file(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(path, error);
}

// The token files a path names: a folder's llm.c shards and Megatron prefixes (by name), or the
// path itself.
std::vector<std::string> expand(const std::string& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return {path};
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(path, error)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().string();
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".bin") == 0) found.push_back(name);
  }
  std::sort(found.begin(), found.end());
  DTRAIN_CHECK_INPUT(!found.empty(), "tokens: ", path,
                     " holds no token files (Megatron .bin/.idx pairs or llm.c .bin shards)");
  return found;
}

}  // namespace

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_INPUT(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    DTRAIN_CHECK_INPUT(false, path, " is not a regular file");
  }
  size_ = info.st_size;
  if (size_ > 0) {
    void* mapped = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
    const int mmap_errno = errno;
    ::close(fd);
    DTRAIN_CHECK_INPUT(mapped != MAP_FAILED, "cannot map ", path, ": ", std::strerror(mmap_errno));
    data_ = static_cast<const uint8_t*>(mapped);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
}

int token_type_size(TokenType type) {
  switch (type) {
    case TokenType::kUInt8:
    case TokenType::kInt8:
      return 1;
    case TokenType::kInt16:
    case TokenType::kUInt16:
      return 2;
    case TokenType::kInt32:
      return 4;
    case TokenType::kInt64:
      return 8;
  }
  return 0;
}

const char* token_type_name(TokenType type) {
  switch (type) {
    case TokenType::kUInt8:
      return "uint8";
    case TokenType::kInt8:
      return "int8";
    case TokenType::kInt16:
      return "int16";
    case TokenType::kInt32:
      return "int32";
    case TokenType::kInt64:
      return "int64";
    case TokenType::kUInt16:
      return "uint16";
  }
  return "?";
}

TokenType token_type_for(int64_t vocabulary) {
  return vocabulary <= 65500 ? TokenType::kUInt16 : TokenType::kInt32;
}

TokenCorpus TokenCorpus::open(const std::vector<std::string>& paths) {
  DTRAIN_CHECK_INPUT(!paths.empty(), "tokens: no token files given");
  TokenCorpus corpus;
  std::vector<std::string> files;
  for (const auto& path : paths) {
    for (auto& file : expand(path)) files.push_back(std::move(file));
  }
  for (const std::string& given : files) {
    const std::string prefix = strip_suffix(given);
    File file;
    file.first_document = corpus.documents();
    const bool megatron = is_file(prefix + ".idx");
    if (megatron) {
      DTRAIN_CHECK_INPUT(is_file(prefix + ".bin"), prefix, ".idx has no ", prefix,
                         ".bin beside it (a Megatron data set is the pair)");
      file.index = std::make_shared<MappedFile>(prefix + ".idx");
      file.tokens = std::make_shared<MappedFile>(prefix + ".bin");
      const MappedFile& idx = *file.index;
      const std::string& name = idx.path();
      DTRAIN_CHECK_INPUT(idx.size() >= kMegatronHeader, name, ": truncated (", idx.size(),
                         " bytes, a Megatron index header is ", kMegatronHeader, ")");
      DTRAIN_CHECK_INPUT(std::memcmp(idx.data(), kMegatronMagic, 9) == 0, name,
                         ": not a Megatron index (its magic is not MMIDIDX)");
      const uint64_t version = read_at<uint64_t>(idx.data(), 9);
      DTRAIN_CHECK_INPUT(version == 1, name, ": index version ", version,
                         " (dtrain reads version 1)");
      const uint8_t code = idx.data()[17];
      DTRAIN_CHECK_INPUT(valid_type(code), name, ": unknown dtype code ", int(code),
                         " (token files hold integer ids: codes 1-5 and 8)");
      file.type = static_cast<TokenType>(code);
      const uint64_t sequences = read_at<uint64_t>(idx.data(), 18);
      const uint64_t documents = read_at<uint64_t>(idx.data(), 26);
      const uint64_t arrays = kMegatronHeader + sequences * (4 + 8) + documents * 8;
      DTRAIN_CHECK_INPUT(sequences < (1ULL << 40) && documents < (1ULL << 40) &&
                             static_cast<int64_t>(arrays) <= idx.size(),
                         name, ": truncated (", sequences, " sequences and ", documents,
                         " document indices need ", arrays, " bytes, the file has ", idx.size(),
                         ")");
      const uint8_t* lengths = idx.data() + kMegatronHeader;
      const uint8_t* pointers = lengths + sequences * 4;
      const int size = token_type_size(file.type);
      const int64_t bin_size = file.tokens->size();
      int64_t expected = 0;
      for (uint64_t s = 0; s < sequences; ++s) {
        const int32_t length = read_at<int32_t>(lengths, static_cast<int64_t>(s) * 4);
        const int64_t pointer = read_at<int64_t>(pointers, static_cast<int64_t>(s) * 8);
        DTRAIN_CHECK_INPUT(length >= 0 && pointer == expected, name, ": sequence ", s,
                           " has length ", length, " at byte ", pointer, " (expected byte ",
                           expected, "): the index is corrupt");
        expected += static_cast<int64_t>(length) * size;
        DTRAIN_CHECK_INPUT(expected <= bin_size, name, " and ", file.tokens->path(),
                           " disagree: the index needs ", expected, " bytes by sequence ", s,
                           ", the .bin has ", bin_size, " (truncated, or another data set's)");
        corpus.lengths_.push_back(length);
        corpus.pointers_.push_back(pointer);
        corpus.total_tokens_ += length;
      }
      DTRAIN_CHECK_INPUT(expected == bin_size, name, " and ", file.tokens->path(),
                         " disagree: the index covers ", expected, " bytes, the .bin has ",
                         bin_size);
    } else {
      DTRAIN_CHECK_INPUT(is_file(given), "tokens: ", given,
                         " is neither an llm.c shard nor a Megatron prefix (no ", prefix, ".idx)");
      file.tokens = std::make_shared<MappedFile>(given);
      file.format = ShardFormat::kLlmc;
      const MappedFile& bin = *file.tokens;
      DTRAIN_CHECK_INPUT(bin.size() >= kLlmcHeader, given, ": truncated (", bin.size(),
                         " bytes, an llm.c header is 1024)");
      const int32_t magic = read_at<int32_t>(bin.data(), 0);
      const int32_t version = read_at<int32_t>(bin.data(), 4);
      const int32_t count = read_at<int32_t>(bin.data(), 8);
      DTRAIN_CHECK_INPUT(magic == kLlmcMagic16 || magic == kLlmcMagic32, given,
                         ": not a token shard (magic ", magic, "; llm.c's are ", kLlmcMagic16,
                         " and ", kLlmcMagic32, ", and no ", prefix, ".idx for Megatron's)");
      const bool wide = magic == kLlmcMagic32;
      DTRAIN_CHECK_INPUT(version == (wide ? 7 : 1), given, ": llm.c shard version ", version,
                         " with magic ", magic, " (dtrain reads version ", wide ? 7 : 1, ")");
      file.type = wide ? TokenType::kInt32 : TokenType::kUInt16;
      const int64_t need = kLlmcHeader + static_cast<int64_t>(count) * (wide ? 4 : 2);
      DTRAIN_CHECK_INPUT(count >= 0 && need == bin.size(), given, ": the header says ", count,
                         " tokens (", need, " bytes), the file has ", bin.size(),
                         need > bin.size() ? " (truncated)" : "");
      corpus.lengths_.push_back(count);
      corpus.pointers_.push_back(kLlmcHeader);
      corpus.total_tokens_ += count;
    }
    corpus.file_of_.resize(corpus.lengths_.size(), static_cast<int32_t>(corpus.files_.size()));
    corpus.files_.push_back(std::move(file));
  }
  DTRAIN_CHECK_INPUT(corpus.total_tokens_ > 0, "tokens: ", corpus.origin(), " hold no tokens");
  return corpus;
}

void TokenCorpus::read(int64_t document, int64_t offset, int64_t count, int64_t* out) const {
  const File& file = files_[file_of_[document]];
  const uint8_t* base = file.tokens->data() + pointers_[document];
  const int size = token_type_size(file.type);
  base += offset * size;
  // llm.c's uint32 ids are read as int32: ids stay below 2^31 (the vocabulary check refuses
  // the rest).
  switch (file.type) {
    case TokenType::kUInt16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < count; ++i) out[i] = p[i];
      return;
    }
    case TokenType::kInt32: {
      const int32_t* p = reinterpret_cast<const int32_t*>(base);
      for (int64_t i = 0; i < count; ++i) out[i] = p[i];
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) out[i] = token_at(base, file.type, i);
  }
}

TokenCorpus::MaxToken TokenCorpus::max_token() const {
  MaxToken best;
  for (const File& file : files_) {
    const int64_t header = file.format == ShardFormat::kLlmc ? kLlmcHeader : 0;
    const uint8_t* base = file.tokens->data() + header;
    const int64_t count = (file.tokens->size() - header) / token_type_size(file.type);
    int64_t where = 0;
    int64_t id = 0;
    switch (file.type) {
      case TokenType::kUInt8:
        id = max_of<uint8_t>(base, count, &where);
        break;
      case TokenType::kInt8:
        id = max_of<int8_t>(base, count, &where);
        break;
      case TokenType::kInt16:
        id = max_of<int16_t>(base, count, &where);
        break;
      case TokenType::kUInt16:
        id = max_of<uint16_t>(base, count, &where);
        break;
      case TokenType::kInt32:
        id = max_of<int32_t>(base, count, &where);
        break;
      case TokenType::kInt64:
        id = max_of<int64_t>(base, count, &where);
        break;
    }
    if (count > 0 && id > best.id) best = {id, file.tokens->path(), where};
  }
  return best;
}

std::string TokenCorpus::origin() const {
  std::string out;
  for (const File& file : files_) {
    if (!out.empty()) out += ", ";
    out += file.tokens->path();
  }
  return out;
}

std::string TokenCorpus::fingerprint() const {
  std::string out;
  for (const File& file : files_) {
    for (const auto& mapped : {file.index, file.tokens}) {
      if (!mapped) continue;
      struct stat info {};
      ::stat(mapped->path().c_str(), &info);
      out += concat(fs::absolute(mapped->path()).string(), ":", mapped->size(), ":",
                    static_cast<int64_t>(info.st_mtim.tv_sec), ".", info.st_mtim.tv_nsec, ";");
    }
  }
  return out;
}

IndexedWriter::IndexedWriter(std::string prefix, TokenType type)
    : prefix_(std::move(prefix)), type_(type) {
  const std::string path = prefix_ + ".bin.tmp";
  bin_ = std::fopen(path.c_str(), "wb");
  DTRAIN_CHECK_INPUT(bin_ != nullptr, "cannot write ", path, ": ", std::strerror(errno));
}

IndexedWriter::~IndexedWriter() {
  if (bin_ != nullptr) {
    std::fclose(bin_);
    std::remove((prefix_ + ".bin.tmp").c_str());
  }
}

void IndexedWriter::add_document(const int64_t* tokens, int64_t count) {
  DTRAIN_CHECK(bin_ != nullptr, "IndexedWriter: add_document after finish");
  DTRAIN_CHECK_INPUT(count < (int64_t{1} << 31), "a document of ", count,
                     " tokens is longer than Megatron's int32 sequence lengths allow");
  const int size = token_type_size(type_);
  int64_t low = 0;
  int64_t high = 0;
  switch (type_) {
    case TokenType::kUInt8:
      high = 255;
      break;
    case TokenType::kInt8:
      low = -128, high = 127;
      break;
    case TokenType::kInt16:
      low = -32768, high = 32767;
      break;
    case TokenType::kUInt16:
      high = 65535;
      break;
    case TokenType::kInt32:
      low = INT32_MIN, high = INT32_MAX;
      break;
    case TokenType::kInt64:
      low = INT64_MIN, high = INT64_MAX;
      break;
  }
  buffer_.resize(static_cast<size_t>(count) * size);
  for (int64_t i = 0; i < count; ++i) {
    DTRAIN_CHECK_INPUT(tokens[i] >= low && tokens[i] <= high, "token id ", tokens[i],
                       " does not fit ", token_type_name(type_), " (", prefix_, ".bin)");
    switch (type_) {
      case TokenType::kUInt8:
      case TokenType::kInt8:
        buffer_[i] = static_cast<uint8_t>(tokens[i]);
        break;
      case TokenType::kInt16:
      case TokenType::kUInt16: {
        const uint16_t v = static_cast<uint16_t>(tokens[i]);
        std::memcpy(&buffer_[i * 2], &v, 2);
        break;
      }
      case TokenType::kInt32: {
        const int32_t v = static_cast<int32_t>(tokens[i]);
        std::memcpy(&buffer_[i * 4], &v, 4);
        break;
      }
      case TokenType::kInt64:
        std::memcpy(&buffer_[i * 8], &tokens[i], 8);
        break;
    }
  }
  DTRAIN_CHECK_INPUT(std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) == buffer_.size(),
                     "cannot write ", prefix_, ".bin.tmp (disk full?)");
  lengths_.push_back(static_cast<int32_t>(count));
  tokens_ += count;
}

void IndexedWriter::finish() {
  DTRAIN_CHECK(bin_ != nullptr, "IndexedWriter: finish twice");
  const bool flushed = std::fflush(bin_) == 0 && ::fsync(fileno(bin_)) == 0;
  std::fclose(bin_);
  bin_ = nullptr;
  DTRAIN_CHECK_INPUT(flushed, "cannot write ", prefix_, ".bin.tmp (disk full?)");
  const uint64_t sequences = lengths_.size();
  std::string idx(kMegatronMagic, 9);
  auto put = [&idx](const void* value, size_t size) {
    idx.append(static_cast<const char*>(value), size);
  };
  const uint64_t version = 1;
  put(&version, 8);
  const uint8_t code = static_cast<uint8_t>(type_);
  put(&code, 1);
  put(&sequences, 8);
  const uint64_t document_count = sequences + 1;
  put(&document_count, 8);
  put(lengths_.data(), lengths_.size() * 4);
  int64_t pointer = 0;
  for (int32_t length : lengths_) {
    put(&pointer, 8);
    pointer += static_cast<int64_t>(length) * token_type_size(type_);
  }
  for (int64_t d = 0; d <= static_cast<int64_t>(sequences); ++d) put(&d, 8);
  std::error_code error;
  fs::rename(prefix_ + ".bin.tmp", prefix_ + ".bin", error);
  DTRAIN_CHECK_INPUT(!error, "cannot rename ", prefix_, ".bin.tmp: ", error.message());
  write_file_atomically(prefix_ + ".idx", idx.data(), idx.size());
}

void write_llmc_shard(const std::string& path, const int64_t* tokens, int64_t count, bool wide) {
  DTRAIN_CHECK_INPUT(count < (int64_t{1} << 31), "an llm.c shard holds under 2^31 tokens, got ",
                     count);
  std::string out(kLlmcHeader, '\0');
  const int32_t header[3] = {wide ? kLlmcMagic32 : kLlmcMagic16, wide ? 7 : 1,
                             static_cast<int32_t>(count)};
  std::memcpy(out.data(), header, sizeof(header));
  const int64_t limit = wide ? INT32_MAX : 65535;
  out.reserve(kLlmcHeader + count * (wide ? 4 : 2));
  for (int64_t i = 0; i < count; ++i) {
    DTRAIN_CHECK_INPUT(tokens[i] >= 0 && tokens[i] <= limit, "token id ", tokens[i],
                       " does not fit an llm.c ", wide ? "uint32" : "uint16", " shard (", path,
                       ")");
    if (wide) {
      const uint32_t v = static_cast<uint32_t>(tokens[i]);
      out.append(reinterpret_cast<const char*>(&v), 4);
    } else {
      const uint16_t v = static_cast<uint16_t>(tokens[i]);
      out.append(reinterpret_cast<const char*>(&v), 2);
    }
  }
  write_file_atomically(path, out.data(), out.size());
}

}  // namespace dtrain::data::tokens
