// fork/exec of local ranks, output multiplexing with rank prefixes, and failure propagation
// across nodes through the rendezvous store: heartbeats, the first failure, restarts.
#include "dtrain/launch/Launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cmath>
#include <fstream>
#include <optional>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "dtrain/comm/Store.h"
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
  DTRAIN_CHECK_INPUT(options.min_nodes >= 1 && options.min_nodes <= options.nnodes,
                     "--nnodes ", text, ": MIN:MAX needs 1 <= MIN <= MAX");
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
  DTRAIN_CHECK_INPUT(o.rendezvous_timeout_seconds > 0 && o.rendezvous_timeout_seconds <= 86400,
                     "--rdzv-timeout must be in (0, 86400] seconds, got ",
                     o.rendezvous_timeout_seconds);
  DTRAIN_CHECK_INPUT(o.heartbeat_timeout_seconds >= 2 && o.heartbeat_timeout_seconds <= 3600,
                     "--heartbeat-timeout must be in [2, 3600] seconds, got ",
                     o.heartbeat_timeout_seconds);
  DTRAIN_CHECK_INPUT(std::isfinite(o.last_call_seconds) && o.last_call_seconds >= 0 &&
                         o.last_call_seconds <= 3600,
                     "--rdzv-last-call must be between 0 and 3600 seconds, got ",
                     o.last_call_seconds);
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

namespace {

using Clock = std::chrono::steady_clock;

// How an attempt ended.
struct Outcome {
  bool failed = false;
  int code = 0;             // the exit code the launcher returns
  std::string description;  // "node 1 rank 1 (pid 4242) exited with code 3"
  bool interrupted = false; // the user stopped the job: no restart
  bool resize = false;      // elastic: a node is waiting to join; restart at the new size
};

// Keys of the launchers' protocol in the store (the ranks' keys carry "attempt-N/").
std::string attempt_key(int attempt, const std::string& name) {
  return concat("dtrain-agent/", attempt, "/", name);
}
std::string heartbeat_key(int attempt, int node) {
  return attempt_key(attempt, concat("heartbeat/", node));
}
// The attempt the host is at; the job's result once it is over ("code|kind|text").
const std::string kCurrentKey = "dtrain-agent/current";
const std::string kResultKey = "dtrain-agent/result";

// "code|kind|text" <-> Outcome.
std::string encode(const Outcome& o) {
  const char* kind = !o.failed ? "success" : o.interrupted ? "interrupt" : o.resize ? "resize"
                                                                                    : "failure";
  return concat(o.code, "|", kind, "|", o.description);
}
Outcome decode(const std::string& value) {
  Outcome o;
  o.failed = true;
  const auto first = value.find('|');
  const auto second = value.find('|', first + 1);
  if (first == std::string::npos || second == std::string::npos) {
    o.code = 1;
    o.description = value;
    return o;
  }
  o.code = std::atoi(value.substr(0, first).c_str());
  const std::string kind = value.substr(first + 1, second - first - 1);
  o.failed = kind != "success";
  o.interrupted = kind == "interrupt";
  o.resize = kind == "resize";
  o.description = value.substr(second + 1);
  return o;
}

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

// Who takes part in an attempt, as its rendezvous decided.
struct Membership {
  int node_rank = 0;
  int nnodes = 1;
  int restarts_used = 0;  // failures restarted from before this attempt (the same on every node)
};

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
}

// How long a local rank's failure waits before it is published as the job's: long enough for
// another node's failure (the root cause, when ours is a broken connection) to arrive first, or
// for its heartbeat to fall silent.
constexpr std::chrono::milliseconds kSettle{1500};

void check_interrupt(const char* waiting_for) {
  if (g_forward_signal != 0) {
    DTRAIN_THROW(CommError, "interrupted by signal ", g_forward_signal, " while waiting for ",
                 waiting_for);
  }
}

