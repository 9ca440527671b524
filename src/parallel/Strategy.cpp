// The default loss, and the checked views of a strategy as an asynchronous worker or a loop.
#include "dtrain/parallel/Strategy.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/Loops.h"

namespace dtrain::parallel {

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  if (logits.dim() > 2) {
    // Per-token predictions [B, T, V] against [B, T]: the mean over every token.
    return torch::nn::functional::cross_entropy(logits.flatten(0, -2), targets.reshape({-1}));
  }
  return torch::nn::functional::cross_entropy(logits, targets);
}

AsynchronousWorker& as_asynchronous(Strategy& strategy) {
  auto* worker = dynamic_cast<AsynchronousWorker*>(&strategy);
  DTRAIN_CHECK(worker != nullptr, "strategy ", strategy.name(),
               " is registered as "
               "asynchronous but does not implement parallel::AsynchronousWorker");
  return *worker;
}

DrivenLoop& as_driven(Strategy& strategy) {
  auto* loop = dynamic_cast<DrivenLoop*>(&strategy);
  DTRAIN_CHECK(loop != nullptr, "strategy ", strategy.name(),
               " is registered as driving its "
               "own loop but does not implement parallel::DrivenLoop");
  return *loop;
}

void Strategy::load_values(const std::string& directory) {
  DTRAIN_THROW(InputError, "strategy ", name(), " cannot set its values from ", directory,
               " alone; --init-from loads the whole model for it");
}

}  // namespace dtrain::parallel
