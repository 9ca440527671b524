// `dtrain launch` and `dtrain train --nproc`: checks the options, meets the other nodes'
// launchers (Rendezvous.h), runs attempts of the job (Attempt.h) and restarts it after a
// failure or a change of nodes, up to --max-restarts, saying what each restart cost.
#include "dtrain/launch/Launcher.h"

#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <optional>

#include "dtrain/comm/Store.h"
#include "dtrain/common/Blas.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/launch/Environment.h"

#include "launch/Attempt.h"
#include "launch/Rendezvous.h"

namespace dtrain::launch {

using namespace agent;

namespace {

// The first signal asks the ranks to stop; a second stops them at once. The same SIGTERM
// delivered twice at once (GNU timeout sends it to its child and then to the child's process
// group) is one request: a person's second Ctrl-C is not coalesced.
int64_t g_first_signal_ns = 0;

int64_t monotonic_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

void on_signal(int signal) {
  if (g_forward_signal == 0) {
    g_forward_signal = signal;
    g_first_signal_ns = monotonic_ns();
  } else if (signal == SIGTERM && g_forward_signal == SIGTERM &&
             monotonic_ns() - g_first_signal_ns < 1000000000) {
    return;
  }
  g_signal_count = g_signal_count + 1;
}

}  // namespace

void parse_nnodes(const std::string& text, LaunchOptions& options) {
  auto whole = [&](const std::string& part) {
    DTRAIN_CHECK_INPUT(!part.empty() && part.size() <= 6 &&
                           part.find_first_not_of("0123456789") == std::string::npos,
                       "--nnodes: expects N or MIN:MAX (whole numbers), got '", text, "'");
    return std::atoi(part.c_str());
  };
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    options.nnodes = whole(text);
    options.min_nodes = 0;
    return;
  }
  options.min_nodes = whole(text.substr(0, colon));
  options.nnodes = whole(text.substr(colon + 1));
  DTRAIN_CHECK_INPUT(options.min_nodes >= 1 && options.min_nodes <= options.nnodes, "--nnodes ",
                     text, ": MIN:MAX needs 1 <= MIN <= MAX");
}

void validate(const LaunchOptions& o) {
  DTRAIN_CHECK_INPUT(o.nproc_per_node >= 1, "--nproc-per-node must be >= 1, got ",
                     o.nproc_per_node);
  DTRAIN_CHECK_INPUT(o.nnodes >= 1, "--nnodes must be >= 1, got ", o.nnodes);
  const bool elastic = o.min_nodes > 0;
  if (elastic) {
    DTRAIN_CHECK_INPUT(o.min_nodes <= o.nnodes, "--nnodes MIN:MAX needs MIN <= MAX, got ",
                       o.min_nodes, ":", o.nnodes);
    DTRAIN_CHECK_INPUT(o.node_rank <= 0, "--node-rank ", o.node_rank,
                       " with --nnodes MIN:MAX: give --node-rank 0 on the node that hosts the "
                       "rendezvous (at --master-addr) and leave it out on the others (they are "
                       "numbered as they join)");
  } else {
    DTRAIN_CHECK_INPUT(o.nnodes == 1 || o.node_rank >= 0,
                       "--node-rank is required with --nnodes > 1 (0 on the node at "
                       "--master-addr, which hosts the rendezvous)");
    DTRAIN_CHECK_INPUT(o.node_rank < o.nnodes, "--node-rank ", o.node_rank, " is outside 0..",
                       o.nnodes - 1);
  }
  DTRAIN_CHECK_INPUT(o.node_rank >= -1, "--node-rank must be >= 0, got ", o.node_rank);
  DTRAIN_CHECK_INPUT(o.master_port >= 0 && o.master_port < 65536,
                     "--master-port must be in 1..65535, got ", o.master_port);
  DTRAIN_CHECK_INPUT((o.nnodes == 1 && !elastic) || o.master_port > 0,
                     "--master-port is required with several nodes (every node must agree on it)");
  DTRAIN_CHECK_INPUT(o.threads >= 0, "--threads must be >= 1, got ", o.threads);
  DTRAIN_CHECK_INPUT(o.max_restarts >= 0 && o.max_restarts <= 1000,
                     "--max-restarts must be in 0..1000, got ", o.max_restarts);
  DTRAIN_CHECK_INPUT(o.max_replacements >= 0 && o.max_replacements <= 100000,
                     "--max-replacements must be in 0..100000, got ", o.max_replacements);
  DTRAIN_CHECK_INPUT(o.replica_size >= 1 && o.nproc_per_node % o.replica_size == 0,
                     "--replica-size must be >= 1 and divide --nproc-per-node ", o.nproc_per_node,
                     " (a replica's ranks are on one node), got ", o.replica_size);
  DTRAIN_CHECK_INPUT(!o.replace_first_replica || o.tolerate_failures,
                     "--replace-first-replica needs --tolerate-failures");
  DTRAIN_CHECK_INPUT(o.replica_size == 1 || o.tolerate_failures,
                     "--replica-size groups the ranks that fail together: it needs "
                     "--tolerate-failures");
  DTRAIN_CHECK_INPUT(o.max_replacements == 0 || o.tolerate_failures,
                     "--max-replacements starts failed ranks again while the others go on: it "
                     "needs --tolerate-failures");
  DTRAIN_CHECK_INPUT(o.rendezvous_timeout_seconds > 0 && o.rendezvous_timeout_seconds <= 86400,
                     "--rdzv-timeout must be in (0, 86400] seconds, got ",
                     o.rendezvous_timeout_seconds);
  DTRAIN_CHECK_INPUT(o.heartbeat_timeout_seconds >= 2 && o.heartbeat_timeout_seconds <= 3600,
                     "--heartbeat-timeout must be in [2, 3600] seconds, got ",
                     o.heartbeat_timeout_seconds);
  DTRAIN_CHECK_INPUT(
      std::isfinite(o.last_call_seconds) && o.last_call_seconds >= 0 && o.last_call_seconds <= 3600,
      "--rdzv-last-call must be between 0 and 3600 seconds, got ", o.last_call_seconds);
  DTRAIN_CHECK_INPUT(
      std::isfinite(o.grace_seconds) && o.grace_seconds >= 0 && o.grace_seconds <= 3600,
      "--grace must be between 0 and 3600 seconds, got ", o.grace_seconds);
  DTRAIN_CHECK_INPUT(std::isfinite(o.stop_timeout_seconds) && o.stop_timeout_seconds > 0 &&
                         o.stop_timeout_seconds <= 86400,
                     "--stop-timeout must be in (0, 86400] seconds, got ", o.stop_timeout_seconds);
  DTRAIN_CHECK_INPUT(!o.command.empty(), "no program to launch (put it after --)");
  DTRAIN_CHECK_INPUT(!find_program(o.command.front()).empty(), "program '", o.command.front(), "' ",
                     o.command.front().find('/') == std::string::npos
                         ? "is not found in PATH"
                         : "does not exist or is not executable");
}

