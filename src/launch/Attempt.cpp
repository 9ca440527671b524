#include "launch/Attempt.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "dtrain/common/Net.h"
#include "dtrain/common/Signals.h"
#include "dtrain/launch/Environment.h"

namespace dtrain::launch::agent {

namespace {

// Writes complete segments of `buffer` with a prefix. '\r' segments (progress bars) are redrawn
// in place; '\n' segments are lines.
// `error_line` (for stderr): the last line that says "dtrain: error: ..." is kept there.
void flush_lines(std::string& buffer, const std::string& prefix, std::FILE* out, bool all,
                 std::string* error_line = nullptr) {
  auto keep = [&](const std::string& line) {
    static const std::string kError = "dtrain: error: ";
    if (error_line != nullptr && line.compare(0, kError.size(), kError) == 0)
      *error_line = line.substr(kError.size());
  };
  size_t start = 0;
  for (size_t i = 0; i < buffer.size(); ++i) {
    if (buffer[i] != '\n' && buffer[i] != '\r') continue;
    const std::string segment = buffer.substr(start, i - start);
    if (buffer[i] == '\r') {
      if (!segment.empty()) std::fprintf(out, "%s%s", prefix.c_str(), segment.c_str());
      std::fputc('\r', out);
    } else {
      std::fprintf(out, "%s%s\n", prefix.c_str(), segment.c_str());
      keep(segment);
    }
    start = i + 1;
  }
  buffer.erase(0, start);
  if (all && !buffer.empty()) {
    std::fprintf(out, "%s%s\n", prefix.c_str(), buffer.c_str());
    keep(buffer);
    buffer.clear();
  }
  std::fflush(out);
}

}  // namespace

bool is_cause(const Outcome& o) { return o.code == 2 || o.code > 128; }

namespace {

constexpr std::chrono::seconds kWatchdogStall{3};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// Whether process `pid` is stopped (state T or t in /proc/PID/stat).
bool is_stopped(pid_t pid) {
  std::FILE* file = std::fopen(concat("/proc/", pid, "/stat").c_str(), "r");
  if (file == nullptr) return false;
  char line[512] = {};
  const size_t n = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[n] = '\0';
  const char* close = std::strrchr(line, ')');  // the command may hold ')'
  return close != nullptr && close[1] == ' ' && (close[2] == 'T' || close[2] == 't');
}

}  // namespace

Attempt::~Attempt() {
  watch_ends_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

void Attempt::watch() {
  while (!watch_ends_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (now_ns() - loop_turn_ns_.load() < std::chrono::nanoseconds(kWatchdogStall).count()) {
      continue;
    }
    std::lock_guard<std::mutex> lock(watched_mutex_);
    for (const pid_t pid : watched_pids_) {
      if (pid <= 0 || killed_stopped_.count(pid) != 0 || !is_stopped(pid)) continue;
      say("pid %d, a rank of this node, is stopped while the launcher has waited %lld s on the "
          "rendezvous store, which a stopped process blocks when it stopped halfway through a "
          "request; killing it\n",
          static_cast<int>(pid), static_cast<long long>(kWatchdogStall.count()));
      ::kill(pid, SIGKILL);
      killed_stopped_.insert(pid);
    }
  }
}

bool Attempt::killed_while_stopped(pid_t pid) {
  std::lock_guard<std::mutex> lock(watched_mutex_);
  return killed_stopped_.count(pid) != 0;
}

void Attempt::spawn() {
  ranks_.assign(o_.nproc_per_node, Rank{});
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    Rank& r = ranks_[local];
    r.local = local;
    r.rank = node_rank_ * o_.nproc_per_node + local;
    spawn_rank(r);
  }
}

void Attempt::spawn_rank(Rank& r) {
  const int world = o_.nproc_per_node * nnodes_;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  const int local = r.local;
  {
    int out_pipe[2], err_pipe[2];
    DTRAIN_CHECK(::pipe(out_pipe) == 0 && ::pipe(err_pipe) == 0,
                 "pipe() failed: ", std::strerror(errno));
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
        // torchrun's agent-store convention: a torch.distributed env:// program connects to
        // this launcher's store as a client (under /worker/attempt_N) instead of hosting one
        // on MASTER_PORT itself.
        "TORCHELASTIC_USE_AGENT_STORE=True",
        concat("TORCHELASTIC_MAX_RESTARTS=", o_.max_restarts),
        concat("GROUP_WORLD_SIZE=", nnodes_),
        concat("ROLE_RANK=", r.rank),
        concat("ROLE_WORLD_SIZE=", world),
    };
    if (!o_.interface.empty()) env.push_back("GLOO_SOCKET_IFNAME=" + o_.interface);
    if (o_.tolerate_failures) {
      env.push_back("DTRAIN_TOLERATE_FAILURES=1");
      env.push_back(concat("DTRAIN_REPLICA_SIZE=", o_.replica_size));
    }
    // The others train on: it joins them (parallel/ft/ReplicaManager.h) instead of the world.
    if (r.replacements > 0) env.push_back(concat("DTRAIN_FT_REPLACEMENT=", r.replacements));
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
      say("cannot run %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::setpgid(pid, pid);  // (also done in the child) so signals reach its whole group
    r.pid = pid;
    {
      std::lock_guard<std::mutex> lock(watched_mutex_);
      watched_pids_.resize(ranks_.size(), -1);
      watched_pids_[static_cast<size_t>(r.local)] = pid;
    }
    r.error_line.clear();
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
  stop_deadline_ =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_seconds * 1e3));
}

