// A run's checkpoints (torchtitan's components/checkpoint.py): the Trainer asks it to restore
// before the first step and to save at the steps its runner chooses; the files, their checks
// and their layout-free metadata are train/Checkpoint.h's.
#pragma once

#include <cstdint>
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

  /// Writes step `step`'s checkpoint (every rank's strategy state and random-generator state;
  /// rank 0 the metadata with each file's digest, read back from disk), renames it into place,
  /// points `latest` at it and prunes the oldest. Collective unless `alone` (an asynchronous
  /// strategy's rank 0 saving by itself).
  void save(int64_t step, int64_t epoch, int64_t global_batch, bool alone = false);

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

  const TrainerOptions& options_;
  comm::Communicator& world_;
  const comm::ProcessGrid& grid_;
  parallel::Strategy& strategy_;
};

}  // namespace dtrain::train
