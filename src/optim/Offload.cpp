// Offloaded optimizer state: buckets of parameter chunks, each stepped by the optimizer's own
// class, with its state in host memory or in a file read ahead and written behind.
#include "dtrain/optim/Offload.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <future>
#include <system_error>
#include <utility>

#include "common/StorageMemory.h"
#include "dtrain/common/Error.h"

namespace dtrain::optim {

namespace {

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// What `make`'s optimizer keeps per parameter, from one step of it on a throwaway element:
// its options (the learning rate the schedule sets), the element-wise state's names and the
// scalar state's.
struct Probe {
  std::unique_ptr<torch::optim::OptimizerOptions> defaults;
  std::vector<std::string> elementwise;
  ParamState scalar_zeros;  // "step" and the like, at 0
};

Probe probe(const OptimizerFactory& make, const std::vector<at::Tensor>& parameters) {
  const at::ScalarType dtype = parameters.empty() ? at::kFloat : parameters.front().scalar_type();
  at::Tensor dummy = at::zeros({1}, at::TensorOptions().dtype(dtype));
  dummy.mutable_grad() = at::zeros_like(dummy);
  OptimizerPtr reference = make({dummy});
  {
    at::NoGradGuard no_grad;
    reference->step();
  }
  Probe out;
  out.defaults = reference->defaults().clone();
  for (const auto& [name, value] : get_param_state(*reference, dummy)) {
    if (value.dim() == 0) {
      out.scalar_zeros[name] = at::zeros_like(value);
    } else {
      out.elementwise.push_back(name);
    }
  }
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> one_group(const std::vector<at::Tensor>& params) {
  return {torch::optim::OptimizerParamGroup(params)};
}

}  // namespace

OffloadSpec parse_offload(const std::string& flag, int64_t bucket_mb) {
  OffloadSpec spec;
  DTRAIN_CHECK_INPUT(bucket_mb > 0, "--offload-bucket-mb must be > 0, got ", bucket_mb);
  spec.bucket_elements = bucket_mb * (int64_t{1} << 20) / 4;
  if (flag.empty() || flag == "none") return spec;
  const std::string prefix = "optimizer:";
  if (flag == "optimizer") {
    spec.enabled = true;
  } else if (flag.compare(0, prefix.size(), prefix) == 0 && flag.size() > prefix.size()) {
    spec.enabled = true;
    spec.dir = flag.substr(prefix.size());
  } else {
    DTRAIN_THROW(InputError, "--offload ", flag,
                 ": expected none, optimizer (state in host memory) or optimizer:DIR (state in "
                 "a file under DIR)");
  }
  return spec;
}

// The state's file: made in the folder and unlinked at once, so that nothing is left behind
// however the process ends (its room shows in df, not in ls). Its whole size is reserved first.
class StateFile {
 public:
  StateFile(const std::string& dir, int64_t bytes) : dir_(dir) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    DTRAIN_CHECK_INPUT(!error, "--offload optimizer:", dir, ": cannot make the folder (",
                       error.message(), ")");
    std::string name = dir + "/dtrain-optimizer-state-XXXXXX";
    fd_ = ::mkstemp(name.data());
    DTRAIN_CHECK_INPUT(fd_ >= 0, "--offload optimizer:", dir, ": cannot write a file there (",
                       std::strerror(errno), ")");
    ::unlink(name.c_str());
    try {
      reserve(0, bytes);
    } catch (...) {
      ::close(fd_);  // a constructor that throws runs no destructor
      throw;
    }
  }
  // Room for `bytes` more from `offset`: reserved now, so a full device fails here, naming it.
  void reserve(int64_t offset, int64_t bytes) {
    if (bytes == 0) return;
    const int failed = ::posix_fallocate(fd_, offset, bytes);
    if (failed != 0) {
      std::error_code error;
      const auto space = std::filesystem::space(dir_, error);
      DTRAIN_THROW(
          InputError, "--offload optimizer:", dir_, ": cannot reserve ", gib(bytes),
          " GiB for the optimizer state (", std::strerror(failed),
          error ? std::string()
                : "; the folder's device has " + std::to_string(gib(space.available)) + " GiB free",
          ")");
    }
  }
  ~StateFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Reads and writes leave nothing in the page cache (written through, then dropped): the
  // state streams from and to the disk and its pages never compete with the model's memory
  // (dirty pages charged to a memory-limited job can end it before they are written back).
  void read(int64_t offset, void* data, int64_t bytes) const {
    const int64_t start = offset, length = bytes;
    auto* out = static_cast<char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, out, static_cast<size_t>(bytes), offset);
      if (n < 0 && errno == EINTR) continue;
      DTRAIN_CHECK(n > 0, "--offload optimizer:", dir_, ": reading the optimizer state failed (",
                   n < 0 ? std::strerror(errno) : "end of file", ")");
      out += n;
      offset += n;
      bytes -= n;
    }
    ::posix_fadvise(fd_, start, length, POSIX_FADV_DONTNEED);
  }
  void write(int64_t offset, const void* data, int64_t bytes) const {
    const int64_t start = offset, length = bytes;
    const auto* in = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, in, static_cast<size_t>(bytes), offset);
      if (n < 0 && errno == EINTR) continue;
      DTRAIN_CHECK(n > 0, "--offload optimizer:", dir_, ": writing the optimizer state failed (",
                   std::strerror(errno), ")");
      in += n;
      offset += n;
      bytes -= n;
    }
    DTRAIN_CHECK(::sync_file_range(fd_, start, length,
                                   SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                       SYNC_FILE_RANGE_WAIT_AFTER) == 0,
                 "--offload optimizer:", dir_, ": writing the optimizer state failed (",
                 std::strerror(errno), ")");
    ::posix_fadvise(fd_, start, length, POSIX_FADV_DONTNEED);
  }

 private:
  std::string dir_;
  int fd_ = -1;
};

