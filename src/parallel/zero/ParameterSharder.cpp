// ZeRO-3 parameter sharding: per-unit flat shards, gathered on demand, freed after use.
#include "parallel/zero/ParameterSharder.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

#include "common/StorageMemory.h"
#include "dtrain/common/Error.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/nn/DeferredInit.h"
#include "parallel/Alias.h"

namespace dtrain::parallel::zero {

namespace {}  // namespace

at::DataPtr BufferPool::take(size_t nbytes) {
  // The smallest cached buffer that fits without wasting more than half of it.
  auto best = cached_.end();
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    if (it->first >= nbytes && it->first <= 2 * nbytes &&
        (best == cached_.end() || it->first < best->first)) {
      best = it;
    }
  }
  if (best != cached_.end()) {
    at::DataPtr ptr = std::move(best->second);
    cached_.erase(best);
    return ptr;
  }
  at::DataPtr ptr = allocator_->allocate(nbytes);
  capacity_[ptr.get()] = nbytes;
  held_ += static_cast<int64_t>(nbytes);
  peak_ = std::max(peak_, held_);
  return ptr;
}

void BufferPool::give(at::DataPtr ptr) {
  if (!ptr.get()) return;
  const size_t capacity = capacity_.at(ptr.get());
  if (cached_.size() < max_cached_) {
    cached_.emplace_back(capacity, std::move(ptr));
    return;
  }
  capacity_.erase(ptr.get());
  held_ -= static_cast<int64_t>(capacity);
}

void BufferPool::attach(const at::Tensor& t, int64_t numel) {
  c10::Storage storage = t.storage();
  const size_t nbytes = static_cast<size_t>(numel) * t.element_size();
  storage.set_data_ptr_noswap(take(nbytes));
  storage.set_nbytes(nbytes);
}

void BufferPool::detach(const at::Tensor& t) {
  c10::Storage storage = t.storage();
  give(storage.set_data_ptr(at::DataPtr(nullptr, storage.device())));
  storage.set_nbytes(0);
}

at::Tensor BufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  attach(t, numel);
  t.set_(t.storage(), 0, {numel}, {1});
  return t;
}

