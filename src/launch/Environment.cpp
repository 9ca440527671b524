// Environment-variable rank discovery for torchrun-style, Slurm and Open MPI launches.
#include "dtrain/launch/Environment.h"

#if defined(__GLIBC__)
#include <unistd.h>

#include <malloc.h>
#endif

#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "dtrain/common/Device.h"
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

// `scontrol show node -o NODE`'s NodeAddr= (what slurmd on NODE is reached at); "" when scontrol
// is not there or does not know the node.
std::string slurm_node_addr(const std::string& node) {
  if (node.find_first_of("'\\ ") != std::string::npos) return "";
  FILE* pipe = ::popen(("scontrol show node -o '" + node + "' 2>/dev/null").c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  ::pclose(pipe);
  const auto at = out.find(" NodeAddr=");
  if (at == std::string::npos) return "";
  const auto begin = at + 10;
  return out.substr(begin, out.find_first_of(" \n", begin) - begin);
}

// Where a Slurm job's ranks meet: MASTER_ADDR when set, else the job's first node as Slurm
// addresses it (its NodeAddr; the node's name when scontrol gives none), checked to resolve and,
// over several nodes, not to loopback (Debian maps a host's own name to 127.0.1.1: the head would
// listen where the other nodes cannot reach).
std::string slurm_head_address(const std::string& nodelist, int nodes) {
  const std::string head = first_slurm_host(nodelist);
  const std::string addr = slurm_node_addr(head);
  const std::string chosen = addr.empty() ? head : addr;
  const std::string here =
      env("SLURMD_NODENAME") ? concat(" on node ", env("SLURMD_NODENAME")) : std::string();
  bool loopback = false;
  try {
    loopback = is_loopback(chosen);
  } catch (const InputError&) {
    DTRAIN_THROW(InputError, "Slurm: the job's first node ", head,
                 " (of SLURM_JOB_NODELIST=", nodelist, ") does not resolve", here,
                 addr.empty() ? " and scontrol gives no NodeAddr for it"
                              : concat(" (scontrol's NodeAddr ", addr, ")"),
                 ": set MASTER_ADDR to an address every node reaches "
                 "(examples/slurm/train.sbatch)");
  }
  DTRAIN_CHECK_INPUT(!loopback || nodes <= 1, "Slurm: the job's first node ", head, " (", chosen,
                     ") resolves to a loopback address", here, " while the job spans ", nodes,
                     " nodes: set MASTER_ADDR to an address every node reaches "
                     "(examples/slurm/train.sbatch)");
  return chosen;
}

// Slurm's tasks per node ("2(x3)", "2,2", "4"): the count when every node has the same, else an
// InputError naming them.
int even_tasks_per_node(const std::string& text) {
  std::vector<long> counts;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long count = std::strtol(item.c_str(), &end, 10);
    long repeat = 1;
    bool well_formed = end != nullptr && end != item.c_str();
    if (well_formed && *end == '(') {  // N(xM): N on M nodes
      well_formed = end[1] == 'x';
      repeat = std::strtol(end + 2, &end, 10);
      well_formed = well_formed && *end == ')';
      ++end;
    }
    DTRAIN_CHECK_INPUT(well_formed && count >= 1 && repeat >= 1 && *end == '\0',
                       "Slurm: SLURM_STEP_TASKS_PER_NODE='", text, "' is not N, N(xM) or a list");
    counts.insert(counts.end(), static_cast<size_t>(repeat), count);
    at = comma + 1;
  }
  for (const long count : counts) {
    DTRAIN_CHECK_INPUT(count == counts.front(), "Slurm: the step runs ", text,
                       " tasks on its nodes (SLURM_STEP_TASKS_PER_NODE): every node needs the "
                       "same number of ranks; give srun --ntasks-per-node N");
  }
  return static_cast<int>(counts.front());
}

