// `dtrain train --dry-run`: what each rank of the run needs in memory (setup, step, offload),
// as the planner counts it, against this machine, before anything is built.
#pragma once

#include "dtrain/train/RunPlan.h"

namespace dtrain::cli {

/// Prints the run's layout and memory per rank against this machine's; InputError (exit 2)
/// naming both when it does not fit. Builds nothing but a small non-decoder model to count its
/// parameters, and reads a language data set for its vocabulary.
int dry_run(const train::RunPlan& run);

}  // namespace dtrain::cli