std::string find_program(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat info {};
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
           ::access(path.c_str(), X_OK) == 0;
  };
  if (name.empty()) return "";
  if (name.find('/') != std::string::npos) return executable(name) ? name : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    if (executable(dir + "/" + name)) return dir + "/" + name;
    start = end + 1;
  }
  return "";
}

namespace {

// The step a run has reached, and the step its latest attempt resumed from, as the Trainer of
// rank 0 writes them (DTRAIN_PROGRESS_FILE: "START STEP").
struct Progress {
  int64_t start = -1;
  int64_t step = -1;
};
Progress read_progress(const std::string& path) {
  Progress p;
  std::ifstream in(path);
  if (!(in >> p.start >> p.step)) return {};
  return p;
}

}  // namespace

namespace {

/// OpenBLAS's generic kernel on a CPU newer than it (issue 77: 7x slower matrix products on
/// Sapphire Rapids): the ranks start with the kernel the CPU's instructions guarantee, unless
/// the user chose one (OPENBLAS_CORETYPE set: it reaches the ranks as it is).
void choose_blas_kernel(LaunchOptions& options) {
  const std::string blas_core = openblas_core_to_set();
  if (blas_core.empty()) return;
  options.extra_env.push_back("OPENBLAS_CORETYPE=" + blas_core);
  say("OpenBLAS chose its generic %s kernel on this CPU (%s, %s); the "
      "ranks run with OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to choose)\n",
      blas_info().core.c_str(), cpu_info().model.c_str(), cpu_info().vector_summary().c_str(),
      blas_core.c_str());
}

/// An empty temporary file rank 0 reports its step in ("" when none can be made).
std::string make_progress_file() {
  char name[] = "/tmp/dtrain-progress-XXXXXX";
  const int fd = ::mkstemp(name);
  if (fd < 0) return "";
  ::close(fd);
  return name;
}

/// This node's place in attempt `attempt`: a fixed job's, an elastic job's host's (it decides
/// the nodes) or a joining node's (which sets `attempt` to the one it joined); nullopt when the
/// job ended before this node could join it (`ended`: how). CommError when the rendezvous fails.
std::optional<Membership> rendezvous(const LaunchOptions& options, comm::Store& store,
                                     int& attempt, int restarts_used, bool host, Outcome& ended) {
  if (options.min_nodes <= 0) return fixed_rendezvous(options, store, attempt, restarts_used);
  if (host) return elastic_host_rendezvous(options, store, attempt, restarts_used);
  return elastic_join_rendezvous(options, store, attempt, ended);
}

}  // namespace

