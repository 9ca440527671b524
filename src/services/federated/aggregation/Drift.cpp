#include "dtrain/services/federated/aggregation/Drift.h"

#include <torch/torch.h>

#include <algorithm>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

at::Tensor local_gradient(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                          const std::vector<int64_t>& indices, const LocalTraining& plan,
                          const parallel::LossFn& loss) {
  load_flat_parameters(model, global);
  model.module->train();
  std::vector<at::Tensor> parameters = model.module->parameters();
  for (auto& p : parameters) p.mutable_grad() = at::Tensor();
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t batch = local_batch(plan, n);
  for (int64_t begin = 0; begin < n; begin += batch) {
    const std::vector<int64_t> chosen(indices.begin() + begin,
                                      indices.begin() + std::min(n, begin + batch));
    const data::Batch b = data.get(chosen);
    // The mean over all n examples: each batch's mean loss weighted by its share.
    (loss(model(b.inputs), b.targets) *
     (static_cast<double>(chosen.size()) / static_cast<double>(n)))
        .backward();
  }
  std::vector<at::Tensor> flat;
  for (const auto& p : parameters) {
    at::Tensor g = p.grad().defined() ? p.grad().detach() : at::zeros_like(p);
    if (plan.weight_decay > 0) g = g + p.detach() * plan.weight_decay;
    flat.push_back(g.reshape({-1}));
    p.mutable_grad() = at::Tensor();
  }
  return at::cat(flat);
}

CorrectedUpdate train_client(Model& model, const at::Tensor& global,
                             const data::TensorDataset& data, const std::vector<int64_t>& indices,
                             const LocalTraining& plan, uint64_t seed, at::Tensor* memory,
                             const at::Tensor& server_control, const parallel::LossFn& loss,
                             const std::function<bool()>& keep_going) {
  CorrectedUpdate out;
  if (plan.correction == "none") {
    out.update = train_locally(model, global, data, indices, plan, seed, loss, keep_going);
    return out;
  }
  DTRAIN_CHECK(memory != nullptr, "drift correction '", plan.correction, "' without client state");
  const at::Tensor own = memory->defined() ? *memory : at::zeros_like(global);
  if (plan.correction == "scaffold") {
    const at::Tensor c = server_control.defined() ? server_control : at::zeros_like(global);
    out.update = train_locally(model, global, data, indices, plan, seed, loss, keep_going, c - own);
    if (!out.update.completed || out.update.steps == 0) return out;
    at::Tensor next;
    if (plan.scaffold_option == 1) {
      next = local_gradient(model, global, data, indices, plan, loss);
    } else {
      // c_i - c + (x - y) / (K lr), with x - y = -update.
      next = own - c - out.update.delta / (static_cast<double>(out.update.steps) * plan.lr);
    }
    out.control_delta = next - own;
    *memory = next;
    return out;
  }
  DTRAIN_CHECK(plan.correction == "feddyn", "unknown drift correction '", plan.correction, "'");
  DTRAIN_CHECK(plan.prox_mu > 0, "FedDyn's plan needs alpha (prox_mu) > 0");
  out.update = train_locally(model, global, data, indices, plan, seed, loss, keep_going, -own);
  if (!out.update.completed) return out;
  *memory = own - out.update.delta * plan.prox_mu;
  return out;
}

}  // namespace dtrain::services::federated
