// Checkpoint directories: one per step (`step-00000120/`), written under a temporary name and
// renamed when complete, with `meta.json` recording strategy, world layout, step, tensor
// shapes and a checksum of every file, and a `latest` file naming the newest complete checkpoint.
#pragma once

#include <ATen/core/Tensor.h>
#include <map>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace dtrain::train {

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  bool buffer = false;  // a module buffer (e.g. BatchNorm statistics), not a parameter
};

/// 2: state-R-of-N.pt shards (parallel/StateShards.h); 1 was model.pt + optimizer.pt.
constexpr int kCheckpointFormat = 2;

/// Size and CRC-32 of one file of a checkpoint.
struct FileDigest {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
  bool operator==(const FileDigest& o) const { return bytes == o.bytes && crc32 == o.crc32; }
};

struct CheckpointMeta {
  int format_version = kCheckpointFormat;
  std::string strategy;
  int world_size = 1;
  int dp = 1, pp = 1, tp = 1;
  /// The data-parallel ranks a mixture of experts' experts were split over (--expert-parallel).
  int ep = 1;
  int64_t step = 0;
  int64_t epoch = 0;
  uint64_t seed = 0;
  int64_t global_batch = 0;
  std::vector<TensorInfo> tensors;
  /// Every other file of the checkpoint (name -> digest), taken from the files on disk at save
  /// time. Empty for checkpoints written before dtrain recorded checksums.
  std::map<std::string, FileDigest> files;
  /// What else a job needs to use the model (e.g. "model": the GPT sizes as JSON,
  /// "vocabulary": the tokenizer's characters), written under "extras".
  std::map<std::string, std::string> extras;
};

std::string checkpoint_name(int64_t step);
/// Writes meta.json into `directory` (with a checksum of its own content).
void write_meta(const std::string& directory, const CheckpointMeta& meta);
/// Reads and validates meta.json (its own checksum too); InputError naming the file and field.
CheckpointMeta read_meta(const std::string& directory);
/// Size and CRC-32 of a file; InputError naming it when it cannot be read.
FileDigest digest_file(const std::string& path);
/// Digests every file in `directory` except meta.json into `meta.files`.
void record_files(const std::string& directory, CheckpointMeta& meta);
/// Checks meta.json and every file it lists against its digest. Returns "" when the checkpoint
/// verifies, else one sentence naming the damaged or missing file. A checkpoint without
/// digests (older dtrain) verifies with `*unverifiable` set.
std::string verify_checkpoint(const std::string& directory, bool* unverifiable = nullptr);
/// The complete checkpoints (`step-NNNNNNNN` directories) under `root`, oldest first.
std::vector<std::string> list_checkpoints(const std::string& root);
/// The newest complete checkpoint under `root`, if any (from `latest`, verified to exist).
std::optional<std::string> latest_checkpoint(const std::string& root);
/// Atomically points `root/latest` at `name`.
void set_latest(const std::string& root, const std::string& name);
/// Compares a checkpoint's tensor list with the model's; InputError naming the first mismatch.
void check_compatible(const CheckpointMeta& saved, const std::vector<TensorInfo>& model,
                      const std::string& directory);
/// Fails with an InputError now, before training, if checkpoints cannot be written to `root`.
void ensure_writable(const std::string& root);
/// The name `root/latest` holds, if the file exists.
std::optional<std::string> latest_checkpoint_name(const std::string& root);
/// Removes all but the newest `keep` complete checkpoints up to `newest` (by name) under
/// `root`: checkpoints after it (another run's) and set-aside damaged ones (`NAME.damaged`) stay.
void prune_checkpoints(const std::string& root, int keep, const std::string& newest);
/// Renames a damaged checkpoint to `NAME.damaged` (kept for inspection, never loaded or pruned);
/// returns the new path.
std::string set_aside_damaged(const std::string& directory);

/// A checkpoint directory, or the newest checkpoint when `path` is a checkpoint root (has
/// `latest`).
std::string resolve_checkpoint(const std::string& path);

/// A tensor of the full model.
struct FullTensor {
  std::string name;
  at::Tensor value;
  bool buffer = false;  ///< a buffer (BatchNorm's statistics), not a parameter
};
/// Every parameter and buffer of a checkpoint as full tensors, whatever its strategy, world size
/// and layout (its shards joined), in meta.json's order. InputError when it does not verify.
std::vector<FullTensor> read_full_model(const std::string& directory);

/// Joins the checkpoint's state files into one LibTorch archive of the full model (every
/// parameter and buffer meta.json lists, nested by module path like torch::save(module)): C++
/// reads it with load_consolidated (below), Python with torch.load(file).state_dict(). Works for
/// every strategy and world size. Written to a temporary name and renamed. Returns the number of
/// tensors.
int64_t consolidate_checkpoint(const std::string& directory, const std::string& output);
/// Loads a consolidated file into `module` by parameter and buffer name. torch::load(module,
/// file) reads it too when every submodule holds tensors, but refuses a module with tensor-less
/// children (ReLU, Dropout: "No such serialized submodule"), which the file cannot list.
/// InputError naming a tensor the file lacks or whose shape differs.
void load_consolidated(torch::nn::Module& module, const std::string& file);
/// Writes `module`'s parameters and buffers as such a file (atomically): what `dtrain fl
/// --save-model` hands to `dtrain train --init-from`.
void save_consolidated(torch::nn::Module& module, const std::string& file);
/// Sets `module`'s parameters and buffers from `path` (--init-from): a checkpoint directory or
/// root of any strategy and world size (joined first), or a consolidated file. InputError
/// naming the path and the first tensor missing or of another shape.
void load_model_from(torch::nn::Module& module, const std::string& path);

}  // namespace dtrain::train
