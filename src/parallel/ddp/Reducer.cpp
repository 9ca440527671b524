// Bucketed, overlapped gradient allreduce driven by autograd hooks.
#include "dtrain/parallel/ddp/Reducer.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>

#include "dtrain/comm/Hierarchical.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/ddp/Buckets.h"
#include "parallel/Alias.h"
#include "parallel/ddp/GradHooks.h"
#include "parallel/ddp/PowerSgd.h"

namespace dtrain::parallel::ddp {

Reducer::Reducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
                 comm::CommunicatorPtr comm, ReducerOptions options)
    : parameters_(std::move(parameters)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      options_(options) {
  DTRAIN_CHECK(comm_, "Reducer needs a communicator");
  DTRAIN_CHECK_EQ(parameters_.size(), names_.size(), "one name per parameter");
  DTRAIN_CHECK_INPUT(options_.bucket_cap_bytes > 0 && options_.first_bucket_cap_bytes > 0,
                     "bucket caps must be > 0 bytes");
  for (size_t k = 0; k < parameters_.size(); ++k) {
    DTRAIN_CHECK(parameters_[k].requires_grad(), "parameter ", names_[k], " does not require grad");
  }
  // Each bucket as a list of parameter indices, in launch order. Sharded mode lays a bucket
  // out in ascending parameter order, so it is one run of the shard layout's flat order, padded
  // to a multiple of the ranks; a reduce-scatter hands each rank an equal part.
  locator_.resize(parameters_.size());
  const auto groups = bucket_groups(parameters_, names_, options_);
  ShardLayout layout;
  if (sharded()) {
    std::vector<int64_t> numels;
    for (const auto& p : parameters_) {
      DTRAIN_CHECK(p.scalar_type() == parameters_.front().scalar_type(),
                   "Reducer: sharded mode needs parameters of one dtype");
      numels.push_back(p.numel());
    }
    layout = shard_layout(numels, groups, comm_->size());
    DTRAIN_CHECK(options_.shard_grad.defined() &&
                     options_.shard_grad.numel() == options_.shard_numel &&
                     options_.shard_numel == layout.shard_numel,
                 "Reducer: shard_grad must hold the shard layout's ", layout.shard_numel,
                 " elements, got shard_numel ", options_.shard_numel);
  }
  for (auto group : groups) {
    Bucket bucket;
    if (sharded()) std::sort(group.begin(), group.end());
    for (size_t k : group) {
      locator_[k] = {buckets_.size(), bucket.parameters.size()};
      bucket.parameters.push_back(k);
      bucket.offsets.push_back(bucket.numel);
      bucket.numel += parameters_[k].numel();
    }
    if (sharded()) {
      const ShardedBucket& placed = layout.buckets[layout.bucket_of[group.front()]];
      bucket.part = placed.part;
      bucket.shard_offset = placed.shard_offset;
    }
    bucket.pending = bucket.parameters.size();
    buckets_.push_back(std::move(bucket));
  }
  const at::ScalarType parameter_dtype = parameters_.front().scalar_type();
  converting_ =
      options_.grad_dtype != at::ScalarType::Undefined && options_.grad_dtype != parameter_dtype;
  for (const auto& p : parameters_) {
    DTRAIN_CHECK(!converting_ || p.scalar_type() == parameter_dtype,
                 "Reducer: a grad_dtype of its own needs parameters of one dtype");
  }
  DTRAIN_CHECK_INPUT(options_.powersgd.rank == 0 ||
                         (!sharded() && options_.wire_dtype == at::ScalarType::Undefined),
                     "PowerSGD compresses the allreduce of whole gradients: not with ZeRO-2's "
                     "reduce-scatter or a 16-bit wire format");
  DTRAIN_CHECK_INPUT(options_.ranks_per_host == 0 || (!sharded() && options_.powersgd.rank == 0),
                     "the hierarchical allreduce replaces the exact allreduce of whole buckets: "
                     "not with ZeRO-2's reduce-scatter or PowerSGD");
  DTRAIN_CHECK_INPUT(options_.average || options_.powersgd.rank == 0,
                     "PowerSGD averages its factors: not where gradients are summed (replicated "
                     "pipeline stages)");
  if (options_.ranks_per_host > 0) {
    hierarchy_ = std::make_unique<comm::HierarchicalAllreduce>(comm_, options_.ranks_per_host);
  }
  local_ = comm_->size() == 1 && !sharded() && !converting_ && options_.powersgd.rank == 0 &&
           options_.wire_dtype == at::ScalarType::Undefined && !hierarchy_ &&
           !options_.quantization.enabled();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    if (!sharded() && !local_) allocate(bucket);
    if (options_.powersgd.rank > 0) {
      std::vector<std::vector<int64_t>> shapes;
      for (size_t k : bucket.parameters) shapes.push_back(parameters_[k].sizes().vec());
      bucket.powersgd = std::make_unique<PowerSgdBucket>(bucket.flat, shapes, bucket.offsets,
                                                         options_.powersgd, b);
      stats_.compressed_matrices += static_cast<int64_t>(bucket.powersgd->compressed());
    }
    const auto wire_dtype = options_.wire_dtype != at::ScalarType::Undefined ? options_.wire_dtype
                            : converting_                                    ? options_.grad_dtype
                                          : parameters_[bucket.parameters.front()].scalar_type();
    stats_.bytes_per_step +=
        bucket.powersgd && options_.powersgd.start_step == 0
            ? bucket.powersgd->wire_bytes()
            : bucket.numel * static_cast<int64_t>(c10::elementSize(wire_dtype));
  }
  stats_.buckets = static_cast<int64_t>(buckets_.size());
  ready_.assign(parameters_.size(), false);
  DTRAIN_CHECK(options_.partial.empty() ||
                   (options_.partial.size() == parameters_.size() && options_.partial_group),
               "Reducer: ", options_.partial.size(), " partial-gradient flags for ",
               parameters_.size(), " parameters (and a group to sum them over)");
  DTRAIN_CHECK(options_.partial.empty() || options_.powersgd.rank == 0,
               "Reducer: partial gradients are not summed ahead under PowerSGD");
  partial_sums_.resize(parameters_.size());
  if (!sharded() && !local_) {
    for (size_t k = 0; k < parameters_.size(); ++k) alias_grad(k, /*keep_values=*/true);
  }

  hooks_ = std::make_unique<GradReadyHooks>([this](size_t k) { mark_ready(k); });
  hooks_->attach(parameters_, names_);
}

