// safetensors read (memory-mapped, checked as the Rust crate checks: no holes, no overlaps,
// sizes that match the shapes, a header under 100 MB) and written (streamed to PATH.tmp, renamed).
#include "dtrain/nn/SafeTensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/Files.h"
#include "dtrain/common/Error.h"

namespace dtrain::nn {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The safetensors crate's limit on a header's size.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

int64_t SafeTensorInfo::numel() const { return product(shape); }

std::string safetensors_dtype(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  DTRAIN_THROW(InputError, "safetensors has no dtype for ", c10::toString(dtype));
}

struct SafeTensorsFile::Mapping {
  ~Mapping() {
    if (data != nullptr && size > 0) ::munmap(const_cast<uint8_t*>(data), size);
  }
  const uint8_t* data = nullptr;
  size_t size = 0;
};

SafeTensorsFile SafeTensorsFile::open(const std::string& path) {
  SafeTensorsFile file;
  file.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_INPUT(fd >= 0, "cannot read ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    DTRAIN_THROW(InputError, "cannot read ", path, ": ", std::strerror(errno));
  }
  file.mapping_ = std::make_shared<Mapping>();
  file.mapping_->size = static_cast<size_t>(st.st_size);
  if (st.st_size > 0) {
    void* at = ::mmap(nullptr, file.mapping_->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (at == MAP_FAILED) {
      ::close(fd);
      DTRAIN_THROW(InputError, "cannot map ", path, ": ", std::strerror(errno));
    }
    file.mapping_->data = static_cast<const uint8_t*>(at);
  }
  ::close(fd);
  const uint8_t* bytes = file.mapping_->data;
  const uint64_t size = file.mapping_->size;
  DTRAIN_CHECK_INPUT(size >= 8, path, ": not a safetensors file (", size,
                     " bytes, shorter than its header's length)");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes, 8);
  DTRAIN_CHECK_INPUT(header_bytes <= kMaxHeaderBytes, path, ": a header of ", header_bytes,
                     " bytes, over safetensors' limit of ", kMaxHeaderBytes,
                     " (not a safetensors file?)");
  DTRAIN_CHECK_INPUT(8 + header_bytes <= size, path, ": its header of ", header_bytes,
                     " bytes runs past the end of the file (", size, " bytes)");
  file.data_ = bytes + 8 + header_bytes;
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_bytes);
  } catch (const json::exception& e) {
    DTRAIN_THROW(InputError, path, ": the header is not JSON (", json_error_text(e.what()), ")");
  }
  DTRAIN_CHECK_INPUT(header.is_object(), path, ": the header is not a JSON object");
  const int64_t data_bytes = static_cast<int64_t>(size - 8 - header_bytes);
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      DTRAIN_CHECK_INPUT(entry.is_object(), path, ": __metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        DTRAIN_CHECK_INPUT(value.is_string(), path, ": __metadata__ '", key, "' is not a string");
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor '" + name + "'";
    DTRAIN_CHECK_INPUT(entry.is_object() && entry.contains("dtype") && entry["dtype"].is_string() &&
                           entry.contains("shape") && entry["shape"].is_array() &&
                           entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
                           entry["data_offsets"].size() == 2,
                       where, ": needs dtype, shape and data_offsets [begin, end]");
    SafeTensorInfo info;
    info.name = name;
    const std::string dtype = entry["dtype"].get<std::string>();
    bool known = false;
    for (const auto& d : kDtypes) {
      if (dtype == d.name) info.dtype = d.dtype, known = true;
    }
    DTRAIN_CHECK_INPUT(known, where, ": dtype ", dtype,
                       " is not one dtrain reads (F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
                       "BOOL)");
    for (const auto& d : entry["shape"]) {
      DTRAIN_CHECK_INPUT(d.is_number_integer() && d.get<int64_t>() >= 0, where,
                         ": the shape holds ", d.dump(), ", not a size");
      info.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = entry["data_offsets"];
    DTRAIN_CHECK_INPUT(offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(), where,
                       ": data_offsets ", offsets.dump(), " are not byte offsets");
    info.begin = offsets[0].get<int64_t>();
    info.end = offsets[1].get<int64_t>();
    DTRAIN_CHECK_INPUT(info.begin <= info.end && info.end <= data_bytes, where, ": data_offsets ",
                       offsets.dump(), " lie outside the ", data_bytes, " bytes of data");
    const int64_t expected = info.numel() * static_cast<int64_t>(c10::elementSize(info.dtype));
    DTRAIN_CHECK_INPUT(info.end - info.begin == expected, where, ": ", dtype, " of shape ",
                       entry["shape"].dump(), " is ", expected, " bytes, its data_offsets hold ",
                       info.end - info.begin);
    file.tensors_.push_back(std::move(info));
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
              return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
            });
  int64_t covered = 0;
  for (size_t i = 0; i < file.tensors_.size(); ++i) {
    const SafeTensorInfo& t = file.tensors_[i];
    DTRAIN_CHECK_INPUT(t.begin >= covered, path, ": tensor '", t.name, "' overlaps '",
                       file.tensors_[i - 1].name, "' (bytes ", t.begin, " to ", t.end, ")");
    DTRAIN_CHECK_INPUT(t.begin == covered, path, ": a hole of ", t.begin - covered,
                       " bytes before tensor '", t.name, "' (safetensors' data has none)");
    covered = t.end;
    file.index_[t.name] = i;
  }
  DTRAIN_CHECK_INPUT(covered == data_bytes, path, ": ", data_bytes - covered,
                     " bytes after the last tensor that no tensor names");
  return file;
}

