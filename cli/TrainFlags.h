// `dtrain train`'s flags (and config keys), bound into a JobConfig: the model's, the data's,
// the strategies' (from their registry), the Trainer's and the launcher's.
#pragma once

#include <CLI/CLI.hpp>

#include "dtrain/common/Flags.h"
#include "dtrain/train/Job.h"

namespace dtrain::cli {

/// Declares every `dtrain train` flag on `app`, bound into `job` (the strategies' own flags into
/// `strategy_flags`, which binds them into job.strategy_options).
void add_train_options(CLI::App& app, dtrain::train::JobConfig& job,
                       dtrain::FlagSet& strategy_flags);

}  // namespace dtrain::cli