std::vector<std::vector<size_t>> bucket_groups(const std::vector<at::Tensor>& parameters,
                                               const std::vector<std::string>& names,
                                               const ReducerOptions& options) {
  std::vector<BucketedParameter> described;
  for (size_t k = 0; k < parameters.size(); ++k) {
    described.push_back({parameters[k].numel() * parameters[k].element_size(),
                         static_cast<int>(parameters[k].scalar_type()), module_of(names[k])});
  }
  return assign_buckets(described, {options.bucket_cap_bytes, options.first_bucket_cap_bytes,
                                    options.isolate_first_layer});
}

GradReadyHooks::~GradReadyHooks() {
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    if (accumulators_[k]) accumulators_[k]->del_post_hook(keys_[k]);
  }
}

void GradReadyHooks::attach(const std::vector<at::Tensor>& parameters,
                            const std::vector<std::string>& names) {
  accumulators_.resize(parameters.size());
  keys_.resize(parameters.size());
  for (size_t k = 0; k < parameters.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(parameters[k]);
    DTRAIN_CHECK(accumulator, "parameter ", names[k], " is not a leaf tensor");
    if (accumulator == accumulators_[k]) continue;
    if (accumulators_[k]) accumulators_[k]->del_post_hook(keys_[k]);
    keys_[k] = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_ready_(k);
          return outputs;
        }));
    accumulators_[k] = std::move(accumulator);
  }
}

Reducer::~Reducer() = default;

void Reducer::allocate(Bucket& bucket) {
  const at::Tensor& first = parameters_[bucket.parameters.front()];
  // Sharded mode: padded to each rank's equal part (the padding stays zero).
  const int64_t numel = sharded() ? bucket.part * comm_->size() : bucket.numel;
  bucket.flat =
      at::zeros({numel}, first.options()
                             .dtype(converting_ ? options_.grad_dtype : first.scalar_type())
                             .requires_grad(false));
  const bool compress = options_.wire_dtype != at::ScalarType::Undefined &&
                        options_.wire_dtype != bucket.flat.scalar_type();
  bucket.wire =
      compress ? at::empty({numel}, bucket.flat.options().dtype(options_.wire_dtype)) : bucket.flat;
}