// A Slurm job's rendezvous port when MASTER_PORT is not set: one per job, the same on every node
// and after a requeue.
int slurm_port() {
  const char* job = env("SLURM_JOB_ID");
  return job ? 20000 + static_cast<int>(std::strtoul(job, nullptr, 10) % 20000) : 29500;
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
    // A batch script is no step: its SLURM_NTASKS are the tasks srun would start.
    DTRAIN_CHECK_INPUT(env("SLURM_STEP_ID") || env_int("SLURM_NTASKS", 1) == 1,
                       "Slurm: this is the batch script of a job of ", env("SLURM_NTASKS"),
                       " tasks, not one of them: start them with srun (srun dtrain train ...; "
                       "examples/slurm/train.sbatch)");
    info.source = "slurm";
    info.rank = env_int("SLURM_PROCID", 0);
    info.world_size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    const int nodes = std::max(1, env_int("SLURM_NNODES", 1));
    // Every node the same number of ranks (the threads per rank and the launcher's node
    // arithmetic count on it): Slurm says so only when asked for --ntasks-per-node.
    DTRAIN_CHECK_INPUT(nodes == 1 || env("SLURM_NTASKS_PER_NODE"), "Slurm: a job step over ", nodes,
                       " nodes without --ntasks-per-node (SLURM_TASKS_PER_NODE=",
                       env("SLURM_TASKS_PER_NODE") ? env("SLURM_TASKS_PER_NODE") : "?",
                       "): give sbatch or srun --ntasks-per-node N so each node runs N ranks");
    // The step's own count (srun's, "2(x3)" or "2,1") before the job's (a batch script's
    // SLURM_NTASKS_PER_NODE reaches a step of fewer tasks too).
    if (const char* step = env("SLURM_STEP_TASKS_PER_NODE")) {
      info.local_world_size = even_tasks_per_node(step);
    } else {
      info.local_world_size = env("SLURM_NTASKS_PER_NODE") ? env_int("SLURM_NTASKS_PER_NODE", 1)
                                                           : std::max(1, info.world_size / nodes);
    }
    DTRAIN_CHECK_INPUT(
        info.local_world_size >= 1 && info.local_world_size * nodes == info.world_size,
        "Slurm: SLURM_NTASKS=", info.world_size, " is not SLURM_NNODES=", nodes,
        " x SLURM_NTASKS_PER_NODE=", info.local_world_size);
    const char* nodelist =
        env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    if (nodelist != nullptr && !env("MASTER_ADDR")) {
      info.master_addr = slurm_head_address(nodelist, nodes);
    }
    if (env("SLURM_JOB_ID")) info.master_port = slurm_port();
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    info.source = "openmpi";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.world_size);
  }
  if (const char* addr = env("MASTER_ADDR")) info.master_addr = addr;
  info.store_hosted_by_launcher = env("DTRAIN_AGENT_STORE") != nullptr;
  // A PyTorchJob's pod started as one rank while the operator asked for several per pod: its
  // RANK is the pod's index (and WORLD_SIZE the pods, or by a later operator the pods times
  // nprocPerNode); a launcher in the pod numbers the ranks, and says so in LOCAL_WORLD_SIZE /
  // DTRAIN_AGENT_STORE.
  if (info.source == "env" && env("PET_NPROC_PER_NODE") && !env("LOCAL_WORLD_SIZE") &&
      !info.store_hosted_by_launcher) {
    const std::string per_pod = env("PET_NPROC_PER_NODE");
    DTRAIN_CHECK_INPUT(per_pod.find_first_not_of("0123456789") != std::string::npos ||
                           std::atoi(per_pod.c_str()) <= 1,
                       "RANK=", info.rank, " (of WORLD_SIZE=", info.world_size,
                       ") numbers a PyTorchJob's pods while PET_NPROC_PER_NODE=", per_pod,
                       " asks for that many ranks in each: run `dtrain launch -- dtrain train ...` "
                       "as the container's command (it reads PET_*), or set nprocPerNode: 1");
  }
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

namespace {

// "host:port" -> the two (InputError naming `name` otherwise).
std::pair<std::string, int> split_endpoint(const std::string& text, const char* name) {
  const auto colon = text.rfind(':');
  DTRAIN_CHECK_INPUT(colon != std::string::npos && colon > 0 && colon + 1 < text.size() &&
                         text.find_first_not_of("0123456789", colon + 1) == std::string::npos,
                     "environment variable ", name, "='", text, "' is not HOST:PORT");
  const int port = std::atoi(text.c_str() + colon + 1);
  DTRAIN_CHECK_INPUT(port > 0 && port < 65536, "environment variable ", name, "='", text,
                     "': the port must be in 1..65535");
  return {text.substr(0, colon), port};
}

// Whether `host` is this machine: its host name (or that name's first label), or one of its own
// addresses other than loopback.
bool names_this_host(const std::string& host) {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') {
    const std::string self = name;
    if (host == self || host.rfind(self + ".", 0) == 0) return true;
  }
  try {
    return is_local_address(host);
  } catch (const Error&) {
    return false;  // does not resolve (yet): the launcher names it when it connects
  }
}

}  // namespace

