// Downpour SGD (DistBelief): each rank is a model replica training on its own part of the data
// against the parameter-server shards, never waiting for the other replicas. It pushes the
// gradients it accumulated over n_push steps and fetches fresh parameters every n_fetch steps,
// both on a background thread beside compute; the shards apply the updates (their optimizer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "dtrain/parallel/Loops.h"
#include "parallel/ps/ReplicaStrategy.h"

namespace dtrain::parallel::ps {

StrategyInfo downpour_strategy();

class DownpourStrategy : public ReplicaStrategy, public AsynchronousWorker {
 public:
  explicit DownpourStrategy(StrategyOptions options);
  ~DownpourStrategy() override;
  std::string name() const override { return "downpour"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  /// Not collective: writes the shards' newest parameters (pulled now) as a one-file checkpoint.
  void save(const std::string& directory) override;
  MemoryReport memory_report() const override;
  int64_t global_steps() const override;
  void finish() override;
  std::string await_workers() override;
  std::map<std::string, double> run_metrics() override;

 private:
  void start();
  void stop();
  void background();
  void rethrow_background_error();
  /// Copies a pull that has landed into the model; returns whether there was one.
  bool apply_landed_pull(std::unique_lock<std::mutex>& lock);
  /// Requests a pull that includes every push made so far and waits for it (bounded).
  void pull_now(std::unique_lock<std::mutex>& lock, const char* why);
  /// Hands the accumulated gradient to the background thread (after the previous push).
  void queue_push(std::unique_lock<std::mutex>& lock, bool last = false);
  /// Bound of the waits on the background thread: an RPC's deadline and its retries, thrice.
  std::chrono::milliseconds wait_limit() const;
  DownpourOptions downpour_;
  bool started_ = false;

  // Worker side (the training thread).
  at::Tensor accumulated_;  // gradients since the last push
  int steps_accumulated_ = 0;
  std::vector<int64_t> accumulated_versions_;  // versions the oldest of them was computed on
  int steps_since_fetch_ = 0;
  std::vector<int64_t> versions_;  // versions of the parameters the model holds
  int64_t pushes_reflected_ = 0;   // own pushes included in them

  // Shared with the background thread, under mutex_.
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;
  bool stopping_ = false;
  std::exception_ptr error_;
  bool push_pending_ = false;
  bool outgoing_last_ = false;
  at::Tensor outgoing_;  // the gradient being pushed
  std::vector<int64_t> outgoing_versions_;
  int64_t pushes_issued_ = 0, pushes_done_ = 0;
  bool pull_requested_ = false, pull_landed_ = false;
  at::Tensor incoming_;  // parameters pulled, not yet in the model
  std::vector<int64_t> incoming_versions_;
  int64_t incoming_covers_ = 0;  // own pushes done before that pull began
  int64_t newest_version_ = 0;   // newest server version seen (replies, pulls)
  int64_t last_staleness_ = 0;   // of the last push (max over shards)
  double last_lr_ = 0;           // the shards' learning rate at the last push
  double step_seconds_ = 0;      // mean compute time of a step (for await_workers)
  int64_t steps_done_ = 0;
  int64_t skipped_steps_ = 0;   // steps whose gradient held NaN or Inf (not pushed)
  int64_t refused_pushes_ = 0;  // pushes a shard refused as non-finite
};

}  // namespace dtrain::parallel::ps
