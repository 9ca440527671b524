// Rank discovery (torchrun's variables, else Slurm's, else Open MPI's, else a 1-rank world) and
// joining the world it describes.
#pragma once

#include <string>

#include "dtrain/comm/Communicator.h"

namespace dtrain::launch {

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Where it came from: "env" (RANK/WORLD_SIZE), "slurm", "openmpi" or "single".
  std::string source = "single";
  /// Set by `dtrain launch` (DTRAIN_AGENT_STORE, DTRAIN_STORE_PREFIX): the launcher hosts the
  /// rendezvous store, and this attempt's keys carry the prefix.
  bool store_hosted_by_launcher = false;
  std::string store_prefix;
};

/// The comm::InitOptions that join the world `info` describes (a lone process gets a free
/// port); backend, timeout and interface are left at their defaults.
comm::InitOptions init_options(const RankInfo& info);

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; falls back
/// to SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/... and OMPI_COMM_WORLD_*. Malformed values are
/// InputErrors naming the variable.
RankInfo discover_rank();

/// Threads for this rank's tensor ops: $DTRAIN_THREADS, else cores / local ranks (at least 1).
int default_threads(int local_world_size);

/// Sets LibTorch's intra-op thread count (it starts with 1).
void set_threads(int threads);

/// glibc malloc, tuned for a training loop: blocks under 32 MiB come from the heap and freed
/// memory up to 512 MiB is kept for reuse, instead of every large temporary (an optimizer's,
/// a gradient bucket) being mmapped, page-faulted in and unmapped again each step (measured:
/// LibTorch's Adam step on 100M parameters 535 -> 180 ms; docs/design/launch.md). Not applied
/// when MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ are set (the user chose) or
/// DTRAIN_NO_MALLOC_TUNING is; returns whether it was applied (false off glibc).
bool tune_allocator();

/// discover_rank(), set_threads(default), tune_allocator(), then comm::init. `timeout_ms` 0
/// keeps the default.
comm::CommunicatorPtr init_from_env(const std::string& backend = "gloo", int64_t timeout_ms = 0);

/// The running program's path (/proc/self/exe; "dtrain" when it cannot be read): what a
/// command relaunches itself as on its local ranks.
std::string self_executable();

}  // namespace dtrain::launch
