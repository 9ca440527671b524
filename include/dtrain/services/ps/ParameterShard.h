// One parameter-server shard's state, without the network (the service layer: `dtrain ps
// serve` holds one; workers reach it through PsClient and ShardProtocol.h's terms): its contiguous
// range [begin, end) of the model's flat parameters (float32, or float64 for exact comparisons),
// the version (updates applied), and the optimizer that applies pushed gradients to the range (SGD,
// Adagrad
// - DistBelief's choice for Downpour, robust to stale gradients - or Adam), each update under
// one lock so pulls see whole versions.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/optim/FlatOptimizer.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/parallel/ps/ShardProtocol.h"

namespace dtrain::services::ps {

struct ShardOptimizer {
  /// "sgd", "adagrad" or "adam".
  std::string name = "adagrad";
  double lr = 0.01;
  /// Adagrad: initial accumulator value (as torch.optim.Adagrad) and epsilon.
  double initial_accumulator = 0.0;
  double eps = 1e-10;
  /// Adam.
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  /// The learning-rate schedule, by version (update count): warmup, step or cosine decay.
  optim::LrScheduleSpec schedule;
  /// Versions the schedule spans (cosine decays to its end; 0 = no end: cosine refused).
  int64_t total_versions = 0;
};

/// Checks the optimizer's name, rate and schedule (InputError naming the flag).
void check_shard_optimizer(const ShardOptimizer& optimizer);

/// Staleness histogram bins: 0 .. kStalenessBins - 2, the last bin counts the rest.
constexpr int kStalenessBins = 33;

struct WorkerRecord {
  int64_t pushes = 0;
  std::chrono::steady_clock::time_point last_push;
  bool finished = false;
  /// Pushes the shard refused (each changed nothing).
  int64_t refused = 0;
};

class ParameterShard {
 public:
  ParameterShard(int shard, int shards, ShardOptimizer optimizer);

  /// Sets the initial parameters for a model of `total` elements; `values` must be exactly
  /// this shard's range, float32 or float64 (the dtype every later gradient must have).
  /// Returns "" or why not (already initialized: "initialized").
  std::string initialize(int64_t total, const at::Tensor& values);

  bool initialized() const;
  /// The parameters' dtype, set by initialize() or load() (float32 before either).
  at::ScalarType dtype() const;
  int shard() const { return shard_; }
  int shards() const { return shards_; }
  int64_t begin() const;
  int64_t end() const;
  int64_t total() const;
  int64_t version() const;
  const ShardOptimizer& optimizer() const { return optimizer_; }

  /// A copy of elements [begin, end) (within the range) and the version they belong to.
  at::Tensor read(int64_t begin, int64_t end, int64_t* version) const;
  /// Elements [begin, end) without a copy, and their version: a view the caller may keep (a
  /// pull sending it). Updates never write into values such a view still sees: one that finds
  /// a view held writes into a fresh copy (copy on write), so the view stays one version.
  at::Tensor share(int64_t begin, int64_t end, int64_t* version) const;
  /// Applies `gradient` for elements [begin, begin + numel) computed at `computed_version`
  /// by `worker` (`last`: its final push). Returns "" (and the new version, the staleness and
  /// the learning rate used) or why it was refused (nothing changed): among others a gradient
  /// holding NaN or Inf (kNonFiniteGradient), which would make every parameter it reaches
  /// non-finite for every worker.
  std::string apply(int64_t begin, const at::Tensor& gradient, int64_t computed_version, int worker,
                    bool last, int64_t* version, int64_t* staleness, double* lr);
  /// Runs `ops` in order on the slice, all under the lock; Dot results are appended to `dots`.
  /// Returns "" or why the batch was refused (checked whole first, and refused too when it
  /// would leave the parameters non-finite: nothing changed).
  std::string vector_ops(const std::vector<parallel::ps::VectorOp>& ops, std::vector<double>* dots);
  /// Adds `gradient` (elements [begin, begin + numel)) into the named vector (not "x"): the
  /// workers' gradients of Sandblaster's work units. Keyed (`round` > 0): added only when
  /// `round` is the vector's open round (the last Zero with that round) and `unit` was not yet
  /// added in it, else `*ignored` is set - a backup copy, a retry or a late unit of an earlier
  /// round counts once or not at all. Returns "" or why not (nothing changed).
  std::string accumulate(const std::string& name, int64_t begin, const at::Tensor& gradient,
                         int64_t round = 0, int64_t unit = 0, bool* ignored = nullptr);
  /// Records that `worker` stopped (its final push carried no gradient).
  void mark_done(int worker);
  /// Counts a push of `worker`'s that was refused (shown per worker by workers()).
  void count_refusal(int worker);
  /// The learning rate of the next update.
  double current_lr() const;
  std::vector<int64_t> staleness_histogram() const;
  std::map<int, WorkerRecord> workers() const;

  /// Writes the parameters, optimizer state and version to `path` atomically (a reader sees
  /// the previous file or this one). Returns the version written (-1: nothing, uninitialized).
  int64_t save(const std::string& path) const;
  /// Restores what save() wrote (InputError naming the file when it is damaged or belongs to
  /// another shard, model size or optimizer). Returns the version resumed.
  int64_t load(const std::string& path);

 private:
  /// "" or why a gradient for [begin, begin + numel) cannot be taken: outside the range, of
  /// another dtype, or not finite (the lock is held).
  std::string check_gradient(int64_t begin, const at::Tensor& gradient) const;
  /// Before writing the values (the lock is held): copies them first if a share() view of
  /// them is still held.
  void own_values();
  const int shard_, shards_;
  const ShardOptimizer optimizer_;
  mutable std::mutex mutex_;
  int64_t begin_ = 0, end_ = 0, total_ = 0;
  int64_t version_ = 0;
  bool initialized_ = false;
  at::Tensor values_;          // float32 or float64 [end - begin)
  optim::FlatOptimizer flat_;  // its state: Adagrad's sums; Adam's moments and steps per element
  std::vector<int64_t> staleness_counts_ = std::vector<int64_t>(kStalenessBins, 0);
  std::map<int, WorkerRecord> workers_;
  std::map<std::string, at::Tensor> vectors_;  // Sandblaster's named vectors (not "x")
  struct Round {
    int64_t round = 0;
    std::set<int64_t> units;  // added in it
  };
  std::map<std::string, Round> rounds_;  // open accumulation rounds, by vector
};

}  // namespace dtrain::services::ps
