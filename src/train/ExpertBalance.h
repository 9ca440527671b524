// A mixture of experts' balance after each step (issue 81): each MoE layer's loads over the step's
// training forwards summed over the data-parallel ranks, DeepSeek-V3's auxiliary-loss-free bias
// moved from them (--moe-bias-rate), and the step's metrics: each layer's max / mean load, the
// share of assignments dropped by a capacity, the mean auxiliary loss.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace torch::nn {
class Module;
}

namespace dtrain::nn {
class MoeImpl;
}

namespace dtrain::train {

class ExpertBalance {
 public:
  /// Null when `module` has no MoE layers. `group`: the ranks whose tokens make the step (the
  /// data-parallel group; null: this rank's alone). `bias_rate` > 0 moves every layer's bias by
  /// it after each step, the same on every rank.
  static std::unique_ptr<ExpertBalance> find(torch::nn::Module& module, comm::CommunicatorPtr group,
                                             double bias_rate);
  /// Collective over the group: adds the step's metrics ("moe_imbalance" the largest over the
  /// layers, "moe_imbalance.<layer>" each, "moe_dropped" the share of assignments dropped,
  /// "moe_aux_loss" the mean over the layers and forwards) and moves the biases.
  void after_step(std::map<std::string, double>& metrics);

 private:
  std::vector<std::pair<std::string, nn::MoeImpl*>> layers_;
  comm::CommunicatorPtr group_;
  double bias_rate_ = 0.0;
};

}  // namespace dtrain::train
