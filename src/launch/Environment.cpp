// Environment-variable rank discovery for torchrun-style, Slurm and Open MPI launches.
#include "dtrain/launch/Environment.h"

#if defined(__GLIBC__)
#include <unistd.h>

#include <malloc.h>
#endif

#include <ATen/Parallel.h>

#include <cstdlib>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"

namespace dtrain::launch {

namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return (value && *value) ? value : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* value = env(name);
  if (!value) return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  DTRAIN_CHECK_INPUT(end && *end == '\0' && parsed >= 0 && parsed < (1L << 30),
                     "environment variable ", name, "='", value, "' is not a non-negative integer");
  return static_cast<int>(parsed);
}

// First host of a Slurm node list: "gpu[03-05,07],cpu1" -> "gpu03".
std::string first_slurm_host(const std::string& list) {
  const auto bracket = list.find('[');
  const auto comma = list.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return list.substr(0, comma);
  }
  std::string first = list.substr(bracket + 1);
  first = first.substr(0, first.find_first_of("-,]"));
  return list.substr(0, bracket) + first;
}

}  // namespace

RankInfo discover_rank() {
  RankInfo info;
  if (env("RANK") || env("WORLD_SIZE")) {
    info.source = "env";
    info.rank = env_int("RANK", 0);
    info.world_size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", info.rank);
    info.local_world_size = env_int("LOCAL_WORLD_SIZE", info.world_size);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    info.source = "slurm";
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    const int nodes = std::max(1, env_int("SLURM_NNODES", 1));
    info.local_world_size = std::max(1, info.world_size / nodes);
    if (const char* nodelist = env("SLURM_JOB_NODELIST")) {
      info.master_addr = first_slurm_host(nodelist);
    }
    if (const char* job = env("SLURM_JOB_ID")) {
      info.master_port = 20000 + static_cast<int>(std::strtoul(job, nullptr, 10) % 20000);
    }
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    info.source = "openmpi";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.world_size);
  }
  if (const char* addr = env("MASTER_ADDR")) info.master_addr = addr;
  info.store_hosted_by_launcher = env("DTRAIN_AGENT_STORE") != nullptr;
  if (const char* prefix = env("DTRAIN_STORE_PREFIX")) info.store_prefix = prefix;
  info.master_port = env_int("MASTER_PORT", info.master_port);
  DTRAIN_CHECK_INPUT(info.world_size >= 1, "world size (", info.source, ") must be >= 1");
  DTRAIN_CHECK_INPUT(info.rank < info.world_size, "rank ", info.rank,
                     " is outside the world of size ", info.world_size, " (from ", info.source,
                     " variables)");
  DTRAIN_CHECK_INPUT(info.master_port > 0 && info.master_port < 65536,
                     "MASTER_PORT must be in 1..65535, got ", info.master_port);
  return info;
}

int default_threads(int local_world_size) {
  if (env("DTRAIN_THREADS")) return std::max(1, env_int("DTRAIN_THREADS", 1));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, local_world_size));
}

void set_threads(int threads) {
  DTRAIN_CHECK_INPUT(threads >= 1, "threads must be >= 1, got ", threads);
  at::set_num_threads(threads);
}

bool tune_allocator() {
#if defined(__GLIBC__)
  if (env("MALLOC_MMAP_THRESHOLD_") || env("MALLOC_TRIM_THRESHOLD_") ||
      env("DTRAIN_NO_MALLOC_TUNING")) {
    return false;
  }
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 512 << 20) == 1;
#else
  return false;
#endif
}

comm::InitOptions init_options(const RankInfo& info) {
  comm::InitOptions options;
  options.rank = info.rank;
  options.world_size = info.world_size;
  options.master_addr = info.master_addr;
  options.master_port = info.master_port;
  options.store_hosted_by_launcher = info.store_hosted_by_launcher;
  options.store_prefix = info.store_prefix;
  // A lone process needs no agreed port: take a free one so runs never collide.
  if (info.world_size == 1 && !env("MASTER_PORT")) options.master_port = free_port();
  return options;
}

comm::CommunicatorPtr init_from_env(const std::string& backend, int64_t timeout_ms) {
  const RankInfo info = discover_rank();
  set_threads(default_threads(info.local_world_size));
  tune_allocator();
  comm::InitOptions options = init_options(info);
  options.backend = backend;
  if (timeout_ms > 0) options.timeout = std::chrono::milliseconds(timeout_ms);
  return comm::init(options);
}

std::string self_executable() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "dtrain";
  path[n] = '\0';
  return path;
}

}  // namespace dtrain::launch