// Fixed node count: every node joins the attempt under its --node-rank, or CommError naming
// the missing ones after the timeout.
Membership fixed_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                            int restarts_used) {
  const int node_rank = std::max(0, o.node_rank);
  store.set(attempt_key(attempt, concat("node/", node_rank)), "joined");
  store.add(attempt_key(attempt, "joined"), 1);
  const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
  while (store.add(attempt_key(attempt, "joined"), 0) < o.nnodes) {
    store.add(heartbeat_key(attempt, node_rank), 1);
    check_interrupt("the other nodes");
    if (Clock::now() > deadline) {
      std::string missing;
      for (int n = 0; n < o.nnodes; ++n) {
        if (!store.check(attempt_key(attempt, concat("node/", n)))) {
          missing += concat(missing.empty() ? "" : ", ", n);
        }
      }
      DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt,
                   "): node", missing.find(',') == std::string::npos ? " " : "s ", missing,
                   " did not join within ", o.rendezvous_timeout_seconds, " s (--rdzv-timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {node_rank, o.nnodes, restarts_used};
}

// Elastic, on the host (node 0): once min_nodes have joined, waits the last call for more (or
// until max have), then closes the attempt at the count it has. Joiners numbered >= that count
// wait for the next attempt.
Membership elastic_host_rendezvous(const LaunchOptions& o, comm::Store& store, int attempt,
                                   int restarts_used) {
  store.set(kCurrentKey, std::to_string(attempt));
  const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
  std::optional<Clock::time_point> last_call;
  for (;;) {
    store.add(heartbeat_key(attempt, 0), 1);
    check_interrupt("nodes to join");
    const int joined = static_cast<int>(
        std::min<int64_t>(o.nnodes, 1 + store.add(attempt_key(attempt, "joined"), 0)));
    const auto now = Clock::now();
    if (joined >= o.min_nodes && !last_call) last_call = now + millis(o.last_call_seconds);
    if (joined == o.nnodes || (last_call && now >= *last_call)) {
      store.set(attempt_key(attempt, "closed"), concat(joined, "|", restarts_used));
      return {0, joined, restarts_used};
    }
    if (!last_call && now > deadline) {
      DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt, "): ",
                   joined, " of at least ", o.min_nodes, " nodes joined within ",
                   o.rendezvous_timeout_seconds, " s (--rdzv-timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Elastic, on any other node: joins the host's current attempt; when that attempt closed
// without it (it is running, or full), asks the running job to make room and joins the next.
// Returns nullopt when the job ended before this node got in (its result is in `ended`).
std::optional<Membership> elastic_join_rendezvous(const LaunchOptions& o, comm::Store& store,
                                                  int& attempt, Outcome& ended) {
  if (attempt < 0) attempt = std::atoi(store.get(kCurrentKey).c_str());
  bool said_waiting = false;
  for (;;) {
    const int slot = static_cast<int>(store.add(attempt_key(attempt, "joined"), 1));
    const auto deadline = Clock::now() + millis(o.rendezvous_timeout_seconds);
    for (;;) {
      check_interrupt("the rendezvous to close");
      if (store.check(attempt_key(attempt, "closed"))) break;
      if (store.check(kResultKey)) {
        ended = decode(store.get(kResultKey));
        return std::nullopt;
      }
      // A running job (attempt - 1) can take as long as it needs to make room; an open
      // rendezvous must close within the timeout.
      if (!said_waiting && Clock::now() > deadline) {
        DTRAIN_THROW(CommError, "rendezvous at ", store.address(), " (attempt ", attempt,
                     ") did not close within ", o.rendezvous_timeout_seconds,
                     " s (--rdzv-timeout)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const std::string closed = store.get(attempt_key(attempt, "closed"));
    const int nnodes = std::atoi(closed.c_str());
    const int restarts_used = std::atoi(closed.substr(closed.find('|') + 1).c_str());
    if (slot < nnodes) return Membership{slot, nnodes, restarts_used};
    std::fprintf(stderr,
                 "dtrain launch: the job is running on %d node%s; this node waits to join it "
                 "at its next restart%s\n",
                 nnodes, nnodes == 1 ? "" : "s",
                 nnodes < o.nnodes ? " (asked for now: it runs below --nnodes MAX)" : "");
    said_waiting = true;
    store.add(attempt_key(attempt, "waiting"), 1);
    ++attempt;
  }
}

class Attempt {
 public:
  Attempt(const LaunchOptions& options, comm::Store& store, int attempt, Membership membership,
          int port, int threads, const std::string& progress_file)
      : o_(options), store_(store), attempt_(attempt), node_rank_(membership.node_rank),
        nnodes_(membership.nnodes), port_(port), threads_(threads),
        progress_file_(progress_file) {}

  Outcome run();

 private:
  void spawn();
  // Publishes `mine` as the job's failure unless another is there first; returns the first.
  Outcome publish(const Outcome& mine) {
    try {
      return decode(store_.set_if_absent(attempt_key(attempt_, "failure"), encode(mine)));
    } catch (const CommError&) {
      return mine;  // the store is gone: nobody else can be told
    }
  }
  void begin_stop(int signal);
  void tick();
  Outcome blame(Clock::time_point now) const;

  const LaunchOptions& o_;
  comm::Store& store_;
  const int attempt_;
  const int node_rank_;
  const int nnodes_;
  const int port_;
  const int threads_;
  const std::string progress_file_;
  std::vector<Rank> ranks_;
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point stop_deadline_{};
  Outcome outcome_;
  std::optional<Outcome> local_failure_;  // published after a short settling time
  Clock::time_point local_failure_at_{};
  Clock::time_point next_tick_{};
  std::vector<int64_t> last_beat_;
  std::vector<Clock::time_point> last_beat_change_;
};

void Attempt::spawn() {
  const int world = o_.nproc_per_node * nnodes_;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  ranks_.assign(o_.nproc_per_node, Rank{});
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    Rank& r = ranks_[local];
    r.rank = node_rank_ * o_.nproc_per_node + local;
    int out_pipe[2], err_pipe[2];
    DTRAIN_CHECK(::pipe(out_pipe) == 0 && ::pipe(err_pipe) == 0, "pipe() failed: ",
                 std::strerror(errno));
    std::vector<std::string> env = {
        concat("RANK=", r.rank),
        concat("WORLD_SIZE=", world),
        concat("LOCAL_RANK=", local),
        concat("LOCAL_WORLD_SIZE=", o_.nproc_per_node),
        concat("GROUP_RANK=", node_rank_),
        concat("MASTER_ADDR=", o_.master_addr),
        concat("MASTER_PORT=", port_),
        concat("DTRAIN_THREADS=", threads_),
        concat("OMP_NUM_THREADS=", threads_),
        "DTRAIN_AGENT_STORE=1",
        concat("DTRAIN_STORE_PREFIX=attempt-", attempt_, "/"),
        concat("DTRAIN_RESTART_COUNT=", attempt_),
        concat("TORCHELASTIC_RESTART_COUNT=", attempt_),
    };
    if (!o_.interface.empty()) env.push_back("GLOO_SOCKET_IFNAME=" + o_.interface);
    if (!progress_file_.empty()) env.push_back("DTRAIN_PROGRESS_FILE=" + progress_file_);
    if (tty && r.rank == 0) env.push_back("DTRAIN_PROGRESS_TTY=1");
    env.insert(env.end(), o_.extra_env.begin(), o_.extra_env.end());
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
      for (const auto& arg : o_.command) argv.push_back(const_cast<char*>(arg.c_str()));
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
}

void Attempt::begin_stop(int signal) {
  if (stopping_) return;
  stopping_ = true;
  for (auto& r : ranks_) {
    if (r.running) ::kill(-r.pid, signal);
  }
  stop_deadline_ = Clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(o_.grace_seconds * 1e3));
}

// Twice a second: heartbeat, the job's failure, the other nodes' heartbeats.
// A local rank's failure, or the silence of another node's launcher that came first (when a
// node dies, its peers' ranks fail on broken connections before its heartbeat times out).
Outcome Attempt::blame(Clock::time_point now) const {
  Outcome blamed = *local_failure_;
  for (int n = 0; n < nnodes_; ++n) {
    if (n == node_rank_ || last_beat_[n] < 0) continue;
    const double silent = std::chrono::duration<double>(now - last_beat_change_[n]).count();
    if (silent >= 1.2) {  // heartbeats come every 0.5 s
      blamed.description = concat("node ", n, "'s launcher stopped responding (no heartbeat for ",
                                  std::round(silent * 10) / 10, " s), and then ",
                                  local_failure_->description);
      break;
    }
  }
  return blamed;
}

// Twice a second: heartbeat, the job's failure, the other nodes' heartbeats.
void Attempt::tick() {
  const auto now = Clock::now();
  if (now < next_tick_) return;
  next_tick_ = now + std::chrono::milliseconds(500);
  try {
    store_.add(heartbeat_key(attempt_, node_rank_), 1);
    if (!outcome_.failed && store_.check(attempt_key(attempt_, "failure"))) {
      outcome_ = decode(store_.get(attempt_key(attempt_, "failure")));
      begin_stop(SIGTERM);
      return;
    }
    if (outcome_.failed) return;
    for (int n = 0; n < nnodes_; ++n) {
      if (n == node_rank_ || store_.check(attempt_key(attempt_, concat("done/", n)))) continue;
      const int64_t beat = store_.add(heartbeat_key(attempt_, n), 0);
      if (beat != last_beat_[n]) {
        last_beat_[n] = beat;
        last_beat_change_[n] = now;
      }
    }
    if (local_failure_) {
      // A rank killed by a signal is a cause, never a consequence of another failure: it is
      // published at once. Other failures (an exit after a broken connection) wait, so that
      // the failure that caused them reaches the store first (first published wins).
      const bool cause = local_failure_->code > 128;
      if (nnodes_ == 1 || cause || now - local_failure_at_ >= kSettle) outcome_ = publish(blame(now));
      return;
    }
    if (o_.min_nodes > 0 && node_rank_ == 0 && nnodes_ < o_.nnodes &&
        store_.add(attempt_key(attempt_, "waiting"), 0) > 0) {
      Outcome resize;
      resize.failed = true;
      resize.resize = true;
      resize.description = concat("a node is waiting to join (the job runs on ", nnodes_,
                                  " of at most ", o_.nnodes, " nodes)");
      outcome_ = publish(resize);
      begin_stop(SIGTERM);
      return;
    }
    for (int n = 0; n < nnodes_; ++n) {
      if (n == node_rank_ || last_beat_[n] < 0 ||
          now - last_beat_change_[n] <= millis(o_.heartbeat_timeout_seconds)) {
        continue;
      }
      Outcome lost;
      lost.failed = true;
      lost.code = 1;
      lost.description = concat("node ", n, "'s launcher stopped responding (no heartbeat for ",
                                o_.heartbeat_timeout_seconds, " s)");
      outcome_ = publish(lost);
      begin_stop(SIGTERM);
      return;
    }
  } catch (const CommError& e) {
    if (outcome_.failed) return;
    outcome_.failed = true;
    outcome_.code = 1;
    outcome_.description = concat("lost the rendezvous store at ", store_.address(),
                                  node_rank_ == 0 ? "" : " (node 0's launcher is gone?)", ": ",
                                  e.message());
    begin_stop(SIGTERM);
  }
}

Outcome Attempt::run() {
  spawn();
  last_beat_.assign(nnodes_, -1);
  last_beat_change_.assign(nnodes_, Clock::now());
  auto prefix_of = [&](const Rank& r) {
    return o_.prefix_output ? concat("[rank ", r.rank, "] ") : std::string();
  };
  for (;;) {
    // Drain output.
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, bool>> owners;  // (rank, is_stderr)
    for (auto& r : ranks_) {
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
    for (auto& r : ranks_) {
      if (!r.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(r.pid, &status, WNOHANG);
      if (done == r.pid) {
        r.running = false;
        r.status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && !stopping_ && o_.tolerate_failures && r.rank != 0) {
          std::fprintf(stderr, "dtrain launch: rank %d (pid %d) %s; the other ranks go on\n",
                       r.rank, static_cast<int>(r.pid), describe_status(status).c_str());
        } else if (!ok && !stopping_ && !local_failure_) {
          Outcome mine;
          mine.failed = true;
          mine.code = exit_code_of(status);
          if (mine.code == 0) mine.code = 1;
          mine.description = concat(nnodes_ > 1 ? concat("node ", node_rank_, " ") : "",
                                    "rank ", r.rank, " (pid ", r.pid, ") ",
                                    describe_status(status));
          local_failure_ = mine;
          local_failure_at_ = Clock::now();
          std::fprintf(stderr, "dtrain launch: %s; stopping the other ranks\n",
                       mine.description.c_str());
          begin_stop(SIGTERM);
        }
      } else {
        any_running = true;
      }
    }
    if (g_forward_signal != 0 && !stopping_) {
      Outcome interrupt;
      interrupt.failed = true;
      interrupt.interrupted = true;
      interrupt.code = 128 + g_forward_signal;
      interrupt.description = concat("node ", node_rank_, "'s launcher was interrupted (signal ",
                                     g_forward_signal, ")");
      outcome_ = publish(interrupt);
      begin_stop(g_forward_signal);
    }
    tick();
    if (stopping_ && !killed_ && any_running && Clock::now() > stop_deadline_) {
      for (auto& r : ranks_) {
        if (r.running) ::kill(-r.pid, SIGKILL);
      }
      killed_ = true;
    }
    bool any_output = false;
    for (const auto& r : ranks_) any_output = any_output || r.out_fd >= 0 || r.err_fd >= 0;
    const bool finished = !any_running && (!any_output || killed_);  // a grandchild may hold a pipe
    if (!finished) continue;
    // A rank failing because another node's rank failed first (a broken connection) must not
    // be reported as the cause: give that node's failure a second to arrive.
    while (local_failure_ && !outcome_.failed && nnodes_ > 1 &&
           Clock::now() - local_failure_at_ < kSettle + std::chrono::milliseconds(600)) {
      tick();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (local_failure_ && !outcome_.failed) outcome_ = publish(blame(Clock::now()));
    if (outcome_.failed) return outcome_;
    break;
  }

  // Every local rank succeeded. Node 0 hosts the store: it stays until every node is done (or
  // one fails, which ends the job all the same).
  try {
    store_.set(attempt_key(attempt_, concat("done/", node_rank_)), "1");
    store_.add(attempt_key(attempt_, "done"), 1);
    while (node_rank_ == 0 && store_.add(attempt_key(attempt_, "done"), 0) < nnodes_) {
      tick();
      if (outcome_.failed) return outcome_;
      if (g_forward_signal != 0) {
        outcome_ = {true, 128 + g_forward_signal, "interrupted while waiting for other nodes", true};
        return outcome_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const CommError& e) {
    return {true, 1, concat("lost the rendezvous store at ", store_.address(), ": ", e.message()),
            false};
  }
  return {};
}

}  // namespace

int launch(const LaunchOptions& options) {
  validate(options);
  const bool elastic = options.min_nodes > 0;
  const bool host = options.node_rank <= 0 && (elastic ? options.node_rank == 0 : true);
  const int port = options.master_port > 0 ? options.master_port : free_port();
  const int threads =
      options.threads > 0 ? options.threads : default_threads(options.nproc_per_node);
  const std::string me = host ? "node 0" : options.node_rank >= 0
                                               ? concat("node ", options.node_rank)
                                               : std::string("joining node");

  struct sigaction action {};
  action.sa_handler = on_signal;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);

  comm::Store::Options store_options;
  store_options.host = options.master_addr;
  store_options.port = port;
  store_options.is_server = host;
  store_options.timeout = millis(options.rendezvous_timeout_seconds);
  std::unique_ptr<comm::Store> store;
  try {
    store = std::make_unique<comm::Store>(store_options);
  } catch (const CommError& e) {
    std::fprintf(stderr, "dtrain launch: %s: %s\n", me.c_str(), e.message().c_str());
    return 1;
  }
  // Rank 0 reports its step here, so restarts can say how many steps they cost.
  std::string progress_file;
  if (host) {
    char name[] = "/tmp/dtrain-progress-XXXXXX";
    const int fd = ::mkstemp(name);
    if (fd >= 0) {
      ::close(fd);
      progress_file = name;
    }
  }
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
    restart_notes.push_back(concat("restart ", restart_notes.size() + 1, " (", restart_reason,
                                   "): stopped at step ", reached_before_restart,
                                   ", resumed from step ", now.start, " on ", nnodes, " node",
                                   nnodes == 1 ? "" : "s", " (",
                                   std::max<int64_t>(0, reached_before_restart - now.start),
                                   " steps lost)"));
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
      if (!elastic) {
        membership = fixed_rendezvous(options, *store, attempt, restarts_used);
      } else if (host) {
        membership = elastic_host_rendezvous(options, *store, attempt, restarts_used);
      } else {
        Outcome ended;
        const auto joined = elastic_join_rendezvous(options, *store, attempt, ended);
        if (!joined) {
          std::fprintf(stderr, "dtrain launch: the job ended before this node could join it%s\n",
                       ended.failed ? concat(" (", ended.description, ")").c_str() : "");
          return ended.failed ? std::max(1, ended.code) : 0;
        }
        membership = *joined;
      }
    } catch (const CommError& e) {
      std::fprintf(stderr, "dtrain launch: %s: failed: %s\n", me.c_str(), e.message().c_str());
      Outcome failed{true, 1, e.message(), false};
      return finish(failed, 1);
    }
    if (elastic && (attempt > 0 || !host)) {
      std::fprintf(stderr, "dtrain launch: attempt %d: node %d of %d\n", attempt,
                   membership.node_rank, membership.nnodes);
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
    if (!outcome.failed) {
      if (restarts > 0) {
        std::fprintf(stderr, "dtrain launch: the job succeeded after %d restart%s\n", restarts,
                     restarts == 1 ? "" : "s");
        for (const auto& note : restart_notes) {
          std::fprintf(stderr, "dtrain launch:   %s\n", note.c_str());
        }
      }
      return finish(outcome, 0);
    }
    const bool counted = !outcome.resize;
    if (outcome.interrupted || (counted && restarts_used >= options.max_restarts)) {
      std::fprintf(stderr, "dtrain launch: failed: %s%s\n", outcome.description.c_str(),
                   restarts > 0 ? concat(" (after ", restarts, " restart",
                                         restarts == 1 ? "" : "s", ")").c_str()
                                : "");
      return finish(outcome, outcome.code == 0 ? 1 : outcome.code);
    }
    if (counted) ++restarts_used;
    ++restarts;
    if (!progress_file.empty()) reached_before_restart = read_progress(progress_file).step;
    restart_reason = counted ? "failure" : "resize";
    if (counted) {
      std::fprintf(stderr, "dtrain launch: %s; restarting the job (restart %d of %d)\n",
                   outcome.description.c_str(), restarts_used, options.max_restarts);
    } else {
      std::fprintf(stderr, "dtrain launch: %s; restarting the job at the new size\n",
                   outcome.description.c_str());
    }
  }
}

}  // namespace dtrain::launch