void Reducer::complete_sharded(Bucket& bucket) {
  bucket.work->wait();
  bucket.work.reset();
  if (bucket.part > 0) {
    options_.shard_grad.narrow(0, bucket.shard_offset, bucket.part)
        .add_(bucket.received.to(options_.shard_grad.scalar_type()));
  }
  bucket.received.reset();
  for (size_t k : bucket.parameters) parameters_[k].mutable_grad().reset();
  bucket.flat.reset();
  bucket.wire.reset();
}

void Reducer::notify_completed_parts() {
  if (!options_.on_shard_part) return;
  while (notified_ < next_bucket_ && !buckets_[notified_].work) {
    const Bucket& bucket = buckets_[notified_++];
    if (bucket.part > 0) options_.on_shard_part(bucket.shard_offset, bucket.part);
  }
}

void Reducer::alias_grad(size_t k, bool keep_values) {
  const auto [b, slot] = locator_[k];
  Bucket& bucket = buckets_[b];
  if (!bucket.flat.defined()) allocate(bucket);  // sharded mode: on first use
  at::Tensor& p = parameters_[k];
  if (converting_) {  // the slot is the gradient; the parameter's .grad stays empty
    if (keep_values) {
      absorb(k);
    } else {
      p.mutable_grad().reset();
    }
    return;
  }
  const int64_t offset = bucket.offsets[slot];
  const void* expected =
      static_cast<const char*>(bucket.flat.data_ptr()) + offset * bucket.flat.element_size();
  const at::Tensor& grad = p.grad();
  if (grad.defined() && grad.data_ptr() == expected && grad.sizes() == p.sizes() &&
      grad.is_contiguous()) {
    return;
  }
  at::Tensor slot_view = bucket.flat.narrow(0, offset, p.numel());
  if (keep_values && grad.defined()) {
    slot_view.copy_(grad.reshape({-1}));
  } else {
    slot_view.zero_();
  }
  // A plain tensor sharing the bucket's storage (not an autograd view, so optimizers may
  // detach_() and zero_() it): backward accumulates straight into the bucket.
  p.mutable_grad() = alias_storage(bucket.flat, offset, p.sizes());
}

void Reducer::absorb(size_t k) {
  at::Tensor& grad = parameters_[k].mutable_grad();
  if (!grad.defined()) return;
  const auto [b, slot] = locator_[k];
  Bucket& bucket = buckets_[b];
  if (!bucket.flat.defined()) allocate(bucket);
  bucket.flat.narrow(0, bucket.offsets[slot], grad.numel()).add_(grad.reshape({-1}));
  grad.reset();
}

at::Tensor Reducer::main_grad(size_t k) const {
  DTRAIN_CHECK(converting_ && !sharded(),
               "Reducer::main_grad: only with a grad_dtype of its own and without "
               "reduce-scatter");
  const auto [b, slot] = locator_.at(k);
  const Bucket& bucket = buckets_[b];
  return alias_storage(bucket.flat, bucket.offsets[slot], parameters_[k].sizes());
}

void Reducer::zero_grad() {
  if (local_) {
    for (auto& p : parameters_) p.mutable_grad().reset();
    return;
  }
  if (sharded()) {  // no full gradients between steps
    options_.shard_grad.zero_();
    for (auto& p : parameters_) p.mutable_grad().reset();
    return;
  }
  for (auto& bucket : buckets_) bucket.flat.zero_();
  for (size_t k = 0; k < parameters_.size(); ++k) alias_grad(k, /*keep_values=*/false);
}

std::vector<at::Tensor> Reducer::bucket_buffers() const {
  std::vector<at::Tensor> buffers;
  for (const auto& bucket : buckets_) buffers.push_back(bucket.wire);
  return buffers;
}

