// A simulated straggler (--simulate-slowdown): a rank that takes FACTOR times as long as its
// work needs. Sleeping leaves its core to the other processes of a shared machine (the
// straggler costs the job nothing but time); spinning keeps the core busy, as a slow machine's
// capacity is lost to the job.
#pragma once

namespace dtrain {

/// Waits `seconds`, sleeping or (spin) keeping this thread's core busy.
void straggle(double seconds, bool spin);

}  // namespace dtrain
