// Files of dtrain's own state (shard and federated-server checkpoints, a rank's state file): a
// dictionary pickled by LibTorch (torch::pickle_save), written atomically, read back with one
// check of what it is before anything of it is used.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain {

/// Files staged in host memory for an asynchronous checkpoint (PyTorch's async DCP, torchtitan's
/// async_mode): while a StagingScope is open on a thread, save_pickled_dict and save_tensor_file
/// called on that thread copy what they are given into it (every tensor cloned to host memory,
/// so training may change its own at once) instead of writing; write() writes them later, from
/// any thread.
class StagedFiles {
 public:
  /// Writes every staged file (creating directories) in the order staged, then forgets them.
  /// InputError naming the file that cannot be written.
  void write();
  /// Bytes of tensor data held.
  int64_t bytes() const { return bytes_; }
  bool empty() const { return files_.empty(); }

 private:
  friend void save_pickled_dict(const std::string&, const c10::impl::GenericDict&);
  friend void save_tensor_file(const std::string&, const at::Tensor&);
  struct File {
    std::string path;
    c10::IValue value;
    bool tensor_file = false;  // torch::save(tensor) rather than a pickled dictionary
  };
  void add(const std::string& path, const c10::IValue& value, bool tensor_file);
  std::vector<File> files_;
  int64_t bytes_ = 0;
};

/// Stages this thread's state-file writes into `files` for its lifetime (not nested).
class StagingScope {
 public:
  explicit StagingScope(StagedFiles& files);
  ~StagingScope();
  StagingScope(const StagingScope&) = delete;
  StagingScope& operator=(const StagingScope&) = delete;
};

/// Pickles `dict` into `path` atomically (a reader sees the old file or the new one), creating
/// its directory.
void save_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict);

/// torch::save(tensor, path) (a checkpoint's random-generator and loss-scaler states), staged
/// like save_pickled_dict.
void save_tensor_file(const std::string& path, const at::Tensor& tensor);

/// The dictionary pickled in `path`. InputError naming the file and `what` it should be ("a
/// parameter-server shard checkpoint") when it cannot be read, does not unpickle (damaged?), is
/// no dictionary, or - with a `format` - does not say that format under "format".
/// Its tensors are views of the file mapped into memory (copy-on-write): nothing of a tensor is
/// read before it is used.
c10::impl::GenericDict load_pickled_dict(const std::string& path, const std::string& what,
                                         const std::string& format = "");

/// For a tensor of a dictionary load_pickled_dict returned, once copied out: its pages of the file
/// leave this process's memory (read again from the file if used again), so a reader going
/// through a checkpoint holds one tensor of it at a time. Does nothing for any other tensor.
void release_file_pages(const at::Tensor& t);

}  // namespace dtrain
