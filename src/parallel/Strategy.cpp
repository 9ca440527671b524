// The strategy registry and the shared default loss. Adding a strategy: one line in kRegistry.
#include "dtrain/parallel/Strategy.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/ps/DownpourStrategy.h"
#include "parallel/ps/SandblasterStrategy.h"
#include "parallel/zero/Zero3Strategy.h"
#include "parallel/zero/ZeroStrategy.h"

namespace dtrain::parallel {

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  if (logits.dim() > 2) {
    // Per-token predictions [B, T, V] against [B, T]: the mean over every token.
    return torch::nn::functional::cross_entropy(logits.flatten(0, -2), targets.reshape({-1}));
  }
  return torch::nn::functional::cross_entropy(logits, targets);
}

namespace {

using Factory = StrategyPtr (*)(const StrategyOptions&);
const std::vector<std::pair<std::string, Factory>> kRegistry = {
    {"ddp", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<DdpStrategy>(o); }},
    {"zero1", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<ZeroStrategy>(o, 1); }},
    {"zero2", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<ZeroStrategy>(o, 2); }},
    {"zero3", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<Zero3Strategy>(o); }},
    {"pipeline", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<pipeline::PipelineStrategy>(o); }},
    {"downpour", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<ps::DownpourStrategy>(o); }},
    {"sandblaster", [](const StrategyOptions& o) -> StrategyPtr { return std::make_unique<ps::SandblasterStrategy>(o); }},
};

}  // namespace

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& entry : kRegistry) names.push_back(entry.first);
  return names;
}

StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options) {
  for (const auto& entry : kRegistry) {
    if (entry.first == name) return entry.second(options);
  }
  std::string known;
  for (const auto& entry : kRegistry) known += (known.empty() ? "" : ", ") + entry.first;
  DTRAIN_THROW(InputError, "unknown strategy '", name, "' (available: ", known, ")");
}

}  // namespace dtrain::parallel
