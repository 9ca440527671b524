#include "dtrain/services/ps/ParameterShard.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/optim/Optimizers.h"

namespace dtrain::services::ps {

namespace {

// The shard's optimizer as optim's flat rule (bias-corrected Adam per element: pushes may
// cover parts of the shard).
optim::FlatRule flat_rule(const ShardOptimizer& o) {
  check_shard_optimizer(o);
  optim::FlatRule rule;
  rule.name = o.name;
  rule.initial_accumulator = o.initial_accumulator;
  rule.adagrad_eps = o.eps;
  rule.beta1 = o.beta1;
  rule.beta2 = o.beta2;
  rule.adam_eps = o.adam_eps;
  return rule;
}

// The state's names in shard checkpoints.
const std::pair<const char*, const char*> kStateNames[] = {
    {"first", "state1"}, {"second", "state2"}, {"steps", "steps"}};

}  // namespace

void check_shard_optimizer(const ShardOptimizer& optimizer) {
  const std::string& name = optimizer.name;
  DTRAIN_CHECK_INPUT(optim::has_flat_rule(name), "unknown parameter-server optimizer '", name,
                     "' (", optim::flat_rule_names(), ")");
  DTRAIN_CHECK_INPUT(optimizer.lr > 0, "the parameter server's learning rate must be > 0, got ",
                     optimizer.lr);
  const std::string& decay = optimizer.schedule.decay;
  DTRAIN_CHECK_INPUT(decay == "constant" || decay == "step" || decay == "cosine",
                     "--lr-decay: unknown schedule '", decay, "' (constant, step or cosine)");
  DTRAIN_CHECK_INPUT(optimizer.schedule.warmup_steps >= 0 && optimizer.total_versions >= 0,
                     "the parameter server's warmup and total versions must be >= 0");
  DTRAIN_CHECK_INPUT(decay != "cosine" || optimizer.total_versions > 0,
                     "--lr-decay cosine on the parameter server needs --total-versions (the "
                     "updates the schedule spans)");
  DTRAIN_CHECK_INPUT(decay != "step" || optimizer.schedule.step_size > 0,
                     "--lr-step-size must be > 0");
}

ParameterShard::ParameterShard(int shard, int shards, ShardOptimizer optimizer)
    : shard_(shard),
      shards_(shards),
      optimizer_(std::move(optimizer)),
      flat_(flat_rule(optimizer_)) {
  DTRAIN_CHECK_INPUT(shards >= 1 && shard >= 0 && shard < shards, "--shard ", shard, "/", shards,
                     ": expected I/N with 0 <= I < N");
}

namespace {

double lr_at(const ShardOptimizer& o, int64_t version) {
  if (o.schedule.decay == "constant" && o.schedule.warmup_steps == 0) return o.lr;
  return optim::LrSchedule(o.lr, std::max<int64_t>(o.total_versions, 1), o.schedule).at(version);
}

}  // namespace

double ParameterShard::current_lr() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lr_at(optimizer_, version_);
}

std::string ParameterShard::check_gradient(int64_t begin, const at::Tensor& gradient) const {
  if (!initialized_) return "the shard has no parameters yet (Initialize first)";
  const int64_t n = gradient.numel();
  if (gradient.scalar_type() != values_.scalar_type()) {
    return concat("a gradient of ", gradient.scalar_type(), " for a shard of ",
                  values_.scalar_type(), " parameters");
  }
  if (gradient.dim() != 1 || begin < begin_ || begin + n > end_) {
    return concat("a gradient for [", begin, ", ", begin + n, ") is outside the shard's range [",
                  begin_, ", ", end_, ")");
  }
  return parallel::ps::check_finite(gradient, begin);
}

