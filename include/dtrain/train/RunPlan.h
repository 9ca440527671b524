// A run worked out once: from a job's options to what every part of the run reads (the Trainer's
// options, the layout, the batches, what the data set reads, how the ranks are started), by one
// function, plan_run. validate_job, planned_steps, run_job and the CLI's launcher read it and
// recompute none of it; `dtrain train --print-plan` prints it, every run folder and checkpoint
// keeps it (docs/ARCHITECTURE.md, "A run's path").
#pragma once

#include <string>

#include "dtrain/parallel/Strategies.h"
#include "dtrain/train/Job.h"

namespace dtrain::train {

/// How the launching process starts the ranks (dtrain launch's policy for this job).
struct LaunchPolicy {
  int ranks = 1;  ///< local ranks (--nproc)
  int max_restarts = 0;
  /// A rank other than 0 failing leaves the others running: parameter-server workers, and
  /// fault-tolerant replicas, which start again (up to max_replacements times) and join.
  bool tolerate_failures = false;
  int max_replacements = 0;
  /// Ranks that fail and start again as one (a replica: its tensor-parallel group, pipeline,
  /// hybrid shards or DiLoCo island), and whether rank 0's replica may too (the next leads).
  int replica_size = 1;
  bool replace_first_replica = false;
};

struct RunPlan {
  JobConfig job;  ///< the options (the model's recipe applied)
  int ranks = 1;  ///< the world: --nproc, or the launcher's
  /// The Trainer's options: --micro-batches folded into the accumulation steps, the bucket cap
  /// in bytes, --stage-replicas' pipeline.
  TrainerOptions trainer;
  /// The layout the strategy is checked against and the Trainer runs (the strategy as given).
  parallel::Layout layout;
  int64_t data_parallel = 1;  ///< replicas: ranks over pipeline x tensor parallelism
  BatchPlan batches;
  data::DataSource data;  ///< what the data set reads
  LaunchPolicy launch;
  /// The plan as TOML comments ("# layout: ..."), after the options it comes from.
  std::string describe() const;
};

/// The run of `job` on `ranks` ranks. InputError for options that cannot make one (two ways of
/// giving the micro-batches, a global batch that is not a whole number of them).
RunPlan plan_run(const JobConfig& job, int ranks);

/// --stage-replicas R0,R1,...: the pipeline has as many stages (the Trainer's and plan_run's
/// one rule).
void fold_stage_replicas(TrainerOptions& options);

/// The layout a Trainer's options make on `data_parallel` replicas (plan_run's and the
/// Trainer's own, one function).
parallel::Layout layout_of(const TrainerOptions& options, int64_t data_parallel);

}  // namespace dtrain::train
