#include "dtrain/parallel/ps/ParameterShard.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ps {

std::pair<int64_t, int64_t> shard_range(int64_t total, int shard, int shards) {
  return {total * shard / shards, total * (shard + 1) / shards};
}

ParameterShard::ParameterShard(int shard, int shards, ShardOptimizer optimizer)
    : shard_(shard), shards_(shards), optimizer_(std::move(optimizer)) {
  DTRAIN_CHECK_INPUT(shards >= 1 && shard >= 0 && shard < shards, "--shard ", shard, "/", shards,
                     ": expected I/N with 0 <= I < N");
  const std::string& name = optimizer_.name;
  DTRAIN_CHECK_INPUT(name == "sgd" || name == "adagrad" || name == "adam",
                     "unknown parameter-server optimizer '", name, "' (sgd, adagrad or adam)");
  DTRAIN_CHECK_INPUT(optimizer_.lr > 0, "the parameter server's learning rate must be > 0, got ",
                     optimizer_.lr);
}

std::string ParameterShard::initialize(int64_t total, const at::Tensor& values) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (initialized_) return "initialized";
  if (total < shards_) return concat("field 'total' is ", total, ", fewer parameters than the ", shards_, " shards");
  const auto [begin, end] = shard_range(total, shard_, shards_);
  if (values.scalar_type() != at::kFloat || values.dim() != 1 || values.numel() != end - begin) {
    return concat("the initial values hold ", values.numel(), " elements, shard ", shard_, "/",
                  shards_, " of ", total, " parameters holds ", end - begin);
  }
  begin_ = begin;
  end_ = end;
  total_ = total;
  values_ = values.clone();
  if (optimizer_.name == "adagrad") {
    state1_ = at::full_like(values_, optimizer_.initial_accumulator);
  } else if (optimizer_.name == "adam") {
    state1_ = at::zeros_like(values_);
    state2_ = at::zeros_like(values_);
    steps_ = at::zeros_like(values_);
  }
  version_ = 0;
  initialized_ = true;
  return "";
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
  DTRAIN_CHECK(initialized_ && begin >= begin_ && end <= end_ && begin <= end,
               "read of [", begin, ", ", end, ") from shard [", begin_, ", ", end_, ")");
  if (version) *version = version_;
  return values_.narrow(0, begin - begin_, end - begin).clone();
}

std::string ParameterShard::apply(int64_t begin, const at::Tensor& gradient,
                                  int64_t computed_version, int64_t* version, int64_t* staleness) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!initialized_) return "the shard has no parameters yet (Initialize first)";
  const int64_t n = gradient.numel();
  if (gradient.scalar_type() != at::kFloat || gradient.dim() != 1 || begin < begin_ ||
      begin + n > end_) {
    return concat("a gradient for [", begin, ", ", begin + n, ") is outside the shard's range [",
                  begin_, ", ", end_, ")");
  }
  if (computed_version < 0 || computed_version > version_) {
    return concat("field 'computed_version' is ", computed_version,
                  ", but the shard is at version ", version_, " (a version from the future)");
  }
  at::Tensor w = values_.narrow(0, begin - begin_, n);
  const double lr = optimizer_.lr;
  if (optimizer_.name == "sgd") {
    w.add_(gradient, -lr);
  } else if (optimizer_.name == "adagrad") {
    at::Tensor sum = state1_.narrow(0, begin - begin_, n);
    sum.addcmul_(gradient, gradient);
    w.addcdiv_(gradient, sum.sqrt().add_(optimizer_.eps), -lr);
  } else {
    at::Tensor m = state1_.narrow(0, begin - begin_, n);
    at::Tensor v = state2_.narrow(0, begin - begin_, n);
    at::Tensor t = steps_.narrow(0, begin - begin_, n);
    t.add_(1);
    m.mul_(optimizer_.beta1).add_(gradient, 1 - optimizer_.beta1);
    v.mul_(optimizer_.beta2).addcmul_(gradient, gradient, 1 - optimizer_.beta2);
    const at::Tensor correction1 = 1 - at::pow(optimizer_.beta1, t);
    const at::Tensor correction2 = 1 - at::pow(optimizer_.beta2, t);
    w.sub_(m / correction1 / ((v / correction2).sqrt_().add_(optimizer_.adam_eps)) * lr);
  }
  if (staleness) *staleness = version_ - computed_version;
  ++version_;
  if (version) *version = version_;
  return "";
}

}  // namespace dtrain::parallel::ps
