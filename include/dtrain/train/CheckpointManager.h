// A run's checkpoints (torchtitan's components/checkpoint.py): the Trainer asks it to restore
// before the first step and to save at the steps its runner chooses; the files, their checks
// and their layout-free metadata are train/Checkpoint.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/train/Trainer.h"

namespace dtrain::train {

struct TensorInfo;

/// Checkpoints of one fit: options.checkpoint_dir, .resume, .keep_checkpoints, .seed and
/// .checkpoint_extras; the strategy's state at the grid's layout.
class CheckpointManager {
 public:
  CheckpointManager(const TrainerOptions& options, comm::Communicator& world,
                    const comm::ProcessGrid& grid, parallel::Strategy& strategy);
  /// Waits for a checkpoint still being written (rank 0 stops waiting for the other ranks'
  /// files); what went wrong is printed, not thrown: call wait() to see it.
  ~CheckpointManager();

  /// Writes step `step`'s checkpoint (every rank's strategy state and random-generator state;
  /// rank 0 the metadata with each file's digest, read back from disk), renames it into place,
  /// points `latest` at it and prunes the oldest. Collective unless `alone` (an asynchronous
  /// strategy's rank 0, or --fault-tolerance replicas' leading replica, saving by itself:
  /// collective over this rank's tensor-parallel group, whose first rank publishes).
  ///
  /// Replicas that shard the state between them (--shard-across-replicas) save together, and a
  /// member failing meanwhile does not stop the others: that checkpoint is left unpublished (a
  /// warning says so; the newest complete one stays `latest`) and training goes on.
  ///
  /// options.async_checkpoint: waits for the previous checkpoint's background write, then
  /// copies the state into host memory (PyTorch's async DCP staging) and returns; a thread
  /// writes the files, and rank 0's, once every rank has written its own (marker files in the
  /// staging directory), verifies, renames and points `latest` at it. What is written is the
  /// state at this call, whatever training does after it returns.
  void save(int64_t step, int64_t epoch, int64_t global_batch, bool alone = false);

  /// Asynchronous checkpoints: blocks until the checkpoint being written is complete on this
  /// rank (rank 0: published as `latest`) and rethrows what went wrong writing it (Error naming
  /// the ranks whose files did not arrive within the world's timeout). A no-op when none is.
  void wait();

  /// Called on the training thread when wait() (or save()) finds an asynchronous checkpoint
  /// complete: its step and how long the background took to write (and, rank 0, publish) it.
  std::function<void(int64_t step, double seconds)> on_written;
  /// Called once this rank's files of step `step`'s checkpoint are written (asynchronous:
  /// staged), before the other ranks hear of them (failure injection: DTRAIN_SIMULATE_FAILURE).
  std::function<void(int64_t step)> on_files;

  /// Collective. Loads the newest checkpoint that verifies into the strategy (resharded to this
  /// layout) and the random generators, and returns its step (0: none, or resume is off).
  /// InputError when checkpoints exist but none verifies, or one was trained at another global
  /// batch (the data order would change).
  int64_t restore(int64_t global_batch);

 private:
  /// Collective. The newest checkpoint that verifies ("" for none); damaged newer ones are set
  /// aside, and InputError when checkpoints exist but none verifies.
  std::string choose();
  /// The model's tensors at full (tensor-parallel: unsplit) shapes, as the metadata records them.
  std::vector<TensorInfo> model_tensors() const;
  /// Rank 0, the files of every rank in `staging`: digests them, writes meta.json, renames the
  /// directory into place, points `latest` at it and prunes.
  void publish(const std::string& staging, const std::string& name, int64_t step, int64_t epoch,
               int64_t global_batch, const std::vector<TensorInfo>& tensors) const;

  struct Background;
  std::unique_ptr<Background> background_;

  const TrainerOptions& options_;
  comm::Communicator& world_;
  const comm::ProcessGrid& grid_;
  parallel::Strategy& strategy_;
};

}  // namespace dtrain::train
