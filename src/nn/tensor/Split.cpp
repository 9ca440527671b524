// Parameter splits of tensor-parallel modules, collected by name over a module tree.
#include "dtrain/nn/tensor/Split.h"

#include <torch/nn/module.h>

#include "dtrain/common/Error.h"

namespace dtrain::nn::tensor {

std::pair<int64_t, int64_t> split_range(int64_t n, int parts, int index) {
  DTRAIN_CHECK(parts >= 1 && index >= 0 && index < parts, "split_range: index ", index, " of ",
               parts, " parts");
  const int64_t base = n / parts, extra = n % parts;
  const int64_t start = index * base + std::min<int64_t>(index, extra);
  return {start, base + (index < extra ? 1 : 0)};
}

ParameterSplits parameter_splits(const torch::nn::Module& root) {
  ParameterSplits splits;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto* parallel = dynamic_cast<const TensorParallelModule*>(item.value().get());
    if (!parallel) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& [name, split] : parallel->local_splits()) splits[prefix + name] = split;
  }
  return splits;
}

std::vector<std::string> partial_gradient_parameters(const torch::nn::Module& root) {
  std::vector<std::string> names;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto* parallel = dynamic_cast<const TensorParallelModule*>(item.value().get());
    if (!parallel) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& name : parallel->partial_gradients()) names.push_back(prefix + name);
  }
  return names;
}

std::vector<int64_t> full_shape(const ParameterSplits& splits, const std::string& name,
                                const std::vector<int64_t>& local) {
  const auto it = splits.find(name);
  return it == splits.end() ? local : it->second.full_shape;
}

}  // namespace dtrain::nn::tensor
