// Where a run is, from its folder's files alone (`dtrain status RUNDIR`): for a run on a cluster
// whose terminal is not yours.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dtrain::train {

struct RunStatus {
  std::string run_dir;
  /// "starting" (no step yet), "training", "finished", "stopped" (on request: resumable),
  /// "silent" (no record for a long while: failed, killed or hung).
  std::string state = "starting";
  int64_t step = 0;
  int64_t total_steps = 0;
  /// The step this attempt started at (> 0: resumed).
  int64_t start_step = 0;
  int64_t epoch = -1;
  std::optional<double> loss;
  std::optional<double> lr;
  /// Samples (or tokens, for a language model) a second, over the last steps.
  std::optional<double> throughput;
  std::string throughput_unit = "samples/s";
  std::optional<double> val_loss;
  int64_t val_step = -1;
  /// Seconds a step, from the last records' times; the estimated time to the end.
  std::optional<double> seconds_per_step;
  std::optional<double> eta_seconds;
  int world_size = 0;
  /// "DP 2 x PP 1 x TP 2" (with CP and EP where > 1), and the strategy.
  std::string layout;
  std::string strategy;
  /// --fault-tolerance replicas: the replicas present in the last step.
  std::optional<int64_t> replicas;
  /// Seconds since the metrics file was last written.
  double seconds_since_record = 0.0;
  /// The newest checkpoint (step, path, seconds since written); step -1 when none.
  int64_t checkpoint_step = -1;
  std::string checkpoint_path;
  double seconds_since_checkpoint = 0.0;
  /// Signal that stopped it (state "stopped").
  int stopped_by_signal = 0;
};

/// Reads RUN_DIR/metrics.jsonl (or the metrics file itself) and the newest checkpoint of
/// RUN_DIR/checkpoints. A run whose file has been silent for more than max(120 s, 20 steps) while
/// not finished is "silent". InputError when there is no metrics file or it is not JSON Lines.
RunStatus read_run_status(const std::string& run_dir);

/// The status in a few lines for a terminal.
std::string describe(const RunStatus& status);

/// The status as one JSON object.
std::string to_json(const RunStatus& status);

}  // namespace dtrain::train
