// How a run stopped on request is told from one that failed, across processes: the exit code
// of a rank (and of dtrain) that stopped on a signal after saving its work is 128 + the signal,
// the shell's convention (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1); a failure exits 1
// (2: bad input). dtrain/train/Stop.h makes the request; the launcher reads the codes.
#pragma once

#include <string>

namespace dtrain {

inline int stopped_exit_code(int signal) { return 128 + signal; }
/// Whether an exit code is a stop on request (SIGINT, SIGTERM, SIGUSR1; SIGUSR2: the request
/// `dtrain train --nproc`'s launcher forwards to its ranks).
bool is_stopped_exit_code(int code);
/// "SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"; "signal N" for others.
std::string signal_name(int signal);

}  // namespace dtrain
