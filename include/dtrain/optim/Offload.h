// Optimizer offload (ZeRO-Offload and ZeRO-Infinity's NVMe tier): any of optim's optimizers,
// stepped bucket by bucket over chunks of the parameters, with its state kept in host memory
// (parameters on a GPU: host master copies, the step on the CPU) or in a file under a folder,
// read before and written after each bucket's step (the next bucket's read and the last one's
// write overlap the step). The update is the optimizer's own, element for element: an offloaded
// run equals the same run without offload bit for bit.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/optim/Optimizers.h"
#include "dtrain/optim/StateSize.h"

namespace dtrain::optim {

struct OffloadSpec {
  bool enabled = false;
  /// Where the state lives: empty = host memory, else a file in this folder (made if absent).
  std::string dir;
  /// Parameter elements per bucket (a parameter larger than that is cut into chunks).
  int64_t bucket_elements = int64_t{16} << 20;
  /// Host copies of the parameters even when they are on the CPU already (what a GPU run does;
  /// for tests on a machine without one).
  bool copy_to_host = false;
};

/// "none", "optimizer" or "optimizer:DIR" (the --offload flag); InputError naming the flag else.
OffloadSpec parse_offload(const std::string& flag, int64_t bucket_mb = 64);

class StateFile;

class OffloadedOptimizer final : public torch::optim::Optimizer {
 public:
  /// Builds `make`'s optimizer over each bucket of chunks of `parameters`. With a folder, the
  /// whole state's room is reserved at once: a folder without it fails here, naming the folder
  /// and the bytes.
  OffloadedOptimizer(std::vector<at::Tensor> parameters, const OptimizerFactory& make,
                     OffloadSpec spec);
  ~OffloadedOptimizer() override;

  at::Tensor step(LossClosure closure = nullptr) override;

  /// get_param_state / set_param_state / param_state_to_fill for one of `parameters` (whole,
  /// joined from its chunks; read from the file where it lives there).
  ParamState state_of(const at::Tensor& parameter) const;
  void set_state_of(const at::Tensor& parameter, const ParamState& state);
  ParamState state_to_fill(const at::Tensor& parameter) const;
  /// Master weights in the file too (ZeRO-Infinity keeps the fp32 copy on NVMe with the state):
  /// the parameters' values move into the folder's file, and between steps none of them is in
  /// the optimizer's memory (a bucket's values are read with its state and written back after its
  /// step), so the caller may free the parameters' memory. After each bucket's step its values are
  /// also copied, rounded, into `rounded_into` (one tensor per parameter with as many elements:
  /// the 16-bit shard a model computes with). Needs a folder; call before the first step.
  void keep_parameters_in_file(std::vector<at::Tensor> rounded_into);
  bool parameters_in_file() const { return paged_; }
  /// Parameters kept in the file: its values into the parameters (which must have memory again),
  /// and the parameters' values into the file and `rounded_into` (checkpoints save and load).
  void read_parameters() const;
  void write_parameters();
  /// Bytes of state in memory now (host memory mode: all of it; a folder: none between steps).
  int64_t resident_state_bytes() const;
  /// Bytes of state in the file (0 without a folder).
  int64_t file_bytes() const;
  const OffloadSpec& spec() const { return spec_; }

 private:
  struct Chunk {
    size_t parameter;
    int64_t offset, numel;
    size_t bucket;
    at::Tensor view;       // what the bucket's optimizer steps: the parameter's elements, or a copy
    int64_t file_base;     // of its state in the file
    int64_t value_base;    // of its values in the file (parameters kept there), else -1
    bool present = false;  // its state exists (in the optimizer or the file)
    ParamState scalars;    // 0-dim state ("step"), kept in memory
  };
  struct Pending;

  const at::Tensor& parameter_of(const Chunk& chunk) const { return parameters_[chunk.parameter]; }
  at::Tensor slice(const at::Tensor& t, const Chunk& chunk) const;
  std::vector<size_t> chunks_of(const at::Tensor& parameter) const;
  /// The chunk's state read from the file (tensors allocated here, filled by `read`).
  ParamState read_state(const Chunk& chunk) const;
  void write_state(const Chunk& chunk, const ParamState& state) const;
  std::unique_ptr<Pending> start_load(size_t bucket);
  void finish_load(Pending& pending);
  std::unique_ptr<Pending> start_evict(size_t bucket);
  /// Host copies: chunks copied again from parameters changed since the last step (a checkpoint
  /// loaded into them, say), told by their version counters.
  void refresh_copies();

  std::vector<at::Tensor> parameters_;
  OffloadSpec spec_;
  bool copy_ = false;
  std::vector<std::string> names_;  // element-wise state the optimizer keeps, in file order
  ParamState scalar_zeros_;
  std::vector<int64_t> synced_;  // host copies: each parameter's version when last copied
  std::vector<Chunk> chunks_;
  std::vector<std::vector<size_t>> buckets_;  // chunk indices
  std::vector<OptimizerPtr> optimizers_;      // one per bucket
  OptimizerFactory make_;
  bool paged_ = false;                    // parameters kept in the file
  std::vector<at::Tensor> rounded_into_;  // and copied into these after each step
  std::unique_ptr<StateFile> file_;
  int64_t file_bytes_ = 0;
};

/// `make` wrapped in offload when `spec.enabled` (on CPU parameters without a folder it changes
/// nothing, so the optimizer is `make`'s own).
OptimizerFactory offloaded_factory(OptimizerFactory make, OffloadSpec spec);

}  // namespace dtrain::optim
