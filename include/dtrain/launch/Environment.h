// Rank discovery (torchrun's variables, else Slurm's, else Open MPI's, else a 1-rank world) and
// joining the world it describes.
#pragma once

#include <optional>
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

/// What a scheduler tells `dtrain launch` about its node, for the flags not given (each unset
/// when nothing says): torchrun's PET_<FLAG> variables (Kubeflow's PyTorchJob with an elastic
/// policy or nprocPerNode, Trainer v2's TrainJob: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
/// PET_MASTER_ADDR, PET_MASTER_PORT, PET_MAX_RESTARTS, PET_RDZV_ENDPOINT), else PyTorchJob's
/// MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE counting its pods, else a Slurm step of one task
/// per node (`srun --ntasks-per-node=1 dtrain launch`: SLURM_NNODES, SLURM_NODEID, the first
/// node's address). An elastic rendezvous endpoint hosted by this node's host name makes it node 0.
/// InputError for malformed values, naming the variable.
struct LaunchEnvironment {
  /// Where they came from: "kubernetes (PET_*)", "kubernetes (PyTorchJob)", "slurm" or "".
  std::string source;
  std::optional<std::string> nnodes;
  std::optional<std::string> nproc_per_node;
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  std::optional<int> max_restarts;
};
LaunchEnvironment launch_environment();

/// torchrun's --nproc-per-node: N, "gpu" (this machine's CUDA devices; InputError without
/// one), "cpu" (its cores) or "auto" (the CUDA devices, else the cores). `where` names the
/// flag or variable in errors.
int parse_nproc_per_node(const std::string& text, const std::string& where);

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