// A bucket's state on its way from or to the file: the tensors, and the reads or writes of them
// running on another thread.
struct OffloadedOptimizer::Pending {
  size_t bucket;
  std::vector<std::pair<size_t, ParamState>> states;  // chunk, its element-wise state
  std::vector<at::DataPtr> values;  // parameters kept in the file: their memory, until written
  std::future<void> io;
};

OffloadedOptimizer::OffloadedOptimizer(std::vector<at::Tensor> parameters,
                                       const OptimizerFactory& make, OffloadSpec spec)
    : torch::optim::Optimizer(one_group(parameters), probe(make, parameters).defaults),
      parameters_(std::move(parameters)),
      spec_(std::move(spec)),
      make_(make) {
  DTRAIN_CHECK_INPUT(spec_.bucket_elements > 0, "offload buckets must hold elements");
  const Probe kept = probe(make, parameters_);
  names_ = kept.elementwise;
  scalar_zeros_ = kept.scalar_zeros;
  // Chunks: parameters in order, cut where a bucket fills.
  int64_t room = 0;
  for (size_t k = 0; k < parameters_.size(); ++k) {
    const at::Tensor& p = parameters_[k];
    DTRAIN_CHECK(p.is_contiguous(), "offload: parameter ", k, " is not contiguous");
    copy_ = copy_ || spec_.copy_to_host || !p.device().is_cpu();
    for (int64_t offset = 0; offset < p.numel();) {
      if (room == 0) {
        buckets_.emplace_back();
        room = spec_.bucket_elements;
      }
      const int64_t numel = std::min(room, p.numel() - offset);
      buckets_.back().push_back(chunks_.size());
      chunks_.push_back({k, offset, numel, buckets_.size() - 1, {}, file_bytes_, -1, false, {}});
      file_bytes_ +=
          static_cast<int64_t>(names_.size()) * numel * static_cast<int64_t>(p.element_size());
      offset += numel;
      room -= numel;
    }
  }
  for (Chunk& chunk : chunks_) {
    const at::Tensor& p = parameter_of(chunk);
    if (copy_) {
      at::TensorOptions host = p.options().device(at::kCPU).requires_grad(false);
      if (p.is_cuda()) host = host.pinned_memory(true);
      chunk.view = at::empty({chunk.numel}, host);
      chunk.view.copy_(slice(p, chunk));
    } else {
      chunk.view = slice(p, chunk);
    }
  }
  for (const at::Tensor& p : parameters_) synced_.push_back(p._version());
  if (!spec_.dir.empty()) file_ = std::make_unique<StateFile>(spec_.dir, file_bytes_);
  for (const auto& bucket : buckets_) {
    std::vector<at::Tensor> views;
    for (size_t c : bucket) views.push_back(chunks_[c].view);
    optimizers_.push_back(make(std::move(views)));
    // An optimizer that makes its state at once (Adagrad's sums) puts it in the file now.
    if (file_) {
      auto pending = start_evict(optimizers_.size() - 1);
      if (pending->io.valid()) pending->io.get();
    }
  }
}

OffloadedOptimizer::~OffloadedOptimizer() = default;

at::Tensor OffloadedOptimizer::slice(const at::Tensor& t, const Chunk& chunk) const {
  return t.detach().reshape({-1}).narrow(0, chunk.offset, chunk.numel);
}