int launch(const LaunchOptions& requested) {
  validate(requested);
  LaunchOptions options = requested;
  g_name = options.name;
  choose_blas_kernel(options);
  const bool elastic = options.min_nodes > 0;
  const bool host = options.node_rank <= 0 && (elastic ? options.node_rank == 0 : true);
  const int port = options.master_port > 0 ? options.master_port : free_port();
  const int threads =
      options.threads > 0 ? options.threads : default_threads(options.nproc_per_node);
  const std::string me = host                     ? "node 0"
                         : options.node_rank >= 0 ? concat("node ", options.node_rank)
                                                  : std::string("joining node");

  struct sigaction action {};
  action.sa_handler = on_signal;
  for (const int signal : {SIGINT, SIGTERM, SIGUSR1}) sigaction(signal, &action, nullptr);

  comm::Store::Options store_options;
  store_options.host = options.master_addr;
  store_options.port = port;
  store_options.is_server = host;
  store_options.timeout = millis(options.rendezvous_timeout_seconds);
  std::unique_ptr<comm::Store> store;
  try {
    store = std::make_unique<comm::Store>(store_options);
  } catch (const CommError& e) {
    say("%s: %s\n", me.c_str(), e.message().c_str());
    return 1;
  }
  // Rank 0 reports its step here, so restarts can say how many steps they cost.
  const std::string progress_file = host ? make_progress_file() : std::string();
  struct Cleanup {
    std::string path;
    ~Cleanup() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  } cleanup{progress_file};

  std::vector<std::string> restart_notes;
  int64_t reached_before_restart = -1;
  std::string restart_reason;
  auto note_resume = [&](int nnodes) {
    if (reached_before_restart < 0 || progress_file.empty()) return;
    const Progress now = read_progress(progress_file);
    if (now.start < 0) return;
    restart_notes.push_back(
        concat("restart ", restart_notes.size() + 1, " (", restart_reason, "): stopped at step ",
               reached_before_restart, ", resumed from step ", now.start, " on ", nnodes, " node",
               nnodes == 1 ? "" : "s", " (",
               std::max<int64_t>(0, reached_before_restart - now.start), " steps lost)"));
    reached_before_restart = -1;
  };
  // The host tells nodes still waiting to join how the job ended.
  auto finish = [&](const Outcome& outcome, int code) {
    if (host && elastic) {
      try {
        store->set(kResultKey, encode(outcome));
      } catch (const CommError&) {
      }
    }
    return code;
  };
  int restarts_used = 0;
  int restarts = 0;
  for (int attempt = elastic && !host ? -1 : 0;; ++attempt) {
    Outcome outcome;
    Membership membership;
    try {
      Outcome ended;
      const std::optional<Membership> joined =
          rendezvous(options, *store, attempt, restarts_used, host, ended);
      if (!joined) {
        say("the job ended before this node could join it%s\n",
            ended.failed ? concat(" (", ended.description, ")").c_str() : "");
        return ended.failed ? std::max(1, ended.code) : 0;
      }
      membership = *joined;
    } catch (const CommError& e) {
      say("%s: failed: %s\n", me.c_str(), e.message().c_str());
      Outcome failed{true, 1, e.message(), false};
      return finish(failed, 1);
    }
    if (elastic && (attempt > 0 || !host)) {
      say("attempt %d: node %d of %d\n", attempt, membership.node_rank, membership.nnodes);
    }
    restarts_used = membership.restarts_used;
    try {
      if (!progress_file.empty()) std::ofstream(progress_file, std::ios::trunc);
      Attempt run(options, *store, attempt, membership, port, threads, progress_file);
      outcome = run.run();
    } catch (const CommError& e) {
      outcome = {true, 1, e.message(), false};
    }
    note_resume(membership.nnodes);
    if (outcome.stopped) {
      say("%s\n", outcome.description.c_str());
      return finish(outcome, outcome.code);
    }
    if (!outcome.failed) {
      if (restarts > 0) {
        say("the job succeeded after %d restart%s\n", restarts, restarts == 1 ? "" : "s");
        for (const auto& note : restart_notes) {
          say("  %s\n", note.c_str());
        }
      }
      return finish(outcome, 0);
    }
    const bool counted = !outcome.resize;
    // Exit code 2 is a rank's bad input (data, flags, files: dtrain's and argparse's): a restart
    // would fail the same way.
    const bool bad_input = outcome.code == 2 && !outcome.resize;
    if (outcome.interrupted || bad_input || (counted && restarts_used >= options.max_restarts)) {
      say("failed: %s%s\n", outcome.description.c_str(),
          restarts > 0
              ? concat(" (after ", restarts, " restart", restarts == 1 ? "" : "s", ")").c_str()
              : "");
      if (!outcome.interrupted && !bad_input && options.max_restarts == 0 &&
          !options.tolerate_failures && !options.failure_hint.empty()) {
        say("%s\n", options.failure_hint.c_str());
      }
      return finish(outcome, outcome.code == 0 ? 1 : outcome.code);
    }
    if (counted) ++restarts_used;
    ++restarts;
    if (!progress_file.empty()) reached_before_restart = read_progress(progress_file).step;
    restart_reason = counted ? "failure" : "resize";
    if (counted) {
      say("%s; restarting the job (restart %d of %d)\n", outcome.description.c_str(), restarts_used,
          options.max_restarts);
    } else {
      say("%s; restarting the job at the new size\n", outcome.description.c_str());
    }
  }
}

}  // namespace dtrain::launch