void Attempt::ask_ranks_to_stop(int signal, bool told_here) {
  if (stop_asked_ != 0 || stopping_) return;
  stop_asked_ = signal;
  if (told_here) {
    // Another node's ranks learn it from their own (the ranks agree on the step to stop at);
    // their launchers from the store (ranks that do not agree: asynchronous workers).
    try {
      store_.set(attempt_key(attempt_, "stop"), concat(signal));
    } catch (const CommError&) {
    }
    say("stopping on request (%s): the ranks are asked to stop (dtrain's finish their step and "
        "save); %s again stops them at once\n",
        signal_name(signal).c_str(), signal_name(signal).c_str());
  }
  const int forwarded = o_.stop_signal > 0 ? o_.stop_signal : signal;
  for (auto& r : ranks_) {
    if (r.running && !r.fenced) ::kill(r.pid, forwarded);
  }
  stop_deadline_ = Clock::now() + millis(o_.stop_timeout_seconds);
}

// A fault-tolerant job whose every replica failed (each has a rank marked dead that no member
// has admitted a replacement for): no replica is left to send its state, so the replacements
// would wait for admission until the job's timeout. The attempt fails instead (restarting every
// rank from the newest checkpoint while --max-restarts allows). Looked at only while none of
// this launcher's ranks is a member (all dead or waiting for admission): the other nodes' marks
// are read only then.
bool Attempt::replicas_beat() {
  if (replica_heartbeat_s_ == 0) {
    // parallel/ft/ReplicaManager.h's kHeartbeatTimeoutKey, under the ranks' prefix: the
    // replicas beat (a parameter server's workers do not). Every replica sets it before its
    // first step, so it is there when any of them finishes.
    const std::string timeout = rank_key(attempt_, "ft/heartbeat_ms");
    if (!store_.check(timeout)) return false;
    replica_heartbeat_s_ = std::max(0.001, std::atof(store_.get(timeout).c_str()) / 1000);
  }
  return true;
}

void Attempt::end_hung_ranks(Clock::time_point now) {
  if (!replicas_beat()) return;
  if (closed_by_ < 0) {
    // "ft/closed" under the ranks' prefix: parallel/ft/ReplicaManager.h's kClosedKey.
    const std::string closed = rank_key(attempt_, "ft/closed");
    if (store_.check(closed)) {
      closed_by_ = std::atoi(store_.get(closed).c_str());
      training_ended_ = true;
    }
  }
  if (!training_ended_) training_ended_ = store_.check(rank_key(attempt_, "ft/ended"));
  if (!training_ended_) return;
  for (auto& r : ranks_) {
    if (!r.running || r.fenced) continue;
    const int64_t beat = store_.add(rank_key(attempt_, concat("ft/beat/", r.rank)), 0);
    if (r.beat_changed == Clock::time_point{} || beat != r.last_beat) {
      r.last_beat = beat;
      r.beat_changed = now;
      continue;
    }
    if (now - r.beat_changed <
        millis(replica_heartbeat_s_ + (r.awaiting_admission ? 32 : 2))) {
      continue;
    }
    say("rank %d (pid %d) still runs after training ended, its heartbeat "
        "silent for %.1f s (it hung); killing it\n",
        r.rank, static_cast<int>(r.pid),
        std::chrono::duration<double>(now - r.beat_changed).count());
    ::kill(-r.pid, SIGKILL);
    r.fenced = true;
    r.silent_at_end = true;
  }
}

