// fork/exec of local ranks, output multiplexing with rank prefixes, and failure propagation.
#include "dtrain/launch/Launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/launch/Environment.h"

namespace dtrain::launch {

namespace {

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;  // read ends
  int err_fd = -1;
  std::string out_buffer;
  std::string err_buffer;
  bool running = false;
  int status = 0;
};

volatile sig_atomic_t g_forward_signal = 0;
void on_signal(int signal) { g_forward_signal = signal; }

// Writes complete segments of `buffer` with a prefix. '\r' segments (progress bars) are redrawn
// in place; '\n' segments are lines.
void flush_lines(std::string& buffer, const std::string& prefix, std::FILE* out, bool all) {
  size_t start = 0;
  for (size_t i = 0; i < buffer.size(); ++i) {
    if (buffer[i] != '\n' && buffer[i] != '\r') continue;
    const std::string segment = buffer.substr(start, i - start);
    if (buffer[i] == '\r') {
      if (!segment.empty()) std::fprintf(out, "%s%s", prefix.c_str(), segment.c_str());
      std::fputc('\r', out);
    } else {
      std::fprintf(out, "%s%s\n", prefix.c_str(), segment.c_str());
    }
    start = i + 1;
  }
  buffer.erase(0, start);
  if (all && !buffer.empty()) {
    std::fprintf(out, "%s%s\n", prefix.c_str(), buffer.c_str());
    buffer.clear();
  }
  std::fflush(out);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return concat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return concat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)),
                  ")");
  }
  return "ended";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