LaunchEnvironment launch_environment() {
  LaunchEnvironment out;
  const auto text = [](const char* name) -> std::optional<std::string> {
    if (const char* value = env(name)) return std::string(value);
    return std::nullopt;
  };
  const auto number = [](const char* name) -> std::optional<int> {
    if (env(name)) return env_int(name, 0);
    return std::nullopt;
  };
  if (env("PET_NNODES") || env("PET_NPROC_PER_NODE") || env("PET_NODE_RANK") ||
      env("PET_MASTER_ADDR") || env("PET_RDZV_ENDPOINT")) {
    out.source = "kubernetes (PET_*)";
    out.nnodes = text("PET_NNODES");
    out.nproc_per_node = text("PET_NPROC_PER_NODE");
    out.node_rank = number("PET_NODE_RANK");
    out.master_addr = text("PET_MASTER_ADDR");
    out.master_port = number("PET_MASTER_PORT");
    out.max_restarts = number("PET_MAX_RESTARTS");
    if (const auto endpoint = text("PET_RDZV_ENDPOINT")) {
      const auto [host, port] = split_endpoint(*endpoint, "PET_RDZV_ENDPOINT");
      out.master_addr = host;
      out.master_port = port;
      // An elastic job's rendezvous lives on the pod it names (PyTorchJob: <job>-worker-0):
      // that pod hosts it as node 0 (the others are numbered as they join).
      if (!out.node_rank && names_this_host(host)) out.node_rank = 0;
    }
    // A PyTorchJob without an elastic policy: the pod's index and the pod count.
    if (!out.master_addr) out.master_addr = text("MASTER_ADDR");
    if (!out.master_port) out.master_port = number("MASTER_PORT");
    if (!out.node_rank && env("MASTER_ADDR")) out.node_rank = number("RANK");
    if (!out.nnodes && env("MASTER_ADDR")) out.nnodes = text("WORLD_SIZE");
  } else if (env("MASTER_ADDR") && env("WORLD_SIZE") && env("RANK")) {
    out.source = "kubernetes (PyTorchJob)";
    out.master_addr = text("MASTER_ADDR");
    out.master_port = number("MASTER_PORT");
    out.node_rank = number("RANK");
    out.nnodes = text("WORLD_SIZE");
  } else if (env("SLURM_STEP_ID") && env("SLURM_NNODES") && env("SLURM_NODEID")) {
    out.source = "slurm";
    const int nodes = env_int("SLURM_NNODES", 1);
    const int tasks = env_int("SLURM_STEP_NUM_TASKS", env_int("SLURM_NTASKS", nodes));
    DTRAIN_CHECK_INPUT(tasks == nodes,
                       "Slurm: dtrain launch runs once per node, its ranks under "
                       "it (srun --ntasks-per-node=1 dtrain launch --nproc-per-node N), but this "
                       "step runs ",
                       tasks, " tasks on ", nodes, " nodes");
    out.nnodes = std::to_string(nodes);
    out.node_rank = env_int("SLURM_NODEID", 0);
    const char* nodelist =
        env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    if (env("MASTER_ADDR")) {
      out.master_addr = text("MASTER_ADDR");
    } else if (nodelist != nullptr) {
      out.master_addr = slurm_head_address(nodelist, nodes);
    }
    out.master_port = env("MASTER_PORT") ? number("MASTER_PORT") : slurm_port();
  }
  return out;
}

int parse_nproc_per_node(const std::string& text, const std::string& where) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (text == "cpu") return cores;
  if (text == "gpu" || text == "auto") {
    const int gpus = built_with_cuda() ? cuda_device_count() : 0;
    DTRAIN_CHECK_INPUT(gpus > 0 || text == "auto", where, " 'gpu': this machine has no CUDA device",
                       built_with_cuda() ? "" : " (and this build has no CUDA)");
    return gpus > 0 ? gpus : cores;
  }
  DTRAIN_CHECK_INPUT(!text.empty() && text.size() <= 6 &&
                         text.find_first_not_of("0123456789") == std::string::npos &&
                         std::atoi(text.c_str()) >= 1,
                     where, ": expects a number of ranks >= 1, auto, cpu or gpu; got '", text, "'");
  return std::atoi(text.c_str());
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