std::string ParameterShard::vector_ops(const std::vector<parallel::ps::VectorOp>& ops,
                                       std::vector<double>* dots) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!initialized_) return "the shard has no parameters yet (Initialize first)";
  // Checked whole first, against the vectors that will exist when each op runs.
  std::set<std::string> names{"x"};
  for (const auto& [name, tensor] : vectors_) names.insert(name);
  for (size_t i = 0; i < ops.size(); ++i) {
    const parallel::ps::VectorOp& op = ops[i];
    const std::string where = concat("vector op ", i);
    auto valid_name = [](const std::string& n) {
      return !n.empty() && n.size() <= parallel::ps::kMaxVectorName;
    };
    if (!valid_name(op.dst)) {
      return concat(where, ": field 'dst' must name a vector (1 to ", parallel::ps::kMaxVectorName,
                    " characters)");
    }
    const bool reads_src = op.kind == parallel::ps::VectorOp::Copy ||
                           op.kind == parallel::ps::VectorOp::Axpy ||
                           op.kind == parallel::ps::VectorOp::Dot;
    if (reads_src && names.count(op.src) == 0) {
      return concat(where, ": field 'src' names vector '",
                    op.src.substr(0, parallel::ps::kMaxVectorName),
                    "', which the shard does not have");
    }
    if (!reads_src && !op.src.empty())
      return concat(where, ": field 'src' must be empty for this kind");
    const bool creates =
        op.kind == parallel::ps::VectorOp::Zero || op.kind == parallel::ps::VectorOp::Copy;
    if (!creates && names.count(op.dst) == 0) {
      return concat(where, ": field 'dst' names vector '", op.dst,
                    "', which the shard does not have");
    }
    if (!std::isfinite(op.alpha)) return concat(where, ": field 'alpha' is not finite");
    const bool uses_alpha =
        op.kind == parallel::ps::VectorOp::Scale || op.kind == parallel::ps::VectorOp::Axpy;
    if (!uses_alpha && op.alpha != 0.0)
      return concat(where, ": field 'alpha' must be 0 for this kind");
    if (op.round < 0 || (op.round > 0 && op.kind != parallel::ps::VectorOp::Zero)) {
      return concat(where, ": field 'round' is ", op.round,
                    " (ZERO may open a round > 0; other "
                    "ops carry 0)");
    }
    if (creates) names.insert(op.dst);
    if (static_cast<int>(names.size()) > parallel::ps::kMaxVectors + 1) {
      return concat(where, ": more than ", parallel::ps::kMaxVectors, " vectors on one shard");
    }
  }
  // The ops write into copies of the vectors they change, kept only if the parameters stay
  // finite (an overflowing SCALE or AXPY into x is refused as a whole, like a bad field).
  std::map<std::string, at::Tensor> staged;
  auto read = [&](const std::string& name) -> const at::Tensor& {
    if (const auto found = staged.find(name); found != staged.end()) return found->second;
    if (name == "x") return values_;
    return vectors_.at(name);
  };
  auto write = [&](const std::string& name) -> at::Tensor& {
    if (const auto found = staged.find(name); found != staged.end()) return found->second;
    at::Tensor copy = read(name).clone();
    return staged[name] = std::move(copy);
  };
  const size_t dots_before = dots->size();
  for (const parallel::ps::VectorOp& op : ops) {
    switch (op.kind) {
      case parallel::ps::VectorOp::Zero:
        staged[op.dst] = at::zeros_like(values_);
        break;
      case parallel::ps::VectorOp::Copy:
        staged[op.dst] = read(op.src).clone();
        break;
      case parallel::ps::VectorOp::Scale:
        write(op.dst).mul_(op.alpha);
        break;
      case parallel::ps::VectorOp::Axpy:
        write(op.dst).add_(read(op.src), op.alpha);
        break;
      case parallel::ps::VectorOp::Dot:
        dots->push_back(
            at::dot(read(op.dst).to(at::kDouble), read(op.src).to(at::kDouble)).item<double>());
        break;
    }
  }
  if (const auto x = staged.find("x"); x != staged.end()) {
    std::string why = parallel::ps::check_finite(x->second, begin_);
    if (!why.empty()) {
      dots->resize(dots_before);
      return concat("the ops would leave the parameters non-finite (",
                    why.substr(why.find(": ") + 2), "); nothing changed");
    }
  }
  for (auto& [name, tensor] : staged) {
    // A share() view of the old values keeps them: that view stays one version.
    if (name == "x") {
      values_ = std::move(tensor);
    } else {
      vectors_[name] = std::move(tensor);
    }
  }
  for (const parallel::ps::VectorOp& op : ops) {
    if (op.kind == parallel::ps::VectorOp::Zero && op.round > 0)
      rounds_[op.dst] = Round{op.round, {}};
  }
  return "";
}