void validate(const LaunchOptions& o) {
  DTRAIN_CHECK_INPUT(o.nproc_per_node >= 1, "--nproc-per-node must be >= 1, got ",
                     o.nproc_per_node);
  DTRAIN_CHECK_INPUT(o.nnodes >= 1, "--nnodes must be >= 1, got ", o.nnodes);
  DTRAIN_CHECK_INPUT(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank ", o.node_rank,
                     " is outside 0..", o.nnodes - 1);
  DTRAIN_CHECK_INPUT(o.master_port >= 0 && o.master_port < 65536,
                     "--master-port must be in 1..65535, got ", o.master_port);
  DTRAIN_CHECK_INPUT(o.nnodes == 1 || o.master_port > 0,
                     "--master-port is required with --nnodes > 1 (every node must agree on it)");
  DTRAIN_CHECK_INPUT(o.threads >= 0, "--threads must be >= 1, got ", o.threads);
  DTRAIN_CHECK_INPUT(std::isfinite(o.grace_seconds) && o.grace_seconds >= 0 &&
                         o.grace_seconds <= 3600,
                     "--grace must be between 0 and 3600 seconds, got ", o.grace_seconds);
  DTRAIN_CHECK_INPUT(!o.command.empty(), "no program to launch (put it after --)");
  DTRAIN_CHECK_INPUT(!find_program(o.command.front()).empty(), "program '", o.command.front(),
                     "' ", o.command.front().find('/') == std::string::npos
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

int launch(const LaunchOptions& options) {
  validate(options);
  const int port = options.master_port > 0 ? options.master_port : free_port();
  const int world = options.nproc_per_node * options.nnodes;
  const int threads =
      options.threads > 0 ? options.threads : default_threads(options.nproc_per_node);
  const bool tty = ::isatty(STDOUT_FILENO) == 1;

  std::vector<Rank> ranks(options.nproc_per_node);
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  for (int local = 0; local < options.nproc_per_node; ++local) {
    Rank& r = ranks[local];
    r.rank = options.node_rank * options.nproc_per_node + local;
    int out_pipe[2], err_pipe[2];
    DTRAIN_CHECK(::pipe(out_pipe) == 0 && ::pipe(err_pipe) == 0, "pipe() failed: ",
                 std::strerror(errno));
    std::vector<std::string> env = {
        concat("RANK=", r.rank),
        concat("WORLD_SIZE=", world),
        concat("LOCAL_RANK=", local),
        concat("LOCAL_WORLD_SIZE=", options.nproc_per_node),
        concat("GROUP_RANK=", options.node_rank),
        concat("MASTER_ADDR=", options.master_addr),
        concat("MASTER_PORT=", port),
        concat("DTRAIN_THREADS=", threads),
        concat("OMP_NUM_THREADS=", threads),
    };
    if (tty && r.rank == 0) env.push_back("DTRAIN_PROGRESS_TTY=1");
    env.insert(env.end(), options.extra_env.begin(), options.extra_env.end());
    const pid_t pid = ::fork();
    DTRAIN_CHECK(pid >= 0, "fork() failed: ", std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      ::setpgid(0, 0);
      ::dup2(out_pipe[1], STDOUT_FILENO);
      ::dup2(err_pipe[1], STDERR_FILENO);
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      ::close(out_pipe[1]);
      ::close(err_pipe[1]);
      for (const auto& entry : env) ::putenv(const_cast<char*>(entry.c_str()));
      std::vector<char*> argv;
      for (const auto& arg : options.command) argv.push_back(const_cast<char*>(arg.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "dtrain launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::setpgid(pid, pid);  // (also done in the child) so signals reach its whole group
    r.pid = pid;
    r.out_fd = out_pipe[0];
    r.err_fd = err_pipe[0];
    r.running = true;
  }

  auto prefix_of = [&](const Rank& r) {
    return options.prefix_output ? concat("[rank ", r.rank, "] ") : std::string();
  };
  auto signal_all = [&](int signal) {
    for (auto& r : ranks) {
      if (r.running) ::kill(-r.pid, signal);
    }
  };

  int failed_rank = -1;
  int failed_status = 0;
  std::chrono::steady_clock::time_point stop_deadline{};
  bool stopping = false;
  bool killed = false;
  auto begin_stop = [&](int signal) {
    if (stopping) return;
    stopping = true;
    signal_all(signal);
    stop_deadline = std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(options.grace_seconds * 1e3));
  };

  for (;;) {
    // Drain output.
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, bool>> owners;  // (rank, is_stderr)
    for (auto& r : ranks) {
      if (r.out_fd >= 0) {
        fds.push_back({r.out_fd, POLLIN, 0});
        owners.push_back({&r, false});
      }
      if (r.err_fd >= 0) {
        fds.push_back({r.err_fd, POLLIN, 0});
        owners.push_back({&r, true});
      }
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 50);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Rank& r = *owners[i].first;
      const bool is_err = owners[i].second;
      char chunk[8192];
      const ssize_t n = ::read(fds[i].fd, chunk, sizeof(chunk));
      std::string& buffer = is_err ? r.err_buffer : r.out_buffer;
      std::FILE* sink = is_err ? stderr : stdout;
      if (n > 0) {
        buffer.append(chunk, static_cast<size_t>(n));
        flush_lines(buffer, prefix_of(r), sink, false);
      } else {
        flush_lines(buffer, prefix_of(r), sink, true);
        ::close(fds[i].fd);
        (is_err ? r.err_fd : r.out_fd) = -1;
      }
    }
    if (fds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));

    // Reap.
    bool any_running = false;
    for (auto& r : ranks) {
      if (!r.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(r.pid, &status, WNOHANG);
      if (done == r.pid) {
        r.running = false;
        r.status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank < 0 && !stopping) {
          failed_rank = r.rank;
          failed_status = status;
          std::fprintf(stderr, "dtrain launch: rank %d (pid %d) %s; stopping the other ranks\n",
                       r.rank, static_cast<int>(r.pid), describe_status(status).c_str());
          begin_stop(SIGTERM);
        }
      } else {
        any_running = true;
      }
    }
    if (g_forward_signal != 0 && !stopping) begin_stop(g_forward_signal);
    if (stopping && !killed && any_running && std::chrono::steady_clock::now() > stop_deadline) {
      signal_all(SIGKILL);
      killed = true;
    }
    bool any_output = false;
    for (const auto& r : ranks) any_output = any_output || r.out_fd >= 0 || r.err_fd >= 0;
    if (!any_running && !any_output) break;
    if (!any_running && killed) break;  // a grandchild may hold a pipe open: do not wait on it
  }

  if (failed_rank >= 0) {
    std::fprintf(stderr, "dtrain launch: failed: rank %d %s\n", failed_rank,
                 describe_status(failed_status).c_str());
    const int code = exit_code_of(failed_status);
    return code == 0 ? 1 : code;
  }
  if (g_forward_signal != 0) return 128 + g_forward_signal;
  return 0;
}

}  // namespace dtrain::launch