ParameterSharder::ParameterSharder(std::vector<at::Tensor> parameters,
                                   std::vector<std::string> names, std::vector<ShardUnit> units,
                                   comm::CommunicatorPtr comm, bool prefetch,
                                   bool error_on_unused_parameters,
                                   comm::BlockQuantization quantization, const Fill& fill,
                                   at::ScalarType gradient_dtype, const std::vector<bool>& expert,
                                   comm::CommunicatorPtr expert_comm)
    : parameters_(std::move(parameters)),
      names_(std::move(names)),
      comm_(std::move(comm)),
      prefetch_(prefetch),
      error_on_unused_(error_on_unused_parameters),
      quantization_(quantization),
      pool_(c10::GetAllocator(parameters_.front().device().type()), 4) {
  DTRAIN_CHECK(!parameters_.empty() && parameters_.size() == names_.size(),
               "ParameterSharder needs named parameters");
  const auto dtype = parameters_.front().scalar_type();
  for (size_t k = 0; k < parameters_.size(); ++k) {
    DTRAIN_CHECK_INPUT(parameters_[k].scalar_type() == dtype, "zero3 needs parameters of one ",
                       "dtype; ", names_[0], " is ", dtype, ", ", names_[k], " is ",
                       parameters_[k].scalar_type());
  }
  const bool any_expert = std::find(expert.begin(), expert.end(), true) != expert.end();
  DTRAIN_CHECK(expert.empty() || expert.size() == parameters_.size(),
               "ParameterSharder: ", expert.size(), " expert flags for ", parameters_.size(),
               " parameters");
  DTRAIN_CHECK(!any_expert || expert_comm, "ParameterSharder: experts without an expert group");
  auto is_expert = [&expert](size_t k) { return k < expert.size() && expert[k]; };
  locator_.assign(parameters_.size(), {SIZE_MAX, 0});
  int64_t total_shard = 0;
  auto add = [&](ShardUnit spec, comm::CommunicatorPtr over) {
    Unit unit;
    unit.spec = std::move(spec);
    unit.comm = std::move(over);
    for (size_t slot = 0; slot < unit.spec.parameters.size(); ++slot) {
      const size_t k = unit.spec.parameters[slot];
      DTRAIN_CHECK(k < parameters_.size(), "unit ", unit.spec.name, ": bad parameter index");
      DTRAIN_CHECK_INPUT(locator_[k].first == SIZE_MAX, "zero3: parameter ", names_[k],
                         " belongs to two units (", units_.at(locator_[k].first).spec.name, " and ",
                         unit.spec.name, "); shared parameters are not supported");
      locator_[k] = {units_.size(), slot};
      unit.offsets.push_back(unit.numel);
      unit.numel += parameters_[k].numel();
    }
    const int world = unit.comm->size();
    unit.shard = (unit.numel + world - 1) / world;
    unit.base = total_shard;
    total_shard += unit.shard;
    units_.push_back(std::move(unit));
    return units_.size() - 1;
  };
  for (auto& spec : units) {
    ShardUnit experts{spec.name + " (experts)", {}, {}};
    std::vector<size_t> dense;
    for (size_t k : spec.parameters) (is_expert(k) ? experts.parameters : dense).push_back(k);
    if (experts.parameters.empty() || dense.empty()) {  // one kind: one unit
      stages_.push_back(
          add(std::move(spec), dense.empty() && !experts.parameters.empty() ? expert_comm : comm_));
      continue;
    }
    spec.parameters = std::move(dense);
    const size_t stage = add(std::move(spec), comm_);
    units_[stage].partner = add(std::move(experts), expert_comm);
    stages_.push_back(stage);
  }
  for (size_t k = 0; k < parameters_.size(); ++k) {
    DTRAIN_CHECK_INPUT(locator_[k].first != SIZE_MAX, "zero3: parameter ", names_[k],
                       " belongs to no stage of the model (every parameter must be used by "
                       "exactly one Model::stages entry)");
  }
  const auto options = parameters_.front().options().requires_grad(false);
  shard_params_ = at::zeros({total_shard}, options);
  // The gradient shard gets its memory at the first zero_grad() or reduction, as FSDP's
  // gradients do at the first backward: it is no part of the setup's peak.
  shard_grad_ = nn::placeholder({total_shard}, gradient_dtype == at::ScalarType::Undefined
                                                   ? options
                                                   : options.dtype(gradient_dtype));
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) {
    const int world = unit.comm->size();
    const int rank = unit.comm->rank();
    const int64_t begin = rank * unit.shard;
    const int64_t end = begin + unit.shard;
    if (fill) {
      // Placeholders: the unit's buffer and its parameters stay without memory; the shard is
      // drawn piece by piece.
      unit.full = nn::placeholder({unit.shard * world}, options);
      for (size_t slot = 0; slot < unit.spec.parameters.size(); ++slot) {
        const size_t k = unit.spec.parameters[slot];
        point_into(parameters_[k], unit.full, unit.offsets[slot]);
        const int64_t lo = std::max(begin, unit.offsets[slot]);
        const int64_t hi = std::min(end, unit.offsets[slot] + parameters_[k].numel());
        if (lo < hi) {
          fill(k, lo - unit.offsets[slot],
               shard_params_.narrow(0, unit.base + lo - begin, hi - lo));
        }
      }
    } else {
      unit.full = at::zeros({unit.shard * world}, options);
      for (size_t slot = 0; slot < unit.spec.parameters.size(); ++slot) {
        at::Tensor& p = parameters_[unit.spec.parameters[slot]];
        unit.full.narrow(0, unit.offsets[slot], p.numel()).copy_(p.reshape({-1}));
        p.set_(unit.full.storage(), unit.offsets[slot], p.sizes(),
               c10::contiguous_strides(p.sizes()));
      }
      shard_params_.narrow(0, unit.base, unit.shard)
          .copy_(unit.full.narrow(0, rank * unit.shard, unit.shard));
      take_memory(unit.full);  // from now on its memory comes from pool_
    }
    // The optimizer's pieces: each parameter's run inside this rank's part of the unit.
    for (size_t slot = 0; slot < unit.spec.parameters.size(); ++slot) {
      const size_t k = unit.spec.parameters[slot];
      const int64_t lo = std::max(begin, unit.offsets[slot]);
      const int64_t hi = std::min(end, unit.offsets[slot] + parameters_[k].numel());
      if (lo >= hi) continue;
      Piece piece{
          k, lo - unit.offsets[slot],
          alias_storage(shard_params_, unit.base + lo - begin, {hi - lo}).requires_grad_(true)};
      piece.tensor.mutable_grad() =
          alias_unallocated(shard_grad_, unit.base + lo - begin, {hi - lo});
      pieces_.push_back(std::move(piece));
    }
    stats_.bytes_per_step += unit.shard * world * unit.full.element_size();
  }
  stats_.buckets = static_cast<int64_t>(units_.size());
  ready_.assign(parameters_.size(), false);
  hooks_ = std::make_unique<ddp::GradReadyHooks>([this](size_t k) { on_gradient(k); });
  hooks_->attach(parameters_, names_);
}

