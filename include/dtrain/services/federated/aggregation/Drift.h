// Drift-corrected local training. On skewed data each client's local steps pull the model
// towards its own optimum (client drift), and FedAvg's average of them settles away from the
// global one. Two corrections, both a term added to every local gradient:
//
// - SCAFFOLD (Karimireddy et al. 2020): the server keeps a control variate c (an estimate of
//   the global gradient), each client its own c_i; local steps follow g_i(y) - c_i + c. After
//   K steps a client updates c_i (option 1: its gradient at the server model; option 2:
//   c_i - c + (x - y) / (K lr)) and sends the change of c_i beside its update; the server adds
//   their sum / N (the population) to c.
// - FedDyn (Acar et al. 2021): each client keeps the gradient of its last local objective, h_i;
//   it minimizes L_i(w) - <h_i, w> + alpha/2 ||w - w_global||^2 (FedProx's term with mu =
//   alpha), then h_i <- h_i - alpha (w_i - w_global). The server keeps h <- h - alpha (P / N)
//   mean(update) and moves to w_global + mean(update) - h / alpha.
//
// The client's side is here (the simulation and the gRPC client call it); the server's in the
// scaffold and feddyn aggregators (Aggregator.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "dtrain/services/federated/FedAvg.h"

namespace dtrain::services::federated {

/// What a drift-corrected client returns beside its update.
struct CorrectedUpdate {
  ClientUpdate update;
  /// SCAFFOLD: c_i+ - c_i (sent with the update); undefined otherwise.
  at::Tensor control_delta;
};

/// Trains as train_locally does, with `plan.correction`'s term: `memory` is the client's own
/// state (SCAFFOLD's c_i, FedDyn's h_i; undefined = zeros), updated in place when the training
/// completes; `server_control` SCAFFOLD's c (undefined = zeros). With correction "none" it is
/// train_locally.
CorrectedUpdate train_client(Model& model, const at::Tensor& global,
                             const data::TensorDataset& data, const std::vector<int64_t>& indices,
                             const LocalTraining& plan, uint64_t seed, at::Tensor* memory,
                             const at::Tensor& server_control,
                             const parallel::LossFn& loss = parallel::cross_entropy,
                             const std::function<bool()>& keep_going = nullptr);

/// The gradient of the local objective (the loss averaged over `indices`, with the plan's weight
/// decay) at `global`, flat: SCAFFOLD's option 1.
at::Tensor local_gradient(Model& model, const at::Tensor& global, const data::TensorDataset& data,
                          const std::vector<int64_t>& indices, const LocalTraining& plan,
                          const parallel::LossFn& loss = parallel::cross_entropy);

}  // namespace dtrain::services::federated
