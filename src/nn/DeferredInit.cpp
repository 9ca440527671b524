// Keyed initial values and placeholder parameters (see DeferredInit.h).
#include "dtrain/nn/DeferredInit.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "common/StorageMemory.h"
#include "dtrain/common/Error.h"

namespace dtrain::nn {

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;  // SplitMix64's increment
constexpr double kTwoPi = 6.283185307179586476925;

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// [0, 1) from a word's top 53 bits.
double unit(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// Draws elements of the full tensor, as float32 (what a float32 parameter holds). Normal values
// come in pairs (Box-Muller's cosine and sine of one pair of uniforms): elements 2m and 2m + 1
// share pair m, computed once when both are drawn in a row.
class Drawer {
 public:
  Drawer(const InitRule& rule, uint64_t key) : rule_(rule), key_(key) {}
  float operator()(int64_t index) {
    const auto i = static_cast<uint64_t>(index);
    switch (rule_.kind) {
      case InitRule::Kind::kNormal: {
        const uint64_t pair = i >> 1;
        if (pair != pair_) {
          const double u1 = 1.0 - unit(mix(key_ + (2 * pair + 1) * kGamma));  // (0, 1]
          const double u2 = unit(mix(key_ + (2 * pair + 2) * kGamma));
          radius_ = std::sqrt(-2.0 * std::log(u1));
          angle_ = kTwoPi * u2;
          pair_ = pair;
        }
        const double normal = radius_ * ((i & 1) != 0 ? std::sin(angle_) : std::cos(angle_));
        return static_cast<float>(rule_.a + rule_.b * normal);
      }
      case InitRule::Kind::kUniform:
        return static_cast<float>(rule_.a +
                                  (rule_.b - rule_.a) * unit(mix(key_ + (i + 1) * kGamma)));
      case InitRule::Kind::kConstant:
        return static_cast<float>(rule_.a);
    }
    return 0.0f;
  }

 private:
  InitRule rule_;
  uint64_t key_;
  uint64_t pair_ = ~uint64_t{0};
  double radius_ = 0.0, angle_ = 0.0;
};

thread_local DeferredInit* current = nullptr;

constexpr int64_t kChunk = 1 << 20;  // elements drawn at a time into another dtype or device

}  // namespace

uint64_t parameter_key(uint64_t seed, const std::string& name) {
  uint64_t hash = 0xCBF29CE484222325ULL;  // FNV-1a
  for (const unsigned char c : name) hash = (hash ^ c) * 0x100000001B3ULL;
  return mix(seed ^ mix(hash));
}

void fill_keyed(at::Tensor out, const InitRule& rule, uint64_t key,
                const std::vector<int64_t>& local_shape, const tensor::ParameterSplit* split,
                int64_t begin) {
  DTRAIN_CHECK(out.is_contiguous(), "fill_keyed: the output must be contiguous");
  // Local element j sits in the full tensor at (j / block) * full_block + offset + j % block.
  int64_t block = 1, full_block = 1, offset = 0;
  for (int64_t d : local_shape) block *= d;
  full_block = block;
  if (split != nullptr) {
    int64_t inner = 1;
    for (size_t d = static_cast<size_t>(split->dim) + 1; d < split->full_shape.size(); ++d) {
      inner *= split->full_shape[d];
    }
    block = split->length * inner;
    full_block = split->full_shape[static_cast<size_t>(split->dim)] * inner;
    offset = split->start * inner;
  }
  const int64_t n = out.numel();
  auto draw = [&](float* data, int64_t first, int64_t count) {
    at::parallel_for(0, count, 1 << 14, [&](int64_t lo, int64_t hi) {
      Drawer value(rule, key);
      for (int64_t e = lo; e < hi; ++e) {
        const int64_t j = first + e;
        const int64_t full = block == 0 ? 0 : (j / block) * full_block + offset + j % block;
        data[e] = value(full);
      }
    });
  };
  torch::NoGradGuard no_grad;
  if (out.device().is_cpu() && out.scalar_type() == at::kFloat) {
    draw(out.data_ptr<float>(), begin, n);
    return;
  }
  at::Tensor staging = at::empty({std::min(n, kChunk)}, at::kFloat);
  const at::Tensor flat = out.view({-1});  // (a whole parameter's values: any shape)
  for (int64_t done = 0; done < n; done += kChunk) {
    const int64_t count = std::min(kChunk, n - done);
    draw(staging.data_ptr<float>(), begin + done, count);
    flat.narrow(0, done, count).copy_(staging.narrow(0, 0, count));
  }
}

at::Tensor placeholder(const std::vector<int64_t>& shape, const at::TensorOptions& options) {
  return tensor_without_memory(shape, options);
}

bool is_placeholder(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 && t.has_storage() && t.storage().nbytes() == 0;
}

void module_to(torch::nn::Module& module, const at::TensorOptions& options) {
  torch::NoGradGuard no_grad;
  auto convert = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    at::TensorOptions target = t.options();
    if (options.has_device()) target = target.device(options.device());
    if (options.has_dtype() && t.is_floating_point()) target = target.dtype(options.dtype());
    if (target.device() == t.device() && target.dtype() == t.dtype()) return;
    at::Tensor moved = t;  // the same TensorImpl as the module's
    moved.set_data(is_placeholder(t) ? placeholder(t.sizes().vec(), target) : t.to(target));
  };
  for (const auto& p : module.parameters()) convert(p);
  for (const auto& b : module.buffers()) convert(b);
}