std::vector<size_t> OffloadedOptimizer::chunks_of(const at::Tensor& parameter) const {
  std::vector<size_t> out;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (parameter_of(chunks_[c]).unsafeGetTensorImpl() == parameter.unsafeGetTensorImpl()) {
      out.push_back(c);
    }
  }
  return out;
}

ParamState OffloadedOptimizer::read_state(const Chunk& chunk) const {
  ParamState state = chunk.scalars;
  int64_t offset = chunk.file_base;
  for (const std::string& name : names_) {
    at::Tensor t = at::empty({chunk.numel}, chunk.view.options());
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    file_->read(offset, t.data_ptr(), bytes);
    offset += bytes;
    state[name] = std::move(t);
  }
  return state;
}

void OffloadedOptimizer::write_state(const Chunk& chunk, const ParamState& state) const {
  int64_t offset = chunk.file_base;
  for (const std::string& name : names_) {
    auto it = state.find(name);
    DTRAIN_CHECK_INPUT(it != state.end(), "optimizer state without '", name, "'");
    const at::Tensor t = it->second.to(chunk.view.options()).contiguous();
    DTRAIN_CHECK_INPUT(t.numel() == chunk.numel, "optimizer state '", name, "' has ", t.numel(),
                       " elements for ", chunk.numel);
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    file_->write(offset, t.data_ptr(), bytes);
    offset += bytes;
  }
}

std::unique_ptr<OffloadedOptimizer::Pending> OffloadedOptimizer::start_load(size_t bucket) {
  auto pending = std::make_unique<Pending>();
  pending->bucket = bucket;
  std::vector<std::pair<void*, int64_t>> reads;  // destination, bytes; file offsets follow
  std::vector<int64_t> offsets;
  for (size_t c : buckets_[bucket]) {
    const Chunk& chunk = chunks_[c];
    if (paged_) {  // the values first: the optimizer steps them
      give_memory(chunk.view);
      reads.emplace_back(chunk.view.data_ptr(),
                         chunk.numel * static_cast<int64_t>(chunk.view.element_size()));
      offsets.push_back(chunk.value_base);
    }
    if (!chunk.present) continue;
    ParamState state;
    int64_t offset = chunk.file_base;
    for (const std::string& name : names_) {
      at::Tensor t = at::empty({chunk.numel}, chunk.view.options());
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      reads.emplace_back(t.data_ptr(), bytes);
      offsets.push_back(offset);
      offset += bytes;
      state[name] = std::move(t);
    }
    pending->states.emplace_back(c, std::move(state));
  }
  if (reads.empty()) return pending;
  pending->io = std::async(std::launch::async, [this, reads, offsets] {
    for (size_t i = 0; i < reads.size(); ++i)
      file_->read(offsets[i], reads[i].first, reads[i].second);
  });
  return pending;
}

void OffloadedOptimizer::finish_load(Pending& pending) {
  if (pending.io.valid()) pending.io.get();
  for (auto& [c, state] : pending.states) {
    const Chunk& chunk = chunks_[c];
    for (const auto& [name, value] : chunk.scalars) state[name] = value.clone();
    adopt_param_state(*optimizers_[pending.bucket], chunk.view, std::move(state));
  }
}

std::unique_ptr<OffloadedOptimizer::Pending> OffloadedOptimizer::start_evict(size_t bucket) {
  auto pending = std::make_unique<Pending>();
  pending->bucket = bucket;
  std::vector<std::pair<const void*, int64_t>> writes;
  std::vector<int64_t> offsets;
  torch::optim::Optimizer& optimizer = *optimizers_[bucket];
  for (size_t c : buckets_[bucket]) {
    Chunk& chunk = chunks_[c];
    if (paged_) {  // the values, then the view's memory goes with the write
      writes.emplace_back(chunk.view.data_ptr(),
                          chunk.numel * static_cast<int64_t>(chunk.view.element_size()));
      offsets.push_back(chunk.value_base);
      pending->values.push_back(take_memory(chunk.view));
    }
    ParamState state = get_param_state(optimizer, chunk.view);
    if (state.empty()) continue;
    chunk.present = true;
    chunk.scalars.clear();
    ParamState elementwise;
    int64_t offset = chunk.file_base;
    for (const std::string& name : names_) {
      auto it = state.find(name);
      DTRAIN_CHECK(it != state.end(), "offload: the optimizer's state has no '", name, "'");
      at::Tensor t = it->second.contiguous();
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      writes.emplace_back(t.data_ptr(), bytes);
      offsets.push_back(offset);
      offset += bytes;
      elementwise[name] = std::move(t);
    }
    for (auto& [name, value] : state) {
      if (value.dim() == 0) chunk.scalars[name] = value.clone();
    }
    set_param_state(optimizer, chunk.view, {});  // out of memory once written
    pending->states.emplace_back(c, std::move(elementwise));
  }
  if (writes.empty()) return pending;  // nothing to write (no thread for it)
  pending->io = std::async(std::launch::async, [this, writes, offsets] {
    for (size_t i = 0; i < writes.size(); ++i) {
      file_->write(offsets[i], writes[i].first, writes[i].second);
    }
  });
  return pending;
}