std::vector<std::string> SafeTensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const SafeTensorInfo& SafeTensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  DTRAIN_CHECK_INPUT(it != index_.end(), path_, " holds no tensor '", name, "'");
  return tensors_[it->second];
}

at::Tensor SafeTensorsFile::get(const std::string& name) const {
  const SafeTensorInfo& t = info(name);
  at::Tensor out = at::empty(t.shape, at::TensorOptions(t.dtype));
  if (t.end > t.begin) {
    std::memcpy(out.data_ptr(), data_ + t.begin, static_cast<size_t>(t.end - t.begin));
  }
  return out;
}

at::Tensor SafeTensorsFile::slice(const std::string& name, int64_t dim, int64_t start,
                                  int64_t length) const {
  const SafeTensorInfo& t = info(name);
  const int64_t rank = static_cast<int64_t>(t.shape.size());
  DTRAIN_CHECK_INPUT(
      dim >= 0 && dim < rank && start >= 0 && length >= 0 && start + length <= t.shape[dim], path_,
      ": tensor '", name, "' of shape ", at::IntArrayRef(t.shape), " has no rows [", start, ", ",
      start + length, ") along dimension ", dim);
  std::vector<int64_t> shape = t.shape;
  shape[dim] = length;
  at::Tensor out = at::empty(shape, at::TensorOptions(t.dtype));
  const uint8_t* base = data_ + t.begin;
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= t.shape[d];
  int64_t inner = static_cast<int64_t>(c10::elementSize(t.dtype));
  for (int64_t d = dim + 1; d < rank; ++d) inner *= t.shape[d];
  auto* to = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(to + o * length * inner, base + (o * t.shape[dim] + start) * inner,
                static_cast<size_t>(length * inner));
  }
  return out;
}

