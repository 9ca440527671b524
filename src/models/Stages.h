// Running a model described as stages (common/Model.h's Stage), checkpointed or not: what the
// reference models' forward does. Private to src/models.
#pragma once

#include <torch/nn/module.h>

#include <vector>

#include "dtrain/common/Model.h"
#include "dtrain/memory/ActivationCheckpoint.h"

namespace dtrain::models {

/// Runs `stages` in order, their activations checkpointed in `segments` segments (<= 1: none).
inline at::Tensor run_stages(const std::vector<Stage>& stages, int64_t segments,
                             const at::Tensor& x) {
  if (segments <= 1) {
    at::Tensor h = x;
    for (const auto& stage : stages) h = stage.forward(h);
    return h;
  }
  std::vector<memory::SegmentFn> functions;
  std::vector<std::vector<at::Tensor>> parameters;
  for (const auto& stage : stages) {
    functions.push_back(stage.forward);
    std::vector<at::Tensor> all;
    for (const auto& m : stage.modules) {
      for (const auto& p : m->parameters()) all.push_back(p);
    }
    parameters.push_back(std::move(all));
  }
  return memory::checkpoint_stages(functions, parameters, segments, x);
}

}  // namespace dtrain::models
