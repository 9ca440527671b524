// Sandblaster L-BFGS (DistBelief): a coordinator drives L-BFGS over the parameter-server shards
// without ever holding a parameter-sized vector. The shards keep the parameters "x", the
// gradient "g", the direction "d" and the history pairs (s_i, y_i) for their slices and run the
// coordinator's vector commands (dot products come back as partial sums, axpy, scale, copy);
// the coordinator keeps only scalars (rho_i, the step, losses) and the history's names. Workers
// evaluate the loss at the shards' "x" and add their gradients into "g" (the evaluation callback
// here: work units handed out to worker processes in the strategy, one loop in tests).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "dtrain/parallel/ps/PsClient.h"

namespace dtrain::parallel::ps {

struct LbfgsOptions {
  /// History pairs kept (on the shards).
  int history = 10;
  int max_iterations = 100;
  /// Stop when the gradient's L2 norm is at most this.
  double tolerance_grad = 1e-5;
  /// Stop when the loss changes by at most this (relative to max(1, |loss|)).
  double tolerance_change = 1e-9;
  /// Backtracking line search: Armijo's sufficient-decrease constant and its most halvings.
  double armijo = 1e-4;
  int max_line_search = 25;
  /// Adds 0.5 * weight_decay * |x|^2 to the objective (on the shards: its gradient is an axpy
  /// of x into g), making a problem such as logistic regression strictly convex.
  double weight_decay = 0.0;
};

struct LbfgsResult {
  int iterations = 0;
  /// Loss (and gradient) evaluations, line-search trials included.
  int evaluations = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  /// The loss after each iteration.
  std::vector<double> losses;
  std::string stop_reason;
};

/// Evaluates the loss at the shards' "x" and adds its gradient into the shards' "g"; returns
/// the loss. The coordinator zeroes "g" first, opening accumulation round `round` (1, 2, ...):
/// gradients pushed keyed by (round, unit) count once per unit.
using LossEvaluation = std::function<double(int64_t round)>;
/// Called after every iteration with the result so far (the shards' "x" is the iteration's).
using IterationCallback = std::function<void(const LbfgsResult&)>;

class LbfgsCoordinator {
 public:
  LbfgsCoordinator(PsClient& client, LbfgsOptions options);
  /// Runs L-BFGS from the shards' current "x"; leaves the result in "x".
  LbfgsResult run(const LossEvaluation& evaluate, const IterationCallback& on_iteration = {});
  /// Vector commands sent so far (each call runs on all shards).
  int64_t commands() const { return commands_; }

 private:
  std::vector<double> ops(const std::vector<VectorOp>& ops);
  PsClient& client_;
  LbfgsOptions options_;
  int64_t commands_ = 0;
  int64_t rounds_ = 0;
};

}  // namespace dtrain::parallel::ps
