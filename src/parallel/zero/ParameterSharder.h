// ParameterSharder: ZeRO-3 / FSDP parameter sharding. The model is cut into units (its stages,
// optionally merged); each unit's parameters are flattened, padded to a multiple of the world
// size and split, and each rank stores only its shard. The parameters stay the module's own
// leaf tensors, but their storage is freed between uses: run() all-gathers a unit's storage just
// before its forward (prefetching the next unit's meanwhile) and frees it afterwards; a hook on
// the unit's output gathers it again just before its backward (prefetching the unit before);
// once every parameter of the unit has its gradient, the unit's gradient is reduce-scattered into
// this rank's gradient shard and the parameters are freed again (PyTorch FSDP's
// FULL_SHARD). LibTorch has no module hooks, so the units come from Model::stages.
// With expert parallelism a unit's expert blocks (this rank's experts, which the other ranks of
// its expert group do not hold) form a unit of their own, sharded over the ranks holding the same
// experts (the expert data-parallel group, torchtitan's efsdp), gathered and freed with the
// stage's unit and reduce-scattered over that group.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/Quantized.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "parallel/ddp/GradHooks.h"

namespace dtrain::parallel::zero {

/// Memory for gathered parameters and unsharded gradients: buffers freed by one unit are reused
/// by the next (units are often equal in size), so a step does not fault fresh pages in for
/// every gather, as a caching allocator does for FSDP on CUDA. At most `max_cached` idle buffers
/// are kept.
class BufferPool {
 public:
  BufferPool(at::Allocator* allocator, size_t max_cached)
      : allocator_(allocator), max_cached_(max_cached) {}
  /// Points `t`'s storage at a pooled buffer of `numel` elements / hands it back (storage empty).
  void attach(const at::Tensor& t, int64_t numel);
  void detach(const at::Tensor& t);
  /// A 1-D tensor of `numel` uninitialized elements on a pooled buffer (detach() it when done).
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  /// Bytes allocated and not yet returned to the system (in use or cached), and their peak.
  int64_t held() const { return held_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = held_; }

 private:
  at::DataPtr take(size_t nbytes);
  void give(at::DataPtr ptr);

  at::Allocator* allocator_;
  size_t max_cached_;
  std::vector<std::pair<size_t, at::DataPtr>> cached_;  // capacity, buffer
  std::unordered_map<void*, size_t> capacity_;          // of every buffer handed out
  int64_t held_ = 0, peak_ = 0;
};

struct ShardUnit {
  std::string name;
  std::vector<size_t> parameters;  // indices into the sharder's parameters
  std::vector<std::function<at::Tensor(const at::Tensor&)>> forwards;  // applied in order
  /// Activation checkpointing: keep only the unit's input; recompute in backward (after the
  /// pre-backward gather).
  bool checkpoint = false;
  std::vector<at::Generator> generators = {};  // its stages' own (Stage::generators)
};

class ParameterSharder : public ddp::GradientSync {
 public:
  /// A run of one parameter's elements inside this rank's shard: an optimizer parameter that
  /// aliases shard_parameters() (its .grad aliases shard_gradients()).
  struct Piece {
    size_t parameter;
    int64_t offset;  // of the run within the flattened parameter
    at::Tensor tensor;
  };

  /// Collective. Takes the full, identical-on-every-rank `parameters` (leaves), shards them and
  /// frees their storage. With `quantization` on, forward and backward gather int8 blocks of the
  /// shards and gradients are reduce-scattered as int8 blocks (ZeRO++'s qwZ and qgZ); the
  /// shards, the optimizer's, stay exact.
  /// Writes elements [begin, begin + out.numel()) of parameter k's values into `out`.
  using Fill = std::function<void(size_t k, int64_t begin, at::Tensor out)>;
  /// With `fill`, the parameters are placeholders without memory (nn/DeferredInit.h): each
  /// rank's shard is drawn by `fill`, and no rank ever holds a whole parameter.
  /// `gradient_dtype` (default: the parameters'): the dtype gradients are reduced and kept in
  /// (float32 for a bf16 model with master weights, as FSDP2's reduce_dtype).
  /// `expert` (one flag per parameter, or empty): the blocks of this rank's experts, sharded over
  /// `expert_comm`; their gradients are summed over it and divided by `comm`'s size, as every
  /// other gradient (one process's mean over the data-parallel ranks' examples).
  ParameterSharder(std::vector<at::Tensor> parameters, std::vector<std::string> names,
                   std::vector<ShardUnit> units, comm::CommunicatorPtr comm, bool prefetch,
                   bool error_on_unused_parameters, comm::BlockQuantization quantization = {},
                   const Fill& fill = nullptr,
                   at::ScalarType gradient_dtype = at::ScalarType::Undefined,
                   const std::vector<bool>& expert = {},
                   comm::CommunicatorPtr expert_comm = nullptr);
  ~ParameterSharder() override;
  ParameterSharder(const ParameterSharder&) = delete;
  ParameterSharder& operator=(const ParameterSharder&) = delete;