std::vector<std::vector<size_t>> Reducer::bucket_layout() const {
  std::vector<std::vector<size_t>> layout;
  for (const auto& bucket : buckets_) layout.push_back(bucket.parameters);
  return layout;
}

void Reducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK(next_bucket_ == 0 && !backward_ended_,
               "Reducer: a new backward pass started before finalize() of the previous one");
  hooks_->attach(parameters_, names_);
}

void Reducer::mark_ready(size_t k) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (converting_) absorb(k);  // every micro-batch's, synchronized or not
  if (!sync_) return;
  DTRAIN_CHECK(!backward_ended_, "Reducer: gradient of ", names_[k],
               " arrived after backward ended; call finalize() before the next backward");
  DTRAIN_CHECK(!ready_[k], "Reducer: gradient of ", names_[k],
               " was produced twice in one backward pass (reentrant backward or a parameter "
               "reused across backward calls)");
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { on_backward_end(); });
  }
  ready_[k] = true;
  if (local_) return;
  alias_grad(k, /*keep_values=*/true);  // usually a no-op: AccumulateGrad wrote into the bucket
  start_partial_sum(k);
  Bucket& bucket = buckets_[locator_[k].first];
  if (--bucket.pending == 0) launch_ready_buckets();
  if (sharded()) {  // release full gradients as soon as their reduction is done
    size_t in_flight = 0;
    for (size_t b = 0; b < next_bucket_; ++b) {
      if (buckets_[b].work && buckets_[b].work->is_completed()) complete_sharded(buckets_[b]);
      in_flight += buckets_[b].work ? 1 : 0;
    }
    // When communication lags backward, wait for the oldest rather than let unreduced buckets
    // pile up (DeepSpeed's reduce_bucket_size bound).
    for (size_t b = 0; b < next_bucket_ && in_flight > kMaxReductionsInFlight; ++b) {
      if (buckets_[b].work) {
        complete_sharded(buckets_[b]);
        --in_flight;
      }
    }
    notify_completed_parts();
  }
}

void Reducer::start_partial_sum(size_t k) {
  if (options_.partial.empty() || !options_.partial[k]) return;
  const auto [b, slot] = locator_[k];
  Bucket& bucket = buckets_[b];
  // (Every TP rank's backward makes these gradients in the same order: the sums match.)
  partial_sums_[k] = options_.partial_group->allreduce(
      bucket.flat.narrow(0, bucket.offsets[slot], parameters_[k].numel()));
}

void Reducer::launch_ready_buckets() {
  const int world = comm_->size();
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& bucket = buckets_[next_bucket_++];
    for (const size_t k : bucket.parameters) {
      if (!partial_sums_[k]) continue;
      partial_sums_[k]->wait();
      partial_sums_[k].reset();
    }
    // On a GPU the bucket's work leaves the backward's stream free: a side stream (PyTorch's
    // DDP relies on the backend's stream alone; the averaging and the cast move off too).
    std::optional<c10::StreamGuard> on_side;
    if (!bucket.flat.is_cpu()) on_side.emplace(side_stream_after_current(bucket.flat.device()));
    if (options_.average) bucket.flat.div_(world);  // before the wire cast: keeps fp16 in range
    if (!bucket.wire.is_same(bucket.flat)) bucket.wire.copy_(bucket.flat);
    if (sharded()) {
      const std::vector<int64_t> counts(world, bucket.part);
      bucket.received = at::empty({bucket.part}, bucket.wire.options());
      comm::ReduceScatterOptions options;
      options.counts = counts;
      options.input_is_scratch = true;  // the bucket is freed once reduced
      bucket.work = options_.quantization.enabled()
                        ? comm::quantized_reduce_scatter(*comm_, bucket.received, bucket.wire,
                                                         counts, options_.quantization)
                        : comm_->reduce_scatter(bucket.received, bucket.wire, options);
    } else if (powersgd_now()) {
      bucket.work = bucket.powersgd->start(*comm_);
      bucket.phase = 1;
    } else {
      bucket.work = hierarchy_ ? hierarchy_->allreduce(bucket.wire) : comm_->allreduce(bucket.wire);
    }
    if (!backward_ended_) ++stats_.buckets_launched_during_backward;
  }
}

