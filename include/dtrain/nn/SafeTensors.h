// safetensors, the weight format of Hugging Face and much of the Python world: an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data. Read memory-mapped (a tensor, or one block of it, is copied out
// without reading the rest of the file), checked strictly (a header that lies about offsets,
// sizes or dtypes is refused naming the tensor); written atomically, one file or sharded with
// Hugging Face's model.safetensors.index.json.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::nn {

struct SafeTensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  /// Byte range in the data section (after the header).
  int64_t begin = 0;
  int64_t end = 0;
  int64_t numel() const;
};

/// One safetensors file, memory-mapped. open() checks the whole header against the file:
/// InputError naming the file, and the tensor where one is at fault.
class SafeTensorsFile {
 public:
  static SafeTensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  /// In the file's order (by offset).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  /// InputError naming the tensor and the file when it is not there.
  const SafeTensorInfo& info(const std::string& name) const;
  /// A copy of the tensor (CPU, its own dtype).
  at::Tensor get(const std::string& name) const;
  /// Rows [start, start + length) of dimension `dim`: only those bytes are read (a tensor-parallel
  /// rank's block, a ZeRO shard's slice).
  at::Tensor slice(const std::string& name, int64_t dim, int64_t start, int64_t length) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // the data section, in mapping_
  std::vector<SafeTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// A model's weights as Hugging Face saves them: a .safetensors file, or a folder holding
/// model.safetensors or model.safetensors.index.json and its shards. A name is looked up in the
/// file that holds it.
class SafeTensorsSet {
 public:
  static SafeTensorsSet open(const std::string& path);
  /// Sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  const SafeTensorInfo& info(const std::string& name) const;
  at::Tensor get(const std::string& name) const;
  at::Tensor slice(const std::string& name, int64_t dim, int64_t start, int64_t length) const;
  /// Where the weights were read from (for messages).
  const std::string& origin() const { return origin_; }

 private:
  const SafeTensorsFile& file_of(const std::string& name) const;
  std::string origin_;
  std::vector<SafeTensorsFile> files_;
  std::map<std::string, size_t> where_;
};

/// Named tensors, in the order they are written.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes one file (atomically: PATH.tmp, then renamed). Tensors are written contiguous and
/// little-endian in their own dtype; `metadata` goes in the header's __metadata__.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Writes `folder`/model.safetensors, or, when the tensors exceed `max_shard_bytes`,
/// model-0000K-of-0000N.safetensors shards and model.safetensors.index.json (Hugging Face's
/// layout: {"metadata": {"total_size": ...}, "weight_map": {name: file}}). Returns the files.
std::vector<std::string> save_safetensors_folder(
    const std::string& folder, const NamedTensors& tensors, int64_t max_shard_bytes = 5LL << 30,
    const std::map<std::string, std::string>& metadata = {});

/// "F32", "BF16", ...: safetensors' name of a dtype (InputError for one it has none for).
std::string safetensors_dtype(at::ScalarType dtype);

}  // namespace dtrain::nn
