// Reducer: gradient synchronization for data parallelism (PyTorch DDP's reducer, flashlight's
// CoalescingReducer). Parameters' .grad tensors share storage with size-capped flat buckets
// (PyTorch's gradient_as_bucket_view), so backward accumulates straight into them; an
// AccumulateGrad post-hook marks each gradient ready, each bucket's allreduce starts as soon as
// its last gradient is, overlapping the rest of backward, and finalize() waits for all of them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/Quantized.h"

namespace dtrain::comm {
class HierarchicalAllreduce;
}

namespace dtrain::parallel::ddp {

class GradReadyHooks;
class PowerSgdBucket;

/// PowerSGD gradient compression (src/parallel/ddp/PowerSgd.h).
struct PowerSgdOptions {
  /// Rank r of the approximation; 0 = off.
  int64_t rank = 0;
  /// Exact allreduce for this many synchronized steps first (PyTorch's start_powerSGD_iter).
  int64_t start_step = 0;
  /// A matrix n x m is compressed when n m / (r (n + m)) is at least this (PyTorch's
  /// min_compression_rate); 0 compresses every matrix (tests).
  double min_compression_rate = 2.0;
  /// The first Q of every matrix is drawn from this seed, the same on every rank.
  uint64_t seed = 0x50575253;
  /// The factors' (and uncompressed tensors') dtype on the wire: Undefined = the gradients';
  /// kHalf or kBFloat16 halve the bytes (PyTorch's fp16_compress_wrapper around its hook).
  at::ScalarType wire_dtype = at::ScalarType::Undefined;
};

/// Sharded modes (ZeRO-2/3): reductions left running while backward goes on; beyond this,
/// backward waits for the oldest, so unreduced gradients stay bounded when communication lags
/// (one: as fast as two in bench/zero/run_zero_bench.py, with less memory).
constexpr size_t kMaxReductionsInFlight = 1;

struct ReducerOptions {
  int64_t bucket_cap_bytes = 25LL * 1024 * 1024;
  /// Cap of the first bucket (the last layers' gradients), kept small so communication starts
  /// early in backward (PyTorch DDP's 1 MiB first bucket).
  int64_t first_bucket_cap_bytes = 1024 * 1024;
  /// Undefined: gradients travel in their own dtype; kHalf / kBFloat16: compressed.
  at::ScalarType wire_dtype = at::ScalarType::Undefined;
  bool error_on_unused_parameters = false;
  /// Give the first layer's parameters (their gradients come last) a bucket of their own when
  /// the rest of their bucket is at least as large as they are.
  bool isolate_first_layer = true;
  /// ZeRO-2 (> 0): instead of allreducing, reduce-scatter each bucket so this rank receives only
  /// its part of it (Buckets.h's shard_layout over the buckets: every bucket padded and split
  /// evenly), averaged and added into `shard_grad` (shard_numel elements, the layout's); bucket
  /// buffers exist only from a bucket's first gradient until its reduction, and parameters'
  /// .grad are released with them.
  int64_t shard_numel = 0;
  at::Tensor shard_grad;
  /// Reduce-scatter mode: called in bucket order with each bucket's part of shard_grad
  /// (offset, length; parts of none left out) once its reduction has been added in, as soon as
  /// that is seen: from the hooks during backward, the rest in finalize() (every synchronized
  /// backward). --fault-tolerance replicas' hybrid sharding starts each part's sum over the
  /// replicas there.
  std::function<void(int64_t offset, int64_t length)> on_shard_part;
  /// Reduce-scatter mode: int8 block-quantized (comm/Quantized.h) when enabled.
  comm::BlockQuantization quantization;
  /// > 0: buckets are allreduced hierarchically over hosts of this many ranks
  /// (comm/Hierarchical.h); 0: one flat allreduce.
  int ranks_per_host = 0;
  /// PowerSGD instead of the exact allreduce (rank > 0; not with shard_numel or wire_dtype).
  PowerSgdOptions powersgd;
  /// The dtype gradients accumulate and travel in where it differs from the parameters' (a bf16
  /// model's fp32 gradients: Megatron's accumulate-allreduce-grads-in-fp32): every micro-batch's
  /// gradient is added into its bucket slot as soon as autograd has it, then released, so
  /// parameters' .grad stay empty; main_grad(k) is the slot. Undefined: the parameters' dtype.
  at::ScalarType grad_dtype = at::ScalarType::Undefined;
  /// false: the gradients are summed over the group, not averaged (a replicated pipeline
  /// stage's replicas each hold a share of the step's mean already: the last stage divides each
  /// micro-batch's loss by the step's micro-batch count). Plain allreduce only.
  bool average = true;
  /// Parameters whose gradients are partial sums over `partial_group` (sequence parallelism's
  /// replicated LayerNorms: each TP rank saw its part of the sequence), by index (empty: none):
  /// each is summed over that group as soon as it is ready, before its bucket's reduction, so
  /// the bucket can be reduce-scattered (ZeRO with --sequence-parallel; Megatron sums them
  /// after, which needs every TP rank's flat layout to be the same). Not with a local Reducer.
  std::vector<bool> partial;
  comm::CommunicatorPtr partial_group;
};

struct ReducerStats {
  int64_t buckets = 0;
  /// Bytes of the gradients' collectives per synchronized step (PowerSGD: its factors and
  /// uncompressed tensors, once it has started).
  int64_t bytes_per_step = 0;
  /// PowerSGD: matrices it compresses (0 without it).
  int64_t compressed_matrices = 0;
  /// Last step: time from the end of backward until every bucket was reduced (the
  /// communication that did not overlap with backward).
  double exposed_comm_ms = 0.0;
  /// Last step: buckets launched before backward ended (overlapped).
  int64_t buckets_launched_during_backward = 0;
  /// Names of parameters that got no gradient in the last synchronized step.
  std::vector<std::string> unused_parameters;
  /// ZeRO-3: most bytes of gathered parameters and unsharded gradients held at once this step.
  int64_t peak_transient_bytes = 0;
};

/// What a data-parallel strategy needs from its gradient synchronizer, once per step:
/// zero_grad(); per micro-batch set_sync(), prepare_for_backward(), backward; finalize().
/// The Reducer (DDP, ZeRO-1/2) and ZeRO-3's parameter sharder implement it.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  /// While false, gradients just accumulate locally (no_sync).
  virtual void set_sync(bool sync) = 0;
  /// Before the forward of a synchronized micro-batch.
  virtual void prepare_for_backward() = 0;
  /// After backward: waits for every reduction.
  virtual void finalize() = 0;
  virtual void zero_grad() = 0;
  virtual const ReducerStats& stats() const = 0;
  /// Whether the partial gradients (ReducerOptions::partial) were summed over their group
  /// before the reduction (else the caller sums them after).
  virtual bool sums_partial_gradients() const { return false; }
};