void DeferredInit::record(const at::Tensor& parameter, InitRule rule) {
  rules_[parameter.unsafeGetTensorImpl()] = rule;
}

void DeferredInit::bind(const torch::nn::Module& root) {
  const tensor::ParameterSplits splits = tensor::parameter_splits(root);
  for (const auto& item : root.named_parameters()) {
    const auto rule = rules_.find(item.value().unsafeGetTensorImpl());
    DTRAIN_CHECK(rule != rules_.end(), "parameter ", item.key(),
                 " was not made by nn::new_parameter inside the model's InitScope");
    Entry entry{item.value(), rule->second, parameter_key(seed_, item.key())};
    const auto split = splits.find(item.key());
    if (split != splits.end()) {
      entry.split = true;
      entry.range = split->second;
    }
    by_name_[item.key()] = entries_.size();
    entries_.push_back(std::move(entry));
  }
  rules_.clear();
}

void DeferredInit::fill(const std::string& name, int64_t begin, at::Tensor out) const {
  const auto found = by_name_.find(name);
  DTRAIN_CHECK(found != by_name_.end(), "no deferred parameter named ", name);
  const Entry& entry = entries_[found->second];
  DTRAIN_CHECK(begin >= 0 && begin + out.numel() <= entry.parameter.numel(), "parameter ", name,
               ": elements [", begin, ", ", begin + out.numel(), ") of ", entry.parameter.numel());
  fill_keyed(std::move(out), entry.rule, entry.key, entry.parameter.sizes().vec(),
             entry.split ? &entry.range : nullptr, begin);
}

void DeferredInit::values_into(const std::string& name, const at::Tensor& out) const {
  if (source_) {
    source_(name, out);
  } else {
    fill(name, 0, out);
  }
}

void DeferredInit::materialize_all(bool draw) {
  if (!pending_) return;
  for (const auto& [name, k] : by_name_) {
    at::Tensor& parameter = entries_[k].parameter;
    if (!is_placeholder(parameter)) continue;
    at::Tensor values = at::empty(parameter.sizes(), parameter.options().requires_grad(false));
    if (draw) values_into(name, values);
    parameter.set_data(values);
  }
  pending_ = false;
}

void DeferredInit::materialize(const std::vector<at::Tensor>& parameters) {
  std::unordered_set<const void*> wanted;
  for (const auto& p : parameters) wanted.insert(p.unsafeGetTensorImpl());
  bool left = false;
  for (const auto& [name, k] : by_name_) {
    at::Tensor& parameter = entries_[k].parameter;
    if (!is_placeholder(parameter)) continue;
    if (wanted.count(parameter.unsafeGetTensorImpl()) == 0) {
      left = true;
      continue;
    }
    at::Tensor values = at::empty(parameter.sizes(), parameter.options().requires_grad(false));
    values_into(name, values);
    parameter.set_data(values);
  }
  pending_ = left;
}

void DeferredInit::to(const at::TensorOptions& options) {
  DTRAIN_CHECK(pending_, "DeferredInit::to: the parameters have their values already");
  for (Entry& entry : entries_) {
    if (!is_placeholder(entry.parameter)) continue;
    at::TensorOptions moved = entry.parameter.options();
    if (options.has_dtype()) moved = moved.dtype(options.dtype());
    if (options.has_device()) moved = moved.device(options.device());
    entry.parameter.set_data(placeholder(entry.parameter.sizes().vec(), moved));
  }
}

int64_t DeferredInit::largest_numel() const {
  int64_t largest = 0;
  for (const Entry& entry : entries_) largest = std::max(largest, entry.parameter.numel());
  return largest;
}

InitScope::InitScope(DeferredInit& init) : previous_(current) { current = &init; }

InitScope::~InitScope() { current = previous_; }

DeferredInit* current_init() { return current; }

at::Tensor new_parameter(const std::vector<int64_t>& shape, const InitRule& rule) {
  DTRAIN_CHECK(
      current != nullptr,
      "nn::new_parameter is for layers built inside an nn::InitScope (make_gpt opens one)");
  at::Tensor t = placeholder(shape, at::TensorOptions(at::kFloat));
  current->record(t, rule);
  return t;
}

}  // namespace dtrain::nn