  /// Collective. The model's forward, unit by unit, gathering and freeing parameters.
  at::Tensor run(const at::Tensor& input);
  /// Collective. Gathers every unit exactly (full parameters until the next run()).
  void gather_all();

  // GradientSync. Every micro-batch is synchronized (sharded gradients cannot accumulate
  // unreduced), so set_sync(false) is refused.
  void set_sync(bool sync) override;
  void prepare_for_backward() override;
  void finalize() override;
  void zero_grad() override;
  const ddp::ReducerStats& stats() const override { return stats_; }

  const std::vector<Piece>& pieces() const { return pieces_; }
  const at::Tensor& shard_parameters() const { return shard_params_; }
  const at::Tensor& shard_gradients() const { return shard_grad_; }
  /// Units, an expert unit counting apart from its stage's.
  size_t unit_count() const { return units_.size(); }
  /// Most bytes of gathered parameters and unsharded gradients held at once (including idle
  /// pooled buffers) since the last zero_grad().
  int64_t peak_transient_bytes() const { return pool_.peak(); }

 private:
  struct Unit {
    ShardUnit spec;
    comm::CommunicatorPtr comm;    // what it is sharded over
    size_t partner = SIZE_MAX;     // a stage unit's expert unit, gathered and freed with it
    std::vector<int64_t> offsets;  // of each parameter in the unit's flat order
    int64_t numel = 0;             // unpadded
    int64_t shard = 0;             // elements per rank
    int64_t base = 0;              // of this unit's shard in shard_params_ / shard_grad_
    at::Tensor full;               // shard x ranks elements; storage freed when not gathered
    bool gathered = false;
    comm::WorkPtr gather_work;
    // Backward.
    size_t pending = 0;
    bool reduced = false;
    at::Tensor grad_flat;
    at::Tensor received;
    comm::WorkPtr reduce_work;
  };

  /// Gives the gradient shard its memory (zeroed) the first time it is needed.
  void allocate_gradients();
  /// Starts the allgather (no-op when gathered or in flight); quantized unless `exact`.
  void gather(Unit& unit, bool exact = false);
  void wait_gathered(Unit& unit);
  void release(Unit& unit);
  /// A stage's unit and its expert unit (if any) together.
  void gather_stage(size_t u, bool unless_reduced = false);
  void wait_stage(size_t u);
  void release_stage(size_t u);
  void pre_backward(size_t stage);  // (an index of stages_)
  void on_gradient(size_t k);
  void launch_reduction(Unit& unit);
  void complete_reduction(Unit& unit);
  void on_backward_end();

  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;
  comm::CommunicatorPtr comm_;
  bool prefetch_;
  bool error_on_unused_;
  comm::BlockQuantization quantization_;
  BufferPool pool_;
  std::vector<Unit> units_;
  std::vector<size_t> stages_;  // the units that run (an expert unit runs with its stage's)
  std::vector<std::pair<size_t, size_t>> locator_;  // parameter -> (unit, slot)
  at::Tensor shard_params_, shard_grad_;
  std::vector<Piece> pieces_;
  std::unique_ptr<ddp::GradReadyHooks> hooks_;
  std::vector<bool> ready_;
  std::vector<size_t> in_flight_;  // units whose reduction is running, oldest first
  bool in_backward_ = false;
  bool backward_ended_ = false;
  std::chrono::steady_clock::time_point backward_end_time_;
  ddp::ReducerStats stats_;
};

}  // namespace dtrain::parallel::zero
