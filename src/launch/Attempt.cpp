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

// A failure of its own (a rank's bad input: exit code 2; killed by a signal), never a
// consequence of another rank's (an exit after a broken connection).
bool is_cause(const Outcome& o) { return o.code == 2 || o.code > 128; }

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
std::optional<Outcome> Attempt::every_replica_failed() {
  bool waiting = false;
  for (const auto& r : ranks_) {
    if (r.running && !r.awaiting_admission) return std::nullopt;  // a member is here
    waiting = waiting || (r.running && r.awaiting_admission);
  }
  if (!waiting) return std::nullopt;
  const int world = o_.nproc_per_node * nnodes_;
  const int size = std::max(1, o_.replica_size);
  std::vector<int> dead;
  for (int replica = 0; replica < world / size; ++replica) {
    bool down = false;
    for (int k = 0; k < size; ++k) {
      const int rank = replica * size + k;
      if (store_.check(rank_key(attempt_, concat("ft/dead/", rank)))) {
        dead.push_back(rank);
        down = true;
      }
    }
    if (!down) return std::nullopt;
  }
  std::string ranks;
  for (const int rank : dead) ranks += concat(ranks.empty() ? "" : ",", rank);
  Outcome gone;
  gone.failed = true;
  gone.code = 1;
  gone.description = concat("every replica failed (world rank", dead.size() == 1 ? " " : "s ",
                            ranks, "): none is left to send the replacements its state");
  return gone;
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
      blamed.description =
          concat("node ", n, "'s launcher stopped responding (no heartbeat for ",
                 std::round(silent * 10) / 10, " s), and then ", local_failure_->description);
      break;
    }
  }
  return blamed;
}