std::string ParameterShard::accumulate(const std::string& name, int64_t begin,
                                       const at::Tensor& gradient, int64_t round, int64_t unit,
                                       bool* ignored) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ignored != nullptr) *ignored = false;
  if (round < 0) return concat("field 'round' is ", round, " (0 or a round > 0)");
  if (round > 0 && (unit < 0 || unit >= parallel::ps::kMaxUnits)) {
    return concat("field 'unit' is ", unit, " (0 to ", parallel::ps::kMaxUnits - 1, ")");
  }
  if (std::string why = check_gradient(begin, gradient); !why.empty()) return why;
  const int64_t n = gradient.numel();
  if (name == "x") return "field 'accumulate' may not name the parameters 'x'";
  if (name.size() > parallel::ps::kMaxVectorName) {
    return concat("field 'accumulate' is ", name.size(), " characters long (at most ",
                  parallel::ps::kMaxVectorName, ")");
  }
  const auto found = vectors_.find(name);
  if (found == vectors_.end()) {
    return concat("field 'accumulate' names vector '", name, "', which the shard does not have");
  }
  if (round > 0) {
    const auto open = rounds_.find(name);
    if (open == rounds_.end() || open->second.round != round ||
        !open->second.units.insert(unit).second) {
      if (ignored != nullptr) *ignored = true;
      return "";
    }
  }
  found->second.narrow(0, begin - begin_, n).add_(gradient);
  return "";
}

void ParameterShard::mark_done(int worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  WorkerRecord& record = workers_[worker];
  if (record.pushes == 0) record.last_push = std::chrono::steady_clock::now();
  record.finished = true;
}

void ParameterShard::count_refusal(int worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  WorkerRecord& record = workers_[worker];
  if (record.pushes == 0 && record.refused == 0)
    record.last_push = std::chrono::steady_clock::now();
  ++record.refused;
}

std::vector<int64_t> ParameterShard::staleness_histogram() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return staleness_counts_;
}

std::map<int, WorkerRecord> ParameterShard::workers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return workers_;
}

std::string ParameterShard::initialize(int64_t total, const at::Tensor& values) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (initialized_) return "initialized";
  if (total < shards_)
    return concat("field 'total' is ", total, ", fewer parameters than the ", shards_, " shards");
  const auto [begin, end] = parallel::ps::shard_range(total, shard_, shards_);
  if (values.scalar_type() != at::kFloat && values.scalar_type() != at::kDouble) {
    return concat("the initial values are ", values.scalar_type(),
                  " (a shard holds float32 or "
                  "float64 parameters)");
  }
  if (values.dim() != 1 || values.numel() != end - begin) {
    return concat("the initial values hold ", values.numel(), " elements, shard ", shard_, "/",
                  shards_, " of ", total, " parameters holds ", end - begin);
  }
  begin_ = begin;
  end_ = end;
  total_ = total;
  values_ = values.clone();
  flat_.init(values_);
  version_ = 0;
  initialized_ = true;
  return "";
}

at::ScalarType ParameterShard::dtype() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return initialized_ ? values_.scalar_type() : at::kFloat;
}

bool ParameterShard::initialized() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return initialized_;
}
int64_t ParameterShard::begin() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return begin_;
}
int64_t ParameterShard::end() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return end_;
}
int64_t ParameterShard::total() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return total_;
}
int64_t ParameterShard::version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return version_;
}

at::Tensor ParameterShard::read(int64_t begin, int64_t end, int64_t* version) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK(initialized_ && begin >= begin_ && end <= end_ && begin <= end, "read of [", begin,
               ", ", end, ") from shard [", begin_, ", ", end_, ")");
  if (version) *version = version_;
  return values_.narrow(0, begin - begin_, end - begin).clone();
}

at::Tensor ParameterShard::share(int64_t begin, int64_t end, int64_t* version) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK(initialized_ && begin >= begin_ && end <= end_ && begin <= end, "read of [", begin,
               ", ", end, ") from shard [", begin_, ", ", end_, ")");
  if (version) *version = version_;
  return values_.narrow(0, begin - begin_, end - begin);
}

void ParameterShard::own_values() {
  // values_ holds one reference to its storage; every view handed out by share() one more.
  if (values_.storage().use_count() > 1) values_ = values_.clone();
}

