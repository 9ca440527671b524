#include "common/PickledFile.h"

#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
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

// torch::pickle_save's format (the zip torch.save writes), streamed: the pickle (small) first,
// then each tensor's bytes straight from the tensor to the file, so a checkpoint never needs its
// own size again in memory (pickle_save returns the whole file as one buffer).
void write_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { pickle.insert(pickle.end(), data, data + size); });
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  create_parent(path);
  write_file_atomically(path, [&](std::ostream& out) {
    try {
      caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
        out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
        return out.good() ? size : 0;
      });
      torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                         writer);
      writer.writeEndOfFile();
    } catch (const c10::Error& e) {
      DTRAIN_THROW(InputError, "writing ", path,
                   " failed (disk full?): ", e.what_without_backtrace());
    }
  });
}

// A file mapped into memory (copy-on-write: a reader may change what it got).
struct Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, size);
  }
};

void release_mapping(void* context) { delete static_cast<std::shared_ptr<Mapping>*>(context); }

// The dictionary in `path` (torch::pickle_save's zip) with every tensor a view of the file mapped
// into memory: nothing is read until it is used, and a reader that copies a tensor and lets its
// pages go (release_file_pages) holds at most that tensor of the file at a time. (pickle_load
// reads the whole file into a buffer and then copies every tensor out of it: twice the file.)
c10::IValue load_mapped(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_INPUT(fd >= 0, "cannot read the ", what, " ", path);
  struct stat status {};
  const bool stated = ::fstat(fd, &status) == 0;
  auto mapping = std::make_shared<Mapping>();
  mapping->size = stated ? static_cast<size_t>(status.st_size) : 0;
  if (mapping->size > 0) {
    mapping->base = ::mmap(nullptr, mapping->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  }
  ::close(fd);
  // (An empty file is left to the reader below, which names it damaged.)
  DTRAIN_CHECK_INPUT(stated && (mapping->size == 0 || mapping->base != MAP_FAILED),
                     "cannot read the ", what, " ", path);
  caffe2::serialize::PyTorchStreamReader reader(path);
  // Each tensor record's storage: its bytes in the mapping, up to the next record (the storage
  // may be longer than its tensors need; never past the file's end).
  std::map<size_t, std::string> by_offset;
  for (const std::string& name : reader.getAllRecords()) {
    by_offset.emplace(reader.getRecordOffset(name), name);
  }
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  for (auto it = by_offset.begin(); it != by_offset.end(); ++it) {
    const auto& [offset, name] = *it;
    if (name.rfind("data/", 0) != 0 || offset > mapping->size) continue;
    const auto next = std::next(it);
    const size_t end =
        next == by_offset.end() ? mapping->size : std::min(next->first, mapping->size);
    at::DataPtr data(static_cast<char*>(mapping->base) + offset,
                     new std::shared_ptr<Mapping>(mapping), &release_mapping, at::Device(at::kCPU));
    storages->addStorage(name.substr(5), c10::Storage(c10::Storage::use_byte_size_t(), end - offset,
                                                      std::move(data), nullptr, false));
  }
  return torch::jit::readArchiveAndTensors("data", "", "", c10::nullopt, c10::nullopt, c10::nullopt,
                                           reader, torch::jit::Unpickler::defaultTypeParser,
                                           storages);
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

void release_file_pages(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  if (t.storage().data_ptr().get_deleter() != &release_mapping) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.numel() * t.element_size());
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

c10::impl::GenericDict load_pickled_dict(const std::string& path, const std::string& what,
                                         const std::string& format) {
  c10::IValue value;
  try {
    value = load_mapped(path, what);
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