void Reducer::advance_powersgd() {
  // After every first allreduce is issued, in launch order: every rank must issue the second
  // ones in the same order, and one that started a bucket's second allreduce as soon as its
  // first completed would interleave them with other buckets' first ones by timing.
  for (size_t b = 0; b < next_bucket_; ++b) {
    Bucket& bucket = buckets_[b];
    if (bucket.phase != 1) continue;
    std::optional<c10::StreamGuard> on_side;  // a GPU's: after phase 1, on the same stream
    if (side_stream_ && !bucket.flat.is_cpu()) on_side.emplace(*side_stream_);
    bucket.work->wait();
    bucket.work = bucket.powersgd->middle(*comm_);
    bucket.phase = 2;
  }
}

c10::Stream Reducer::side_stream_after_current(c10::Device device) {
  c10::impl::VirtualGuardImpl guard(device.type());
  if (!side_stream_ || side_stream_->device() != device) {
    side_stream_ = guard.getStreamFromGlobalPool(device);
  }
  c10::Event written(device.type());
  written.record(guard.getStream(device));
  written.block(*side_stream_);
  return *side_stream_;
}

void Reducer::join_side_stream() {
  if (!side_stream_) return;
  c10::impl::VirtualGuardImpl guard(side_stream_->device_type());
  c10::Event issued(side_stream_->device_type());
  issued.record(*side_stream_);
  issued.block(guard.getStream(side_stream_->device()));
}

void Reducer::on_backward_end() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (backward_ended_) return;
  backward_ended_ = true;
  backward_end_time_ = std::chrono::steady_clock::now();
  stats_.unused_parameters.clear();
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (ready_[k]) continue;
    // No gradient in this backward: contribute what the slot holds (zero, or what earlier
    // no_sync micro-batches accumulated) so every rank still runs every bucket.
    stats_.unused_parameters.push_back(names_[k]);
    ready_[k] = true;
    if (local_) {
      at::Tensor& grad = parameters_[k].mutable_grad();
      if (!grad.defined()) grad = at::zeros_like(parameters_[k]);
      continue;
    }
    alias_grad(k, /*keep_values=*/true);
    start_partial_sum(k);
    --buckets_[locator_[k].first].pending;
  }
  if (!local_) launch_ready_buckets();
}

void Reducer::finalize() {
  if (!sync_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!backward_ended_) {
      stats_.buckets_launched_during_backward = 0;
    }
  }
  if (!backward_ended_) on_backward_end();  // no gradient reached any hook this step
  if (powersgd_now()) advance_powersgd();
  join_side_stream();
  for (auto& bucket : buckets_) {
    if (local_) break;
    if (sharded()) {
      if (bucket.work) complete_sharded(bucket);
      notify_completed_parts();
      continue;
    }
    if (bucket.work) bucket.work->wait();
    bucket.work.reset();
    if (bucket.phase == 2) {
      bucket.powersgd->finish();
      bucket.phase = 0;
      continue;
    }
    if (!bucket.wire.is_same(bucket.flat)) bucket.flat.copy_(bucket.wire);
  }
  stats_.exposed_comm_ms = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - backward_end_time_)
                               .count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ready_.assign(parameters_.size(), false);
    for (auto& bucket : buckets_) bucket.pending = bucket.parameters.size();
    next_bucket_ = 0;
    notified_ = 0;
    ++synced_steps_;
    if (options_.powersgd.rank > 0 && synced_steps_ == options_.powersgd.start_step) {
      stats_.bytes_per_step = 0;  // from the next step on, PowerSGD's
      for (const auto& bucket : buckets_) {
        stats_.bytes_per_step += bucket.powersgd->wire_bytes();
      }
    }
    in_backward_ = false;
    backward_ended_ = false;
  }
  if (options_.error_on_unused_parameters && !stats_.unused_parameters.empty()) {
    std::string names;
    for (const auto& name : stats_.unused_parameters) names += (names.empty() ? "" : ", ") + name;
    DTRAIN_THROW(Error, "rank ", comm_->rank(),
                 ": parameters received no gradient this step: ", names,
                 " (turn off error_on_unused_parameters to treat them as zero)");
  }
}

}  // namespace dtrain::parallel::ddp