// Twice a second: heartbeat, the job's failure, the other nodes' heartbeats.
void Attempt::tick() {
  const auto now = Clock::now();
  if (now < next_tick_) return;
  next_tick_ = now + std::chrono::milliseconds(500);
  try {
    store_.add(heartbeat_key(attempt_, node_rank_), 1);
    if (o_.tolerate_failures && !stopping_) {
      // A fault-tolerant job's ranks declare a silent replica dead and go on without it; it
      // must not come back into a group that went on (fencing): its launcher kills it.
      for (auto& r : ranks_) {
        const bool marked = store_.check(rank_key(attempt_, concat("ft/dead/", r.rank)));
        if (r.awaiting_admission) {
          r.awaiting_admission = marked;  // the others remove the mark when they admit it
          continue;
        }
        if (r.running && !r.fenced && marked) {
          say("rank %d (pid %d) was counted as dead by the other "
              "replicas (its heartbeat stopped); killing it\n",
              r.rank, static_cast<int>(r.pid));
          ::kill(-r.pid, SIGKILL);
          r.fenced = true;
        }
      }
    }
    if (stop_asked_ == 0 && !stopping_ && store_.check(attempt_key(attempt_, "stop"))) {
      ask_ranks_to_stop(std::atoi(store_.get(attempt_key(attempt_, "stop")).c_str()), false);
    }
    if (o_.tolerate_failures && !stopping_) end_hung_ranks(now);
    if (o_.tolerate_failures && !stopping_ && !outcome_.failed) {
      if (auto gone = every_replica_failed()) {
        outcome_ = publish(*gone);
        begin_stop(SIGTERM);
        return;
      }
    }
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
      // A rank killed by a signal, or one that exits 2 (its own bad input: data, flags, files),
      // is a cause, never a consequence of another failure: it is published at once. Other
      // failures (an exit after a broken connection) wait, so that the failure that caused them
      // reaches the store first (first published wins), or, on this node, the rank that caused
      // them exits meanwhile (it replaces them: the reap above); the other ranks run on until
      // then, so that the cause's own exit is not cut short.
      if (is_cause(*local_failure_) || now - local_failure_at_ >= kSettle) {
        outcome_ = publish(blame(now));
        if (!stopping_) {
          say("%s; stopping the other ranks\n", outcome_.description.c_str());
        }
        begin_stop(SIGTERM);
      }
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
    outcome_.description =
        concat("lost the rendezvous store at ", store_.address(),
               node_rank_ == 0 ? "" : " (node 0's launcher is gone?)", ": ", e.message());
    begin_stop(SIGTERM);
  }
}

void Attempt::drain(Rank& r, bool close) {
  for (const bool is_err : {false, true}) {
    int& fd = is_err ? r.err_fd : r.out_fd;
    std::string& buffer = is_err ? r.err_buffer : r.out_buffer;
    if (fd >= 0) {
      pollfd ready{fd, POLLIN, 0};
      char chunk[8192];
      ssize_t n = 0;
      while (::poll(&ready, 1, 0) > 0 && (n = ::read(fd, chunk, sizeof(chunk))) > 0) {
        buffer.append(chunk, static_cast<size_t>(n));
      }
      if (close) {
        ::close(fd);
        fd = -1;
      }
    }
    flush_lines(buffer, prefix(r), is_err ? stderr : stdout, close,
                is_err ? &r.error_line : nullptr);
  }
}