/// The buckets a Reducer with `options` makes of `parameters` (Buckets.h's rule over their
/// sizes, dtypes and modules), in launch order: what ZeRO lays its shards out by.
std::vector<std::vector<size_t>> bucket_groups(const std::vector<at::Tensor>& parameters,
                                               const std::vector<std::string>& names,
                                               const ReducerOptions& options);

class Reducer : public GradientSync {
 public:
  /// `names[i]` names `parameters[i]` in error messages. Buckets are filled in reverse
  /// parameter order (roughly the order backward produces gradients).
  Reducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
          comm::CommunicatorPtr comm, ReducerOptions options);
  ~Reducer() override;
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// While false, hooks do nothing and gradients just accumulate locally (no_sync).
  void set_sync(bool sync) override { sync_ = sync; }
  bool sync() const { return sync_; }
  /// Call before the forward of the synchronized micro-batch of a step. Re-attaches hooks to
  /// parameters whose autograd node changed since the last step (weights loaded with set_).
  void prepare_for_backward() override;
  /// Waits for every bucket; afterwards each parameter's .grad holds the average.
  void finalize() override;
  /// Zeroes every gradient (the buckets) for the next step.
  void zero_grad() override;
  const ReducerStats& stats() const override { return stats_; }
  bool sums_partial_gradients() const override { return !local_ && !options_.partial.empty(); }
  /// Parameter indices of each bucket (for tests and tools).
  std::vector<std::vector<size_t>> bucket_layout() const;
  /// The flat communication buffer of each bucket (for benchmarks that time the allreduces
  /// alone).
  std::vector<at::Tensor> bucket_buffers() const;
  /// Whether buckets are reduce-scattered into a gradient shard (ZeRO's sharded mode).
  bool reduce_scatters() const { return sharded(); }
  /// With a grad_dtype of its own (not in reduce-scatter mode): parameter k's gradient in that
  /// dtype, a tensor sharing its bucket's storage (averaged after finalize()).
  at::Tensor main_grad(size_t k) const;

 private:
  struct Bucket {
    std::vector<size_t> parameters;  // indices into parameters_
    std::vector<int64_t> offsets;    // element offset of each parameter in `flat`
    int64_t numel = 0;
    at::Tensor flat;  // gradients, in the parameters' dtype
    at::Tensor wire;  // compressed copy (or == flat)
    size_t pending = 0;
    comm::WorkPtr work;
    // Reduce-scatter mode: each rank's part (numel padded, / ranks), where this rank's sits in
    // shard_grad, and what it receives.
    int64_t part = 0;
    int64_t shard_offset = 0;
    at::Tensor received;
    // PowerSGD: its factors and error, and the phase of this step's exchange (0: none in
    // flight, 1: the Ps and plain gradients, 2: the Qs).
    std::unique_ptr<PowerSgdBucket> powersgd;
    int phase = 0;
  };

  bool sharded() const { return options_.shard_numel > 0; }
  /// Gradients accumulate in grad_dtype, not in the parameters' .grad.
  bool converting_ = false;
  /// Converting: adds parameter k's .grad into its bucket slot and releases it.
  void absorb(size_t k);
  /// One rank, nothing to reduce or compress: no buckets, gradients as autograd makes them
  /// (set to none between steps rather than zeroed in place, as PyTorch's
  /// zero_grad(set_to_none=True)): a zero fill and an in-place add of every gradient fewer.
  bool local_ = false;
  void allocate(Bucket& bucket);
  /// Reduce-scatter mode: waits for the bucket, adds what this rank received into shard_grad,
  /// frees the bucket and its parameters' gradients.
  void complete_sharded(Bucket& bucket);
  /// PowerSGD on, once backward is over: every bucket's first allreduce waited for, its second
  /// issued, in launch order.
  void advance_powersgd();
  bool powersgd_now() const {
    return options_.powersgd.rank > 0 && synced_steps_ >= options_.powersgd.start_step;
  }
  /// Points parameter k's .grad at its bucket slot (copying a replaced gradient in, or zeroing).
  void alias_grad(size_t k, bool keep_values);
  void mark_ready(size_t parameter);
  /// Starts parameter k's sum over partial_group when it is a partial one (its slot, in place).
  void start_partial_sum(size_t k);
  void on_backward_end();
  void launch_ready_buckets();
  /// On a GPU: the side stream the buckets' averaging, casts and collectives are issued on,
  /// made to wait (an event) for the gradients the current stream wrote.
  c10::Stream side_stream_after_current(c10::Device device);
  /// The current stream waits (an event) for what the side stream issued.
  void join_side_stream();

  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;
  comm::CommunicatorPtr comm_;
  ReducerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_;  // parameter -> (bucket, slot)
  std::unique_ptr<GradReadyHooks> hooks_;

  std::mutex mutex_;
  bool sync_ = true;
  bool in_backward_ = false;
  bool backward_ended_ = false;
  std::vector<bool> ready_;
  std::vector<comm::WorkPtr> partial_sums_;  // by parameter, in flight until its bucket launches
  size_t next_bucket_ = 0;
  /// Reduce-scatter mode: buckets whose on_shard_part was called (in order).
  size_t notified_ = 0;
  void notify_completed_parts();
  int64_t synced_steps_ = 0;
  std::chrono::steady_clock::time_point backward_end_time_;
  ReducerStats stats_;
  std::optional<c10::Stream> side_stream_;
  std::unique_ptr<comm::HierarchicalAllreduce> hierarchy_;
};

}  // namespace dtrain::parallel::ddp
