// The MoE layers' loads summed over a step and its data-parallel ranks: metrics and the bias.
#include "train/ExpertBalance.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>

#include "dtrain/nn/Moe.h"

namespace dtrain::train {

std::unique_ptr<ExpertBalance> ExpertBalance::find(torch::nn::Module& module,
                                                   comm::CommunicatorPtr group, double bias_rate) {
  auto balance = std::make_unique<ExpertBalance>();
  for (const auto& item : module.named_modules()) {
    if (auto* layer = dynamic_cast<nn::MoeImpl*>(item.value().get())) {
      // "blocks.3.moe" -> "blocks.3"
      std::string name = item.key();
      const auto dot = name.rfind('.');
      if (dot != std::string::npos) name = name.substr(0, dot);
      balance->layers_.emplace_back(name, layer);
    }
  }
  if (balance->layers_.empty()) return nullptr;
  balance->group_ = group && group->size() > 1 ? std::move(group) : nullptr;
  balance->bias_rate_ = bias_rate;
  return balance;
}

void ExpertBalance::after_step(std::map<std::string, double>& metrics) {
  // One buffer for every layer: its loads, dropped, tokens x top-k, forwards and aux losses.
  std::vector<nn::MoeStepCounts> counts;
  std::vector<double> flat;
  for (auto& [name, layer] : layers_) {
    counts.push_back(layer->take_step_counts());
    const auto& c = counts.back();
    for (int64_t l : c.load) flat.push_back(static_cast<double>(l));
    flat.push_back(static_cast<double>(c.dropped));
    flat.push_back(static_cast<double>(c.tokens * layer->options.top_k));
    flat.push_back(static_cast<double>(c.forwards));
    flat.push_back(c.aux_loss);
  }
  at::Tensor summed = at::tensor(flat, at::kDouble);
  if (group_) group_->allreduce(summed)->wait();
  const double* s = summed.data_ptr<double>();
  double worst = 1.0, dropped = 0, assignments = 0, aux = 0, forwards = 0;
  size_t at = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    auto& [name, layer] = layers_[i];
    const size_t experts = counts[i].load.size();
    std::vector<int64_t> load(experts);
    for (size_t e = 0; e < experts; ++e) load[e] = static_cast<int64_t>(s[at + e]);
    at += experts;
    const double layer_dropped = s[at], layer_assignments = s[at + 1];
    dropped += layer_dropped;
    assignments += layer_assignments;
    forwards += s[at + 2];
    aux += s[at + 3];
    at += 4;
    const double imbalance = nn::load_imbalance(load);
    metrics["moe_imbalance." + name] = imbalance;
    worst = std::max(worst, imbalance);
    if (bias_rate_ > 0 && layer_assignments > 0) layer->update_bias(load, bias_rate_);
  }
  metrics["moe_imbalance"] = worst;
  metrics["moe_dropped"] = assignments > 0 ? dropped / assignments : 0.0;
  metrics["moe_aux_loss"] = forwards > 0 ? aux / forwards : 0.0;
}

}  // namespace dtrain::train