Outcome Attempt::run() {
  loop_turn_ns_ = now_ns();
  spawn();
  watchdog_ = std::thread([this] { watch(); });
  last_beat_.assign(nnodes_, -1);
  last_beat_change_.assign(nnodes_, Clock::now());
  for (;;) {
    loop_turn_ns_ = now_ns();
    drain_output();
    const bool any_running = reap();
    follow_stop_requests(any_running);
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
    if (finished) break;
  }
  // A rank failing because another node's rank failed first (a broken connection) must not
  // be reported as the cause: give that node's failure a second to arrive.
  while (local_failure_ && !outcome_.failed && nnodes_ > 1 &&
         Clock::now() - local_failure_at_ < kSettle + std::chrono::milliseconds(600)) {
    tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (local_failure_ && !outcome_.failed) outcome_ = publish(blame(Clock::now()));
  if (outcome_.failed) return outcome_;
  return wait_for_nodes(stopped_outcome());
}

void Attempt::drain_output() {
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
      flush_lines(buffer, prefix(r), sink, false, is_err ? &r.error_line : nullptr);
    } else {
      flush_lines(buffer, prefix(r), sink, true, is_err ? &r.error_line : nullptr);
      ::close(fds[i].fd);
      (is_err ? r.err_fd : r.out_fd) = -1;
    }
  }
  if (fds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

void Attempt::follow_stop_requests(bool any_running) {
  // The first signal asks the ranks to stop after their step and save; a second one (or a
  // first that comes while they are being stopped for a failure) stops them at once.
  if (g_forward_signal != 0 && stop_asked_ == 0 && !stopping_) {
    ask_ranks_to_stop(g_forward_signal, true);
  }
  if (g_forward_signal != 0 && g_signal_count >= 2 && !stopping_) {
    Outcome interrupt;
    interrupt.failed = true;
    interrupt.interrupted = true;
    interrupt.code = 128 + g_forward_signal;
    interrupt.description =
        concat("node ", node_rank_, "'s launcher was interrupted again (",
               signal_name(g_forward_signal), "): the ranks were stopped at once");
    outcome_ = publish(interrupt);
    begin_stop(SIGTERM);
  }
  // Asked to stop, the ranks take too long to save: they are ended.
  if (stop_asked_ != 0 && !stopping_ && any_running && Clock::now() > stop_deadline_) {
    Outcome late;
    late.failed = true;
    late.interrupted = true;
    late.code = 128 + stop_asked_;
    late.description =
        concat("the ranks did not stop within ", o_.stop_timeout_seconds,
               " s of the stop request (", signal_name(stop_asked_), "); they were ended");
    outcome_ = publish(late);
    begin_stop(SIGTERM);
  }
}

Outcome Attempt::stopped_outcome() const {
  Outcome stopped;
  // Stopped on request (no rank trained to the end: one replica leaving alone is not the
  // job's end): the job's result once every node is done.
  bool any_stopped = false, any_finished = false;
  for (const auto& r : ranks_) {
    any_stopped = any_stopped || r.stopped;
    any_finished = any_finished || r.finished;
  }
  if (!any_stopped || any_finished) return stopped;
  int signal = stop_asked_;
  bool saved = true;  // dtrain's ranks exit 128 + the signal once they saved
  for (const auto& r : ranks_) {
    if (signal == 0 && r.stopped) signal = WEXITSTATUS(r.status) - 128;
    saved = saved && (!r.stopped || WIFEXITED(r.status));
  }
  stopped.failed = true;
  stopped.interrupted = true;
  stopped.stopped = true;
  stopped.code = 128 + signal;
  stopped.description =
      concat("stopped on request (", signal_name(signal),
             "): ", saved ? "the ranks finished their step and saved" : "the ranks ended on it");
  return stopped;
}

Outcome Attempt::wait_for_nodes(const Outcome& stopped) {
  // Every local rank succeeded. Node 0 hosts the store: it stays until every node is done (or
  // one fails, which ends the job all the same).
  try {
    store_.set(attempt_key(attempt_, concat("done/", node_rank_)), "1");
    store_.add(attempt_key(attempt_, "done"), 1);
    while (node_rank_ == 0 && store_.add(attempt_key(attempt_, "done"), 0) < nnodes_) {
      loop_turn_ns_ = now_ns();
      tick();
      if (outcome_.failed) return outcome_;
      // A stop on request lets the other nodes save; a second signal does not wait.
      if (g_forward_signal != 0 && (!stopped.stopped || g_signal_count >= 2)) {
        outcome_ = {true, 128 + g_forward_signal, "interrupted while waiting for other nodes",
                    true};
        return outcome_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const CommError& e) {
    return {true, 1, concat("lost the rendezvous store at ", store_.address(), ": ", e.message()),
            false};
  }
  return stopped.stopped ? stopped : Outcome{};
}

}  // namespace dtrain::launch::agent
