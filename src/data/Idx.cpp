// IDX parsing over zlib's gz* API (which also reads uncompressed files transparently). A core
// build on a machine without zlib (scripts/gpu-check's) reads uncompressed files only.
#include "dtrain/data/Idx.h"

#include <ATen/ATen.h>
#if DTRAIN_HAVE_ZLIB
#include <zlib.h>
#endif

#include <sys/stat.h>
#include <cstdio>
#include <memory>

#include "dtrain/common/Error.h"

namespace dtrain::data {

namespace {

#if !DTRAIN_HAVE_ZLIB
// The few gz* calls below over plain stdio; a gzip file is refused by name.
struct gzFile_s {
  std::FILE* file;
};
using gzFile = gzFile_s*;
gzFile gzopen(const char* path, const char* mode) {
  std::FILE* file = std::fopen(path, mode);
  if (file == nullptr) return nullptr;
  unsigned char magic[2] = {0, 0};
  const bool gzip = std::fread(magic, 1, 2, file) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  std::fclose(file);
  DTRAIN_CHECK_INPUT(!gzip, path,
                     " is gzip-compressed, and this dtrain was built without zlib: gunzip it");
  return new gzFile_s{std::fopen(path, mode)};
}
int gzread(gzFile f, void* into, unsigned n) {
  const size_t got = std::fread(into, 1, n, f->file);
  return got == 0 && std::ferror(f->file) ? -1 : static_cast<int>(got);
}
const char* gzerror(gzFile, int*) { return "read error"; }
int gzdirect(gzFile) { return 1; }
void gzclose(gzFile f) {
  std::fclose(f->file);
  delete f;
}
#endif

struct GzCloser {
  void operator()(gzFile file) const { gzclose(file); }
};

int64_t read_bytes(gzFile file, void* into, int64_t count, const std::string& path) {
  auto* out = static_cast<char*>(into);
  int64_t done = 0;
  while (done < count) {
    const unsigned chunk = static_cast<unsigned>(std::min<int64_t>(count - done, 1 << 30));
    const int got = gzread(file, out + done, chunk);
    if (got < 0) {
      int code = 0;
      const char* message = gzerror(file, &code);
      DTRAIN_THROW(InputError, path, ": corrupt data at byte ", done, ": ", message);
    }
    if (got == 0) break;
    done += got;
  }
  return done;
}

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
}

}  // namespace

at::Tensor read_idx(const std::string& path, int expected_dims) {
  struct stat info {};
  DTRAIN_CHECK_INPUT(::stat(path.c_str(), &info) == 0, path, ": file not found");
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  DTRAIN_CHECK_INPUT(file != nullptr, path, ": cannot open");

  unsigned char magic[4];
  DTRAIN_CHECK_INPUT(read_bytes(file.get(), magic, 4, path) == 4, path,
                     ": truncated: shorter than the 4-byte IDX magic number");
  DTRAIN_CHECK_INPUT(magic[0] == 0 && magic[1] == 0, path,
                     ": not an IDX file (magic number must start with two zero bytes, found 0x",
                     std::hex, int(magic[0]), " 0x", int(magic[1]), ")");
  DTRAIN_CHECK_INPUT(magic[2] == 0x08, path, ": IDX element type 0x", std::hex, int(magic[2]),
                     " is not unsigned byte (0x08)");
  const int dims = magic[3];
  DTRAIN_CHECK_INPUT(dims == expected_dims, path, ": IDX file has ", dims, " dimensions, expected ",
                     expected_dims);

  std::vector<int64_t> sizes(dims);
  int64_t total = 1;
  for (int d = 0; d < dims; ++d) {
    unsigned char raw[4];
    DTRAIN_CHECK_INPUT(read_bytes(file.get(), raw, 4, path) == 4, path,
                       ": truncated header: dimension ", d, " missing (byte offset ", 4 + 4 * d,
                       ")");
    sizes[d] = big_endian(raw);
    DTRAIN_CHECK_INPUT(sizes[d] > 0 && sizes[d] < (1 << 28), path, ": dimension ", d,
                       " has implausible size ", sizes[d]);
    DTRAIN_CHECK_INPUT(!__builtin_mul_overflow(total, sizes[d], &total), path,
                       ": the header's dimensions multiply to more than 2^63 bytes");
  }
  const int64_t header = 4 + 4 * dims;
  // Bound the allocation by what the file can hold before making it: an uncompressed file holds
  // exactly its size less the header; deflate expands at most 1032:1.
  const bool gzipped = gzdirect(file.get()) == 0;
  const int64_t file_bytes = static_cast<int64_t>(info.st_size);
  const int64_t capacity = gzipped ? file_bytes * 1032 : file_bytes - header;
  DTRAIN_CHECK_INPUT(total <= capacity, path, ": the header (dimensions ", c10::IntArrayRef(sizes),
                     ") promises ", total, " data bytes after byte offset ", header,
                     ", more than this ", file_bytes, "-byte", gzipped ? " gzip" : "",
                     " file can hold");
  at::Tensor data = at::empty(sizes, at::kByte);
  const int64_t got = read_bytes(file.get(), data.data_ptr(), total, path);
  DTRAIN_CHECK_INPUT(got == total, path, ": truncated: header promises ", total,
                     " data bytes after byte offset ", header, ", file has ", got);
  unsigned char extra;
  DTRAIN_CHECK_INPUT(read_bytes(file.get(), &extra, 1, path) == 0, path,
                     ": trailing data after the ", total, " bytes the header describes");
  return data;
}

}  // namespace dtrain::data