ParameterSharder::~ParameterSharder() {
  hooks_.reset();
  for (auto& unit : units_) {  // no collective may still write into freed memory
    try {
      if (unit.gather_work) unit.gather_work->wait();
      if (unit.reduce_work) unit.reduce_work->wait();
    } catch (...) {
    }
  }
}

void ParameterSharder::gather(Unit& unit, bool exact) {
  if (unit.gathered) return;
  pool_.attach(unit.full, unit.full.numel());
  unit.gathered = true;  // once gather_work completes
  const at::Tensor shard = shard_params_.narrow(0, unit.base, unit.shard);
  unit.gather_work = quantization_.enabled() && !exact
                         ? comm::quantized_allgather(*unit.comm, unit.full, shard, quantization_)
                         : unit.comm->allgather(unit.full, shard);
}

void ParameterSharder::gather_stage(size_t u, bool unless_reduced) {
  for (size_t v : {u, units_[u].partner}) {
    if (v != SIZE_MAX && !(unless_reduced && units_[v].reduced)) gather(units_[v]);
  }
}

void ParameterSharder::wait_stage(size_t u) {
  wait_gathered(units_[u]);
  if (units_[u].partner != SIZE_MAX) wait_gathered(units_[units_[u].partner]);
}

void ParameterSharder::release_stage(size_t u) {
  release(units_[u]);
  if (units_[u].partner != SIZE_MAX) release(units_[units_[u].partner]);
}

void ParameterSharder::wait_gathered(Unit& unit) {
  if (!unit.gather_work) return;
  unit.gather_work->wait();
  unit.gather_work.reset();
}

void ParameterSharder::release(Unit& unit) {
  if (!unit.gathered) return;
  wait_gathered(unit);  // the allgather must not write into freed memory
  pool_.detach(unit.full);
  unit.gathered = false;
}

at::Tensor ParameterSharder::run(const at::Tensor& input) {
  const bool grad = torch::autograd::GradMode::is_enabled();
  at::Tensor h = input;
  for (size_t i = 0; i < stages_.size(); ++i) {
    const size_t u = stages_[i];
    Unit& unit = units_[u];
    gather_stage(u);
    wait_stage(u);
    if (prefetch_ && i + 1 < stages_.size()) gather_stage(stages_[i + 1]);
    auto body = [&unit](const at::Tensor& x) {
      at::Tensor y = x;
      for (const auto& forward : unit.spec.forwards) y = forward(y);
      return y;
    };
    if (grad && unit.spec.checkpoint) {
      std::vector<at::Tensor> used;
      for (size_t k : unit.spec.parameters) used.push_back(parameters_[k]);
      if (unit.partner != SIZE_MAX) {
        for (size_t k : units_[unit.partner].spec.parameters) used.push_back(parameters_[k]);
      }
      h = memory::checkpoint(body, h, used, unit.spec.generators);
    } else {
      h = body(h);
    }
    if (grad && h.requires_grad()) {
      h.register_hook([this, i](const at::Tensor&) { pre_backward(i); });
    }
    // The last unit's backward comes first: keep it gathered when backward follows.
    if (!grad || i + 1 < stages_.size()) release_stage(u);
  }
  return h;
}

void ParameterSharder::gather_all() {
  if (quantization_.enabled()) {
    for (auto& unit : units_) release(unit);  // a quantized copy would stay
  }
  for (auto& unit : units_) gather(unit, /*exact=*/true);
  for (auto& unit : units_) wait_gathered(unit);
}

void ParameterSharder::set_sync(bool sync) {
  DTRAIN_CHECK(sync, "zero3 synchronizes every micro-batch");
}

void ParameterSharder::prepare_for_backward() {
  DTRAIN_CHECK(!in_backward_ && in_flight_.empty(),
               "zero3: a new backward pass started before finalize() of the previous one");
  hooks_->attach(parameters_, names_);
  for (auto& unit : units_) {
    unit.pending = unit.spec.parameters.size();
    unit.reduced = false;
  }
  ready_.assign(parameters_.size(), false);
}

void ParameterSharder::pre_backward(size_t i) {
  if (!in_backward_) {
    in_backward_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { on_backward_end(); });
  }
  gather_stage(stages_[i]);
  wait_stage(stages_[i]);
  if (prefetch_ && i > 0) gather_stage(stages_[i - 1], /*unless_reduced=*/true);
}

