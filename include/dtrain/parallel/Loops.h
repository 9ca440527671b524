// What only some strategies do, beside the Strategy interface every one implements: the
// asynchronous parameter-server workers (Downpour: no per-step collective, the run counted in
// the servers' steps) and the strategies that drive their own loop (Sandblaster: a coordinator
// hands out work units). The Trainer's runner for each kind (train/runners/) is the only
// caller; the registry says which runner drives a strategy (Registry.h, Loop).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "dtrain/parallel/Strategy.h"

namespace dtrain::parallel {

/// An asynchronous worker's side of the run: its ranks do not step together, so rank 0 alone
/// evaluates and checkpoints (save() is then not collective), and the run ends when
/// global_steps() reaches its budget however the steps were shared out.
class AsynchronousWorker {
 public:
  virtual ~AsynchronousWorker() = default;
  /// Worker steps applied so far by every worker together (as the servers count them).
  virtual int64_t global_steps() const = 0;
  /// After this worker's last step, sends what it still holds (pending gradients) and makes
  /// model() hold the newest parameters.
  virtual void finish() = 0;
  /// Rank 0 after finish(): waits (bounded) until the other workers' last updates are in, or
  /// they went quiet (a worker that died), then takes the newest parameters. Returns a
  /// sentence about workers that did not finish ("" when all did).
  virtual std::string await_workers() = 0;
  /// Numbers about the whole run for the metrics file's "strategy" record, on rank 0 at the
  /// end (the parameter server's: staleness histogram, traffic per shard, pushes per worker).
  virtual std::map<std::string, double> run_metrics() { return {}; }
};

/// One iteration of a strategy that runs its own loop (Sandblaster: an L-BFGS iteration).
struct IterationReport {
  /// Iterations done so far in this run.
  int64_t iteration = 0;
  double loss = 0.0;
  double grad_norm = -1.0;
  /// Wall time of the iteration and the passes over the training set it made.
  double seconds = 0.0;
  int64_t evaluations = 0;
  std::map<std::string, double> metrics;
};

/// What a strategy that runs its own loop gets from the Trainer.
struct LoopContext {
  const data::TensorDataset* train = nullptr;
  LossFn loss;
  /// Iterations to run at most (the Trainer's steps).
  int64_t max_iterations = 100;
  /// Examples per forward when a strategy computes over a range of the data.
  int64_t chunk = 256;
  /// This rank's slowdown (--simulate-slowdown): its work takes this many times as long,
  /// sleeping the difference or (spin) keeping its core busy.
  double slowdown = 1.0;
  bool slowdown_spin = false;
  /// The objective's L2 term, 0.5 * weight_decay * |params|^2 (the optimizer's weight decay).
  double weight_decay = 0.0;
  /// Bound of a wait for the other ranks' work (the job's --comm-timeout).
  int64_t stall_ms = 120000;
  /// On rank 0 after every iteration, with model() holding the iteration's parameters (the
  /// Trainer writes metrics, evaluates and checkpoints there).
  std::function<void(const IterationReport&)> on_iteration;
  /// On every rank after each piece of work it computed and sent, before reporting it (the
  /// count so far): the Trainer's simulated failures fire here (a worker dying with a unit).
  std::function<void(int64_t)> on_work;
};

/// A strategy that runs its own loop over the training set instead of the Trainer's batch loop
/// (Sandblaster L-BFGS). Asynchronous like the workers above: rank 0 alone evaluates and
/// checkpoints.
class DrivenLoop {
 public:
  virtual ~DrivenLoop() = default;
  /// Every rank: runs the loop until it ends, calling context.on_iteration on rank 0; model()
  /// then holds the final parameters on rank 0. Returns the iterations run.
  virtual int64_t run_loop(const LoopContext& context) = 0;
  /// As AsynchronousWorker::run_metrics.
  virtual std::map<std::string, double> run_metrics() { return {}; }
};

/// The strategy as its asynchronous side, or as its loop; an Error naming it when it is
/// not one (a registry entry whose Loop disagrees with its class).
AsynchronousWorker& as_asynchronous(Strategy& strategy);
DrivenLoop& as_driven(Strategy& strategy);

}  // namespace dtrain::parallel