void OffloadedOptimizer::refresh_copies() {
  for (Chunk& chunk : chunks_) {
    const at::Tensor& p = parameter_of(chunk);
    if (p._version() != synced_[chunk.parameter]) chunk.view.copy_(slice(p, chunk));
  }
  for (size_t k = 0; k < parameters_.size(); ++k) synced_[k] = parameters_[k]._version();
}

at::Tensor OffloadedOptimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  const double lr = param_groups().at(0).options().get_lr();
  if (copy_) refresh_copies();
  std::unique_ptr<Pending> loading = file_ ? start_load(0) : nullptr;
  std::vector<std::unique_ptr<Pending>> writing;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::unique_ptr<Pending> next;
    if (file_) {
      finish_load(*loading);
      if (b + 1 < buckets_.size()) next = start_load(b + 1);
    }
    for (size_t c : buckets_[b]) {
      Chunk& chunk = chunks_[c];
      const at::Tensor& grad = parameter_of(chunk).grad();
      if (!grad.defined()) {
        chunk.view.mutable_grad().reset();
      } else if (copy_) {
        chunk.view.mutable_grad() = at::empty_like(chunk.view).copy_(slice(grad, chunk));
      } else {
        chunk.view.mutable_grad() = slice(grad, chunk);
      }
    }
    torch::optim::Optimizer& optimizer = *optimizers_[b];
    for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
    optimizer.step();
    for (size_t c : buckets_[b]) {
      Chunk& chunk = chunks_[c];
      if (copy_ && chunk.view.grad().defined()) {
        slice(parameter_of(chunk), chunk).copy_(chunk.view);
      }
      if (paged_) slice(rounded_into_[chunk.parameter], chunk).copy_(chunk.view);
      chunk.view.mutable_grad().reset();
    }
    if (copy_) {
      for (size_t c : buckets_[b])
        synced_[chunks_[c].parameter] = parameter_of(chunks_[c])._version();
    }
    if (file_) {
      // At most one bucket written behind the step: the state in memory stays three buckets'.
      if (!writing.empty()) {
        if (writing.back()->io.valid()) writing.back()->io.get();
        writing.clear();
      }
      writing.push_back(start_evict(b));
      loading = std::move(next);
    }
  }
  for (auto& pending : writing) {
    if (pending->io.valid()) pending->io.get();
  }
  return loss;
}

void OffloadedOptimizer::keep_parameters_in_file(std::vector<at::Tensor> rounded_into) {
  DTRAIN_CHECK(file_, "offload: parameters are kept in the file of --offload optimizer:DIR only");
  DTRAIN_CHECK(!copy_ && !paged_, "offload: the parameters are copies or in the file already");
  DTRAIN_CHECK(rounded_into.size() == parameters_.size(), "offload: ", rounded_into.size(),
               " tensors to round into for ", parameters_.size(), " parameters");
  for (size_t k = 0; k < parameters_.size(); ++k) {
    DTRAIN_CHECK(
        rounded_into[k].numel() == parameters_[k].numel() && rounded_into[k].is_contiguous(),
        "offload: parameter ", k, " rounds into a tensor of another size");
  }
  int64_t bytes = 0;
  for (Chunk& chunk : chunks_) {
    chunk.value_base = file_bytes_ + bytes;
    bytes += chunk.numel * static_cast<int64_t>(parameter_of(chunk).element_size());
  }
  file_->reserve(file_bytes_, bytes);
  file_bytes_ += bytes;
  rounded_into_ = std::move(rounded_into);
  paged_ = true;
  write_parameters();
  // Each chunk becomes a tensor of its own, with memory only during its bucket's step; the
  // buckets' optimizers are built again over them (their state is in the file, none in memory).
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::vector<at::Tensor> views;
    for (size_t c : buckets_[b]) {
      Chunk& chunk = chunks_[c];
      chunk.view =
          tensor_without_memory({chunk.numel}, parameter_of(chunk).options().requires_grad(false));
      views.push_back(chunk.view);
    }
    optimizers_[b] = make_(views);
    for (const at::Tensor& view : views) set_param_state(*optimizers_[b], view, {});
  }
}

