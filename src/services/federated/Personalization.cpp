#include "dtrain/services/federated/Personalization.h"

#include <torch/torch.h>

#include <atomic>
#include <exception>
#include <numeric>
#include <set>
#include <thread>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

std::vector<std::vector<std::string>> parameter_groups(const Model& model) {
  std::vector<std::vector<std::string>> groups;
  std::string current;
  for (const auto& item : model.module->named_parameters()) {
    const std::string& name = item.key();
    const auto dot = name.rfind('.');
    const std::string owner = dot == std::string::npos ? "" : name.substr(0, dot);
    if (groups.empty() || owner != current) groups.emplace_back();
    groups.back().push_back(name);
    current = owner;
  }
  return groups;
}

ClientUpdate fine_tune(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                       const std::vector<int64_t>& indices, const LocalTraining& plan,
                       int64_t layers, uint64_t seed) {
  const auto groups = parameter_groups(model);
  DTRAIN_CHECK_INPUT(layers >= 0 && layers <= static_cast<int64_t>(groups.size()),
                     "--personalize-layers ", layers, ": the model has ", groups.size(),
                     " layers with parameters");
  std::set<std::string> trainable;
  const size_t first = layers == 0 ? 0 : groups.size() - static_cast<size_t>(layers);
  for (size_t g = first; g < groups.size(); ++g)
    trainable.insert(groups[g].begin(), groups[g].end());
  // Frozen parameters get no gradient: SGD leaves them at the global values.
  for (auto& item : model.module->named_parameters()) {
    item.value().set_requires_grad(trainable.count(item.key()) > 0);
  }
  ClientUpdate update;
  try {
    update = train_locally(model, global, data, indices, plan, seed);
  } catch (...) {
    for (auto& p : model.module->parameters()) p.set_requires_grad(true);
    throw;
  }
  for (auto& p : model.module->parameters()) p.set_requires_grad(true);
  return update;
}

double accuracy_on(Model& model, const data::TensorDataset& data,
                   const std::vector<int64_t>& indices) {
  torch::NoGradGuard no_grad;
  model.module->eval();
  const data::Batch b = data.get(indices);
  const double correct = model(b.inputs).argmax(-1).eq(b.targets).sum().item<double>();
  model.module->train();
  return correct / static_cast<double>(indices.size());
}

PersonalizationReport personalize(const models::ModelSpec& spec, const at::Tensor& global,
                                  const data::TensorDataset& train,
                                  const std::vector<ClientIndices>& clients,
                                  const LocalTraining& plan, int64_t layers, int threads,
                                  uint64_t seed) {
  validate(plan);
  threads = std::max(1, threads);
  std::vector<size_t> tested;
  for (size_t c = 0; c < clients.size(); ++c) {
    if (!clients[c].test.empty() && !clients[c].train.empty()) tested.push_back(c);
  }
  PersonalizationReport report;
  report.global_accuracy.assign(tested.size(), 0.0);
  report.personalized_accuracy.assign(tested.size(), 0.0);
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  auto work = [&](int t) {
    try {
      at::set_num_threads(1);  // a new thread would start with the default (the cores)
      Model model = models::make_model(spec);
      model.module->to(global.scalar_type());
      for (size_t i = next++; i < tested.size(); i = next++) {
        const ClientIndices& client = clients[tested[i]];
        load_flat_parameters(model, global);
        report.global_accuracy[i] = accuracy_on(model, train, client.test);
        fine_tune(model, global, train, client.train, plan, layers, seed + tested[i]);
        report.personalized_accuracy[i] = accuracy_on(model, train, client.test);
      }
    } catch (...) {
      errors[static_cast<size_t>(t)] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
  for (auto& th : pool) th.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const auto n = static_cast<double>(std::max<size_t>(1, tested.size()));
  report.mean_global =
      std::accumulate(report.global_accuracy.begin(), report.global_accuracy.end(), 0.0) / n;
  report.mean_personalized = std::accumulate(report.personalized_accuracy.begin(),
                                             report.personalized_accuracy.end(), 0.0) /
                             n;
  return report;
}

}  // namespace dtrain::services::federated
