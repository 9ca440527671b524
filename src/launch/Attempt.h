// One attempt of a job on this node: its local ranks spawned with torchrun's environment, their
// output multiplexed with rank prefixes, the node's heartbeat and the other nodes' watched in
// the store, the first failure anywhere published and every rank stopped.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/Store.h"
#include "dtrain/launch/Launcher.h"
#include "launch/Agent.h"

namespace dtrain::launch::agent {

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;  // read ends
  int err_fd = -1;
  std::string out_buffer;
  std::string err_buffer;
  bool running = false;
  bool fenced = false;  // killed because the other replicas counted it as dead
  int local = 0;
  int replacements = 0;  // times it was started again after a failure (max_replacements)
  // A replacement not admitted yet: the others' death mark of the process it replaces stays
  // until they admit it, and must not fence it.
  bool awaiting_admission = false;
  // Ended by its launcher because another rank of its replica failed: its own end takes no
  // other rank with it (the others of its replica are being started again).
  bool ended_with_replica = false;
  // Killed after training ended because its heartbeat stayed silent (hung at the end).
  bool silent_at_end = false;
  std::string error_line;  // its last "dtrain: error: ..." line: the cause, when it fails
  bool stopped = false;    // it exited stopped on request (dtrain/common/Signals.h), work saved
  bool finished = false;   // it exited 0
  int64_t last_beat = -1;  // its ft/beat/RANK count as last seen, once training has ended
  Clock::time_point beat_changed{};
  int status = 0;
};

/// A failure of its own (a rank's bad input: exit code 2; killed by a signal), never a
/// consequence of another rank's (an exit after a broken connection).
bool is_cause(const Outcome& o);

class Attempt {
 public:
  Attempt(const LaunchOptions& options, comm::Store& store, int attempt, Membership membership,
          int port, int threads, const std::string& progress_file)
      : o_(options),
        store_(store),
        attempt_(attempt),
        node_rank_(membership.node_rank),
        nnodes_(membership.nnodes),
        port_(port),
        threads_(threads),
        progress_file_(progress_file) {}

  ~Attempt();
  Outcome run();

 private:
  // A rank stopped (SIGSTOP, a frozen machine) halfway through a request to the rendezvous
  // store blocks c10d 1.13's store server, which reads each request to its end: this launcher
  // (which hosts it on node 0) and every rank would wait on it for good. A thread of its own
  // watches the main loop: stalled for kWatchdogStall while a local rank is stopped, it kills
  // that rank (its connection closes and the server goes on).
  void watch();
  bool killed_while_stopped(pid_t pid);
  void spawn();
  // Starts local rank `r.local` (again: a replacement, when r.replacements > 0).
  void spawn_rank(Rank& r);
  // Publishes `mine` as the job's failure unless another is there first; returns the first.
  Outcome publish(const Outcome& mine) {
    try {
      return decode(store_.set_if_absent(attempt_key(attempt_, "failure"), encode(mine)));
    } catch (const CommError&) {
      return mine;  // the store is gone: nobody else can be told
    }
  }
  void begin_stop(int signal);
  // A stop on request (`signal`: the one this launcher or another node's caught): every local
  // rank is asked to finish its step and save (LaunchOptions::stop_signal), and has
  // stop_timeout_seconds to exit. `told_here`: this launcher caught it (it tells the others).
  void ask_ranks_to_stop(int signal, bool told_here);
  // Reads what rank `r` wrote and has not been read yet (without waiting) and writes it out;
  // `close`: its pipes too (it ended), the last partial lines with them.
  void drain(Rank& r, bool close);
  std::string prefix(const Rank& r) const {
    return o_.prefix_output ? concat("[rank ", r.rank, "] ") : std::string();
  }
  void tick();
  // The main loop's turn, in parts: what the ranks wrote, written out (waits up to 50 ms for
  // it); the local ranks that ended, judged (whether any still runs); a stop on request
  // followed (a second signal, a stop past its timeout).
  void drain_output();
  bool reap();
  void follow_stop_requests(bool any_running);
  // Rank `r` ended with `status` (AttemptExits.cpp): whether it runs again (a replacement).
  bool judge_exit(Rank& r, int status);
  void stopped_on_request(Rank& r, int status);
  bool replace_failed(Rank& r, int status);
  void record_failure(Rank& r, int status, bool end_missing);
  // Once every local rank ended: the job's result when it was stopped on request (no rank
  // finished), else a default Outcome; node 0 then waits for every node (it hosts the store).
  Outcome stopped_outcome() const;
  Outcome wait_for_nodes(const Outcome& stopped);
  std::optional<Outcome> every_replica_failed();
  Outcome blame(Clock::time_point now) const;
  // --fault-tolerance replicas: whether the ranks are replicas that beat (they published their
  // heartbeat timeout, read into replica_heartbeat_s_); a parameter server's workers do not.
  bool replicas_beat();
  // Once training has ended: kills the ranks whose heartbeat stays silent (tolerate_failures).
  void end_hung_ranks(Clock::time_point now);

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
  int stop_asked_ = 0;  // the signal of a stop on request the ranks were asked for (0: none)
  bool killed_ = false;
  Clock::time_point stop_deadline_{};
  Outcome outcome_;
  std::optional<Outcome> local_failure_;  // published after a short settling time
  Clock::time_point local_failure_at_{};
  Clock::time_point next_tick_{};
  // --fault-tolerance replicas: the ranks' heartbeat timeout, in seconds (0 until they
  // publish it). Training has ended: ft/closed holds the leading world rank (-1 until it is
  // there), or a rank finished.
  double replica_heartbeat_s_ = 0;
  bool training_ended_ = false;
  int closed_by_ = -1;
  std::vector<int64_t> last_beat_;
  std::vector<Clock::time_point> last_beat_change_;
  // The watchdog (watch()): the main loop's last turn, the local ranks' pids (spawn_rank keeps
  // them), the ones it killed, and its end.
  std::atomic<int64_t> loop_turn_ns_{0};
  std::mutex watched_mutex_;
  std::vector<pid_t> watched_pids_;
  std::set<pid_t> killed_stopped_;
  std::atomic<bool> watch_ends_{false};
  std::thread watchdog_;
};

}  // namespace dtrain::launch::agent