void OffloadedOptimizer::read_parameters() const {
  DTRAIN_CHECK(paged_, "offload: the parameters are not kept in the file");
  for (const Chunk& chunk : chunks_) {
    at::Tensor values = slice(parameter_of(chunk), chunk);
    DTRAIN_CHECK(values.storage().nbytes() > 0, "offload: parameter ", chunk.parameter,
                 " has no memory to read its values into");
    file_->read(chunk.value_base, values.data_ptr(),
                chunk.numel * static_cast<int64_t>(values.element_size()));
  }
}

void OffloadedOptimizer::write_parameters() {
  DTRAIN_CHECK(paged_, "offload: the parameters are not kept in the file");
  at::NoGradGuard no_grad;
  for (const Chunk& chunk : chunks_) {
    const at::Tensor values = slice(parameter_of(chunk), chunk).contiguous();
    file_->write(chunk.value_base, values.data_ptr(),
                 chunk.numel * static_cast<int64_t>(values.element_size()));
    slice(rounded_into_[chunk.parameter], chunk).copy_(values);
  }
}

ParamState OffloadedOptimizer::state_of(const at::Tensor& parameter) const {
  std::vector<ParamState> parts;
  for (size_t c : chunks_of(parameter)) {
    const Chunk& chunk = chunks_[c];
    if (file_) {
      parts.push_back(chunk.present ? read_state(chunk) : ParamState{});
    } else {
      parts.push_back(get_param_state(*optimizers_[chunk.bucket], chunk.view));
    }
    if (parts.back().empty()) return {};
  }
  if (parts.empty()) return {};
  ParamState whole;
  for (const auto& [name, value] : parts.front()) {
    if (value.dim() == 0) {
      whole[name] = value.clone();
      continue;
    }
    std::vector<at::Tensor> pieces;
    for (const ParamState& part : parts) pieces.push_back(part.at(name));
    whole[name] = at::cat(pieces);
  }
  return whole;
}

void OffloadedOptimizer::set_state_of(const at::Tensor& parameter, const ParamState& state) {
  for (size_t c : chunks_of(parameter)) {
    Chunk& chunk = chunks_[c];
    torch::optim::Optimizer& optimizer = *optimizers_[chunk.bucket];
    if (state.empty()) {
      chunk.present = false;
      chunk.scalars.clear();
      set_param_state(optimizer, chunk.view, {});
      continue;
    }
    ParamState part;
    for (const auto& [name, value] : state) {
      if (value.dim() == 0) {
        part[name] = value.clone();
        continue;
      }
      DTRAIN_CHECK_INPUT(value.numel() == parameter.numel(), "optimizer state '", name, "' has ",
                         value.numel(), " elements for a parameter of ", parameter.numel());
      part[name] = value.reshape({-1}).narrow(0, chunk.offset, chunk.numel);
    }
    if (!file_) {
      set_param_state(optimizer, chunk.view, part);
      continue;
    }
    write_state(chunk, part);
    chunk.present = true;
    chunk.scalars.clear();
    for (const auto& [name, value] : part) {
      if (value.dim() == 0) chunk.scalars[name] = value;
    }
  }
}

ParamState OffloadedOptimizer::state_to_fill(const at::Tensor& parameter) const {
  ParamState state = state_of(parameter);
  if (!state.empty()) return state;
  if (chunks_of(parameter).empty()) return state;
  state = scalar_zeros_;
  for (const std::string& name : names_) {
    state[name] = at::zeros({parameter.numel()}, parameter.options().requires_grad(false));
  }
  return state;
}

int64_t OffloadedOptimizer::resident_state_bytes() const {
  int64_t total = 0;
  for (const auto& optimizer : optimizers_) total += optimizer_state_bytes(*optimizer);
  return total;
}

int64_t OffloadedOptimizer::file_bytes() const { return file_ ? file_bytes_ : 0; }

OptimizerFactory offloaded_factory(OptimizerFactory make, OffloadSpec spec) {
  if (!spec.enabled) return make;
  return [make = std::move(make), spec](std::vector<at::Tensor> parameters) -> OptimizerPtr {
    bool on_cpu = true;
    for (const auto& p : parameters) on_cpu = on_cpu && p.device().is_cpu();
    if (spec.dir.empty() && on_cpu && !spec.copy_to_host) return make(std::move(parameters));
    return std::make_unique<OffloadedOptimizer>(std::move(parameters), make, spec);
  };
}

}  // namespace dtrain::optim
