// Stopping a run on request (Ctrl-C, a scheduler's SIGTERM, Slurm's SIGUSR1 warning before its
// time limit): every rank finishes its step, the ranks agree on the step to stop at (the flag
// rides on the step's loss allreduce), a checkpoint is saved there, and fit() returns with
// FitResult::stopped_by set. A second signal ends the process at once.
#pragma once

#include "dtrain/common/Signals.h"  // the exit codes of a stop

namespace dtrain::train {

/// Asks every fit() of this process to stop at the end of its current step and save a
/// checkpoint (with --checkpoint-dir). `signal` names the request (SIGINT, SIGTERM, SIGUSR1;
/// any positive number). Async-signal-safe: callable from a signal handler.
void request_stop(int signal) noexcept;
/// The first request's signal; 0 when none was made.
int stop_requested() noexcept;
/// Forgets the request (a new run in the same process).
void clear_stop_request() noexcept;
/// SIGINT, SIGTERM and SIGUSR1 request a stop (request_stop); a second one of them ends the
/// process at once, by the signal's default action. SIGUSR2 is the request `dtrain launch`
/// forwards to its ranks: it never ends a rank at once (a scheduler may signal the ranks
/// themselves as well). dtrain's command line installs these.
void stop_on_signals();

}  // namespace dtrain::train
