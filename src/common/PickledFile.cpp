#include "common/PickledFile.h"

#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "common/Files.h"
#include "dtrain/common/Error.h"

namespace dtrain {

namespace {

thread_local StagedFiles* staging = nullptr;

void create_parent(const std::string& path) {
  const auto directory = std::filesystem::path(path).parent_path();
  if (!directory.empty()) std::filesystem::create_directories(directory);
}

void write_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict) {
  const std::vector<char> bytes = torch::pickle_save(dict);
  create_parent(path);
  write_file_atomically(path, bytes.data(), bytes.size());
}

void write_tensor_file(const std::string& path, const at::Tensor& tensor) {
  create_parent(path);
  try {
    torch::save(tensor, path);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, "cannot write ", path, ": ", e.what_without_backtrace());
  }
}

// `value` with every tensor in it copied to host memory (pinned when it lives on a GPU, so the
// copy is a DMA) and everything else rebuilt around the copies: what the caller holds may change
// the moment it gets control back. Adds the tensors' bytes to `*bytes`.
c10::IValue own(const c10::IValue& value, int64_t* bytes) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (!t.defined()) return value;
    at::Tensor copy;
    if (t.is_cpu()) {
      copy = t.clone();
    } else {
      copy = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
      copy.copy_(t);
    }
    *bytes += static_cast<int64_t>(copy.numel() * copy.element_size());
    return copy;
  }
  if (value.isGenericDict()) {
    const c10::impl::GenericDict dict = value.toGenericDict();
    c10::impl::GenericDict copy(dict.keyType(), dict.valueType());
    for (const auto& item : dict) copy.insert(item.key(), own(item.value(), bytes));
    return copy;
  }
  if (value.isList()) {
    const c10::List<c10::IValue> list = value.toList();
    c10::impl::GenericList copy(list.elementType());
    for (const c10::IValue& element : list) copy.push_back(own(element, bytes));
    return copy;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      elements.push_back(own(element, bytes));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return value;  // strings, numbers: immutable
}

}  // namespace

void StagedFiles::add(const std::string& path, const c10::IValue& value, bool tensor_file) {
  files_.push_back({path, own(value, &bytes_), tensor_file});
}

void StagedFiles::write() {
  for (const File& file : files_) {
    if (file.tensor_file) {
      write_tensor_file(file.path, file.value.toTensor());
    } else {
      write_pickled_dict(file.path, file.value.toGenericDict());
    }
  }
  files_.clear();
  bytes_ = 0;
}

StagingScope::StagingScope(StagedFiles& files) {
  DTRAIN_CHECK(staging == nullptr, "checkpoint staging scopes do not nest");
  staging = &files;
}

StagingScope::~StagingScope() { staging = nullptr; }

void save_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict) {
  if (staging != nullptr) {
    staging->add(path, dict, false);
    return;
  }
  write_pickled_dict(path, dict);
}

void save_tensor_file(const std::string& path, const at::Tensor& tensor) {
  if (staging != nullptr) {
    staging->add(path, tensor, true);
    return;
  }
  write_tensor_file(path, tensor);
}

c10::impl::GenericDict load_pickled_dict(const std::string& path, const std::string& what,
                                         const std::string& format) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read the ", what, " ", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, path, " is not a ", what, " (damaged?): ", e.what_without_backtrace());
  }
  DTRAIN_CHECK_INPUT(value.isGenericDict(), path, " is not a ", what);
  c10::impl::GenericDict dict = value.toGenericDict();
  DTRAIN_CHECK_INPUT(format.empty() || (dict.contains("format") && dict.at("format").isString() &&
                                        dict.at("format").toStringRef() == format),
                     path, " is not a ", what);
  return dict;
}

}  // namespace dtrain