SafeTensorsSet SafeTensorsSet::open(const std::string& path) {
  SafeTensorsSet set;
  set.origin_ = path;
  std::error_code error;
  if (!fs::is_directory(path, error)) {
    set.files_.push_back(SafeTensorsFile::open(path));
  } else if (fs::exists(fs::path(path) / "model.safetensors.index.json", error)) {
    const std::string index_path = (fs::path(path) / "model.safetensors.index.json").string();
    std::ifstream in(index_path);
    json index;
    try {
      index = json::parse(in);
    } catch (const json::exception& e) {
      DTRAIN_THROW(InputError, index_path, ": not JSON (", json_error_text(e.what()), ")");
    }
    DTRAIN_CHECK_INPUT(
        index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
        index_path, ": has no weight_map");
    std::map<std::string, size_t> file_number;
    for (const auto& [name, file] : index["weight_map"].items()) {
      DTRAIN_CHECK_INPUT(file.is_string(), index_path, ": weight_map['", name,
                         "'] is not a file name");
      const std::string shard = file.get<std::string>();
      if (!file_number.count(shard)) {
        file_number[shard] = set.files_.size();
        set.files_.push_back(SafeTensorsFile::open((fs::path(path) / shard).string()));
      }
      const SafeTensorsFile& holder = set.files_[file_number[shard]];
      DTRAIN_CHECK_INPUT(holder.contains(name), index_path, " places tensor '", name, "' in ",
                         shard, ", which does not hold it");
      set.where_[name] = file_number[shard];
    }
    for (const auto& file : set.files_) {
      for (const auto& name : file.names()) {
        DTRAIN_CHECK_INPUT(set.where_.count(name), file.path(), " holds tensor '", name,
                           "', which ", index_path, " does not list");
      }
    }
    return set;
  } else {
    const fs::path single = fs::path(path) / "model.safetensors";
    DTRAIN_CHECK_INPUT(fs::exists(single, error), path,
                       " holds neither model.safetensors nor model.safetensors.index.json");
    set.files_.push_back(SafeTensorsFile::open(single.string()));
  }
  for (const auto& name : set.files_[0].names()) set.where_[name] = 0;
  return set;
}

std::vector<std::string> SafeTensorsSet::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

const SafeTensorsFile& SafeTensorsSet::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  DTRAIN_CHECK_INPUT(it != where_.end(), origin_, " holds no tensor '", name, "'");
  return files_[it->second];
}

const SafeTensorInfo& SafeTensorsSet::info(const std::string& name) const {
  return file_of(name).info(name);
}

at::Tensor SafeTensorsSet::get(const std::string& name) const { return file_of(name).get(name); }

at::Tensor SafeTensorsSet::slice(const std::string& name, int64_t dim, int64_t start,
                                 int64_t length) const {
  return file_of(name).slice(name, dim, start, length);
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  std::vector<at::Tensor> contiguous;
  for (const auto& [name, tensor] : tensors) {
    DTRAIN_CHECK_INPUT(!header.contains(name), path, ": tensor '", name, "' given twice");
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    header[name] = {{"dtype", safetensors_dtype(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    DTRAIN_CHECK_INPUT(out.good(), "cannot write ", temporary);
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const at::Tensor& t : contiguous) {
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
    }
    out.flush();
    DTRAIN_CHECK_INPUT(out.good(), "writing ", temporary, " failed (disk full?)");
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  DTRAIN_CHECK_INPUT(!error, "cannot rename ", temporary, " to ", path, ": ", error.message());
}

std::vector<std::string> save_safetensors_folder(
    const std::string& folder, const NamedTensors& tensors, int64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata) {
  DTRAIN_CHECK_INPUT(max_shard_bytes > 0, "the shard size must be > 0");
  fs::create_directories(folder);
  std::vector<NamedTensors> shards(1);
  int64_t in_shard = 0;
  int64_t total = 0;
  for (const auto& named : tensors) {
    const int64_t bytes = named.second.numel() * static_cast<int64_t>(named.second.element_size());
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(named);
    in_shard += bytes;
    total += bytes;
  }
  std::vector<std::string> written;
  if (shards.size() == 1) {
    written.push_back((fs::path(folder) / "model.safetensors").string());
    save_safetensors(written.back(), tensors, metadata);
    return written;
  }
  json weight_map = json::object();
  char name[64];
  for (size_t k = 0; k < shards.size(); ++k) {
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    written.push_back((fs::path(folder) / name).string());
    save_safetensors(written.back(), shards[k], metadata);
    for (const auto& named : shards[k]) weight_map[named.first] = name;
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  const std::string index_path = (fs::path(folder) / "model.safetensors.index.json").string();
  write_file_atomically(index_path, text.data(), text.size());
  written.push_back(index_path);
  return written;
}

}  // namespace dtrain::nn