// Once training has ended (the leading replica closed the job, or a rank finished), every
// rank still running finishes on its own (its final evaluation, checkpoint, summary) and beats
// meanwhile; one whose heartbeat stays silent hung at the end (a machine stopped, a deadlock in
// its exit), and no collective of the others is left to notice it: it is killed, or the job
// would wait for it forever. 2 s on top of the timeout: from the end of its heartbeat (its
// replica group's end) to its exit; 30 s more for a replacement not admitted yet (it may still
// be starting: it beats once its replica group exists, then sees the job closed and exits).
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
  Outcome stopped;  // the ranks stopped on request (Outcome::stopped)
  loop_turn_ns_ = now_ns();
  spawn();
  watchdog_ = std::thread([this] { watch(); });
  last_beat_.assign(nnodes_, -1);
  last_beat_change_.assign(nnodes_, Clock::now());
  for (;;) {
    loop_turn_ns_ = now_ns();
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
        flush_lines(buffer, prefix(r), sink, false, is_err ? &r.error_line : nullptr);
      } else {
        flush_lines(buffer, prefix(r), sink, true, is_err ? &r.error_line : nullptr);
        ::close(fds[i].fd);
        (is_err ? r.err_fd : r.out_fd) = -1;
      }
    }
    if (fds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));

    // Reap; the ranks the watchdog killed last, so that whether the others finished (training
    // ended) is known when they are judged.
    bool any_running = false;
    for (int pass = 0; pass < 2; ++pass)
      for (auto& r : ranks_) {
        if (!r.running || killed_while_stopped(r.pid) != (pass == 1)) continue;
        int status = 0;
        const pid_t done = ::waitpid(r.pid, &status, WNOHANG);
        if (done == r.pid) {
          r.running = false;
          r.status = status;
          {
            std::lock_guard<std::mutex> lock(watched_mutex_);
            watched_pids_[static_cast<size_t>(r.local)] = -1;  // its pid may be another's now
          }
          // Killed by the watchdog: stopped, as a rank whose heartbeat fell silent is.
          if (killed_while_stopped(r.pid)) {
            r.fenced = true;
            if (!training_ended_ && o_.tolerate_failures) {
              try {
                training_ended_ =
                    replicas_beat() && (store_.check(rank_key(attempt_, "ft/ended")) ||
                                        store_.check(rank_key(attempt_, "ft/closed")));
              } catch (const CommError&) {
              }
            }
            r.silent_at_end = training_ended_;
          }
          const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
          r.finished = ok;
          // Stopped on request, its work saved: not a failure, and not started again. Under
          // --fault-tolerance replicas a replica told by itself leaves and the others go on.
          // A program of the user's own that ends on the signal it was forwarded stopped too.
          const int forwarded = o_.stop_signal > 0 ? o_.stop_signal : stop_asked_;
          const bool ended_on_request =
              stop_asked_ != 0 && WIFSIGNALED(status) && WTERMSIG(status) == forwarded;
          if (((WIFEXITED(status) && is_stopped_exit_code(WEXITSTATUS(status))) ||
               ended_on_request) &&
              !stopping_) {
            r.stopped = true;
            drain(r, false);
            if (o_.tolerate_failures && stop_asked_ == 0) {
              say("rank %d (pid %d) stopped on request (%s); it is not started again, the other "
                  "ranks go on\n",
                  r.rank, static_cast<int>(r.pid), signal_name(WEXITSTATUS(status) - 128).c_str());
            }
            if (o_.tolerate_failures && !training_ended_) {
              try {
                store_.set(rank_key(attempt_, concat("ft/dead/", r.rank)), "1");
                store_.add(rank_key(attempt_, "ft/deaths"), 1);
              } catch (const CommError&) {
              }
            }
            continue;
          }
          // Exit code 2 is bad input (dtrain's, argparse's): the same again in a replacement.
          const bool bad_input = WIFEXITED(status) && WEXITSTATUS(status) == 2;
          // Killed for hanging after training ended: the job's result stands unless it is of the
          // leading replica (or none closed the job yet), whose end is then missing.
          const bool hung_at_end = !ok && r.silent_at_end;
          const bool end_missing =
              hung_at_end &&
              (closed_by_ < 0 || r.rank / o_.replica_size == closed_by_ / o_.replica_size);
          // A replica finished: so did training (told to the other nodes). Read from the store
          // here, not only in tick(): the other replicas may finish before a tick has seen the
          // heartbeat timeout, and a replica stopped at the end would then wait forever.
          bool beats = false;
          try {
            beats = ok && o_.tolerate_failures && !training_ended_ && replicas_beat();
          } catch (const CommError&) {
          }
          if (beats) {
            training_ended_ = true;
            try {
              store_.set(rank_key(attempt_, "ft/ended"), "1");
            } catch (const CommError&) {
            }
          }
          if (hung_at_end && !end_missing) {
            say("rank %d (pid %d) ended; the job's result stands (the "
                "leading replica finished it)\n",
                r.rank, static_cast<int>(r.pid));
          } else if (!ok && !stopping_ && o_.tolerate_failures && !bad_input && !hung_at_end &&
                     (r.rank >= o_.replica_size || o_.replace_first_replica)) {
            say("rank %d (pid %d) %s; the other ranks go on\n", r.rank, static_cast<int>(r.pid),
                describe_status(status).c_str());
            // A replica of several ranks (a tensor-parallel group) fails as one: its other ranks
            // end now (they would wait on this one) and are started again with it.
            for (auto& mate : ranks_) {
              if (r.ended_with_replica) break;
              if (&mate == &r || !mate.running || mate.fenced ||
                  mate.rank / o_.replica_size != r.rank / o_.replica_size) {
                continue;
              }
              say("ending rank %d (pid %d) too: it is in rank %d's "
                  "replica\n",
                  mate.rank, static_cast<int>(mate.pid), r.rank);
              ::kill(-mate.pid, SIGKILL);
              mate.fenced = true;
              mate.ended_with_replica = true;
            }
            // What a fault-tolerant job's ranks watch for (parallel/ft/ReplicaManager.h): the
            // dead rank first, then the count that tells them to look.
            // A replacement that fails before it is admitted was never counted in (its
            // predecessor's mark is still there): nothing new to report.
            try {
              if (!r.awaiting_admission) {
                store_.set(rank_key(attempt_, concat("ft/dead/", r.rank)), "1");
                store_.add(rank_key(attempt_, "ft/deaths"), 1);
              }
            } catch (const CommError& e) {
              say("could not report rank %d's failure: %s\n", r.rank, e.what());
            }
            if (training_ended_) {
              say("rank %d is not started again: training ended\n", r.rank);
            } else if (r.replacements < o_.max_replacements) {
              // torchft's replica groups, restarted by their scheduler: a new process for the
              // rank, which fetches the state from a replica that is training.
              drain(r, true);
              ++r.replacements;
              r.fenced = false;
              r.ended_with_replica = false;
              r.awaiting_admission = true;
              spawn_rank(r);
              any_running = true;
              say("started rank %d again (replacement %d of at most %d, "
                  "pid %d); it joins the others\n",
                  r.rank, r.replacements, o_.max_replacements, static_cast<int>(r.pid));
            }
          } else if (!ok && !stopping_) {
            drain(r, false);  // what it still wrote: its own error line names the cause
            Outcome mine;
            mine.failed = true;
            mine.code = exit_code_of(status);
            if (mine.code == 0) mine.code = 1;
            mine.description = concat(
                nnodes_ > 1 ? concat("node ", node_rank_, " ") : "", "rank ", r.rank, " (pid ",
                r.pid, ") ",
                end_missing ? "hung after training ended, before its replica ended the job (its "
                              "final evaluation, checkpoint and summary), and was killed"
                            : describe_status(status),
                r.error_line.empty() ? "" : ": " + r.error_line);
            // The first failure, unless it is a consequence (a broken connection) and a rank's
            // own failure comes while it settles: that one is the cause to report.
            if (!local_failure_ ||
                (!outcome_.failed && !is_cause(*local_failure_) && is_cause(mine))) {
              if (!local_failure_) local_failure_at_ = Clock::now();
              local_failure_ = mine;
              if (is_cause(mine)) {
                say("%s; stopping the other ranks\n", mine.description.c_str());
                begin_stop(SIGTERM);
              }
            }
          }
        } else {
          any_running = true;
        }
      }
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
    // Stopped on request (no rank trained to the end: one replica leaving alone is not the
    // job's end): the job's result once every node is done.
    bool any_stopped = false, any_finished = false;
    for (const auto& r : ranks_) {
      any_stopped = any_stopped || r.stopped;
      any_finished = any_finished || r.finished;
    }
    if (any_stopped && !any_finished) {
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
      stopped.description = concat(
          "stopped on request (", signal_name(signal),
          "): ", saved ? "the ranks finished their step and saved" : "the ranks ended on it");
    }
    break;
  }

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