void ParameterSharder::on_gradient(size_t k) {
  const auto [u, slot] = locator_[k];
  Unit& unit = units_[u];
  at::Tensor& p = parameters_[k];
  DTRAIN_CHECK(!ready_[k] && !backward_ended_, "zero3: gradient of ", names_[k],
               " arrived twice or after backward ended");
  ready_[k] = true;
  if (!unit.grad_flat.defined()) {
    unit.grad_flat = pool_.empty(unit.full.numel(), shard_grad_.options()).zero_();
  }
  unit.grad_flat.narrow(0, unit.offsets[slot], p.numel()).copy_(p.grad().reshape({-1}));
  p.mutable_grad().reset();
  if (--unit.pending == 0) launch_reduction(unit);
  // Fold in finished reductions, and bound those in flight so unreduced gradients do not pile up
  // when communication lags backward.
  while (!in_flight_.empty() && (in_flight_.size() > ddp::kMaxReductionsInFlight ||
                                 units_[in_flight_.front()].reduce_work->is_completed())) {
    complete_reduction(units_[in_flight_.front()]);
  }
}

void ParameterSharder::launch_reduction(Unit& unit) {
  unit.reduced = true;
  release(unit);  // every use of its parameters in this backward is done
  // (An expert unit's too: summed over its expert group, the mean over every data-parallel
  // rank's examples.)
  unit.grad_flat.div_(comm_->size());
  unit.received = pool_.empty(unit.shard, shard_grad_.options());
  comm::ReduceScatterOptions options;
  options.input_is_scratch = true;
  unit.reduce_work = quantization_.enabled()
                         ? comm::quantized_reduce_scatter(*unit.comm, unit.received, unit.grad_flat,
                                                          {}, quantization_)
                         : unit.comm->reduce_scatter(unit.received, unit.grad_flat, options);
  in_flight_.push_back(static_cast<size_t>(&unit - units_.data()));
  if (!backward_ended_) ++stats_.buckets_launched_during_backward;
}

void ParameterSharder::complete_reduction(Unit& unit) {
  unit.reduce_work->wait();
  unit.reduce_work.reset();
  allocate_gradients();
  shard_grad_.narrow(0, unit.base, unit.shard).add_(unit.received);
  pool_.detach(unit.received);
  pool_.detach(unit.grad_flat);
  unit.received.reset();
  unit.grad_flat.reset();
  in_flight_.erase(
      std::find(in_flight_.begin(), in_flight_.end(), static_cast<size_t>(&unit - units_.data())));
}

void ParameterSharder::on_backward_end() {
  if (backward_ended_) return;
  backward_ended_ = true;
  backward_end_time_ = std::chrono::steady_clock::now();
  stats_.unused_parameters.clear();
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (!ready_[k]) stats_.unused_parameters.push_back(names_[k]);
  }
  // Units with parameters that got no gradient still reduce (those count as zero), in unit
  // order from the last, so every rank issues the same collectives.
  for (size_t u = units_.size(); u-- > 0;) {
    Unit& unit = units_[u];
    if (unit.reduced) continue;
    if (!unit.grad_flat.defined()) {
      unit.grad_flat = pool_.empty(unit.full.numel(), shard_grad_.options()).zero_();
    }
    launch_reduction(unit);
  }
  for (auto& unit : units_) release(unit);
}

void ParameterSharder::finalize() {
  if (!in_backward_) stats_.buckets_launched_during_backward = 0;
  if (!backward_ended_) on_backward_end();  // no gradient reached any hook
  while (!in_flight_.empty()) complete_reduction(units_[in_flight_.front()]);
  stats_.exposed_comm_ms = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - backward_end_time_)
                               .count();
  stats_.peak_transient_bytes = pool_.peak();
  in_backward_ = false;
  backward_ended_ = false;
  if (error_on_unused_ && !stats_.unused_parameters.empty()) {
    std::string names;
    for (const auto& name : stats_.unused_parameters) names += (names.empty() ? "" : ", ") + name;
    DTRAIN_THROW(Error, "rank ", comm_->rank(),
                 ": parameters received no gradient this step: ", names,
                 " (turn off error_on_unused_parameters to treat them as zero)");
  }
}

void ParameterSharder::allocate_gradients() {
  if (shard_grad_.storage().nbytes() > 0 || shard_grad_.numel() == 0) return;
  give_memory(shard_grad_);
  shard_grad_.zero_();
}

void ParameterSharder::zero_grad() {
  allocate_gradients();
  shard_grad_.zero_();
  for (auto& p : parameters_) p.mutable_grad().reset();
  pool_.reset_peak();
  stats_.buckets_launched_during_backward = 0;
}

}  // namespace dtrain::parallel::zero