std::string ParameterShard::apply(int64_t begin, const at::Tensor& gradient,
                                  int64_t computed_version, int worker, bool last, int64_t* version,
                                  int64_t* staleness, double* applied_lr) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::string why = check_gradient(begin, gradient); !why.empty()) return why;
  if (computed_version < 0 || computed_version > version_) {
    return concat("field 'computed_version' is ", computed_version,
                  ", but the shard is at version ", version_, " (a version from the future)");
  }
  own_values();
  const double lr = lr_at(optimizer_, version_);
  flat_.step(values_, begin - begin_, gradient, lr);
  const int64_t stale = version_ - computed_version;
  ++staleness_counts_[std::min<int64_t>(stale, kStalenessBins - 1)];
  WorkerRecord& record = workers_[worker];
  ++record.pushes;
  record.last_push = std::chrono::steady_clock::now();
  record.finished = last;
  if (staleness) *staleness = stale;
  if (applied_lr) *applied_lr = lr;
  ++version_;
  if (version) *version = version_;
  return "";
}

int64_t ParameterShard::save(const std::string& path) const {
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  int64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!initialized_) return -1;
    version = version_;
    file.insert("format", "dtrain-ps-shard-1");
    file.insert("shard", static_cast<int64_t>(shard_));
    file.insert("shards", static_cast<int64_t>(shards_));
    file.insert("optimizer", optimizer_.name);
    file.insert("total", total_);
    file.insert("version", version_);
    c10::Dict<std::string, at::Tensor> tensors;
    tensors.insert("values", values_.clone());
    for (const auto& [name, tensor] : flat_.state()) {
      for (const auto& [flat_name, saved_name] : kStateNames) {
        if (name == flat_name) tensors.insert(saved_name, tensor.clone());
      }
    }
    tensors.insert("staleness", at::tensor(staleness_counts_, at::kLong));
    file.insert("tensors", tensors);
  }
  save_pickled_dict(path, file);  // outside the lock: pushes go on
  return version;
}

int64_t ParameterShard::load(const std::string& path) {
  const auto file =
      load_pickled_dict(path, "parameter-server shard checkpoint", "dtrain-ps-shard-1");
  try {
    const int64_t shard = file.at("shard").toInt(), shards = file.at("shards").toInt();
    DTRAIN_CHECK_INPUT(shard == shard_ && shards == shards_, path, " belongs to shard ", shard, "/",
                       shards, ", this is shard ", shard_, "/", shards_);
    const std::string optimizer = file.at("optimizer").toStringRef();
    DTRAIN_CHECK_INPUT(optimizer == optimizer_.name, path, " holds ", optimizer,
                       " state, this shard runs ", optimizer_.name);
    const int64_t total = file.at("total").toInt();
    const auto [begin, end] = parallel::ps::shard_range(total, shard_, shards_);
    const auto tensors = file.at("tensors").toGenericDict();
    // The parameters' dtype (float32 or float64) is the state's.
    at::ScalarType dtype = at::kFloat;
    if (tensors.contains("values")) dtype = tensors.at("values").toTensor().scalar_type();
    DTRAIN_CHECK_INPUT(dtype == at::kFloat || dtype == at::kDouble, path, ": the parameters are ",
                       dtype, " (float32 or float64 expected)");
    auto tensor = [&](const char* key) {
      DTRAIN_CHECK_INPUT(tensors.contains(key), path, ": no '", key, "' tensor");
      at::Tensor t = tensors.at(key).toTensor();
      DTRAIN_CHECK_INPUT(t.scalar_type() == dtype && t.dim() == 1 && t.numel() == end - begin, path,
                         ": '", key, "' holds ", t.numel(), " ", t.scalar_type(),
                         " elements, the shard's range ", end - begin, " ", dtype);
      return t;
    };
    std::lock_guard<std::mutex> lock(mutex_);
    values_ = tensor("values");
    // The state the shard's optimizer keeps (as init() makes it), each tensor required.
    optim::FlatOptimizer fresh(flat_.rule());
    fresh.init(values_);
    std::vector<std::pair<std::string, at::Tensor>> state;
    for (const auto& item : fresh.state()) {
      for (const auto& [flat_name, saved_name] : kStateNames) {
        if (item.first == flat_name) state.emplace_back(flat_name, tensor(saved_name));
      }
    }
    flat_.load_state(state);
    if (tensors.contains("staleness")) {
      const at::Tensor counts = tensors.at("staleness").toTensor();
      for (int64_t i = 0; i < std::min<int64_t>(counts.numel(), kStalenessBins); ++i) {
        staleness_counts_[i] = counts[i].item<int64_t>();
      }
    }
    begin_ = begin;
    end_ = end;
    total_ = total;
    version_ = file.at("version").toInt();
    initialized_ = true;
    return version_;
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, path,
                 " is a malformed shard checkpoint: ", e.what_without_backtrace());
  }
}

}  // namespace dtrain::services::ps
