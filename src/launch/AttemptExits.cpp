// How the launcher judges a local rank that ended (Attempt::reap): it finished, it stopped on
// request, it failed and is started again (--fault-tolerance replicas), or its failure is the
// job's; and which failure the job reports (blame) or whether every replica failed.
#include <sys/wait.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <mutex>

#include "dtrain/common/Signals.h"
#include "launch/Attempt.h"

namespace dtrain::launch::agent {

namespace {

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

bool Attempt::reap() {
  // The ranks the watchdog killed last, so that whether the others finished (training ended)
  // is known when they are judged.
  bool any_running = false;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& r : ranks_) {
      if (!r.running || killed_while_stopped(r.pid) != (pass == 1)) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid || judge_exit(r, status)) {
        any_running = true;
      }
    }
  }
  return any_running;
}

bool Attempt::judge_exit(Rank& r, int status) {
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
        training_ended_ = replicas_beat() && (store_.check(rank_key(attempt_, "ft/ended")) ||
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
  if (((WIFEXITED(status) && is_stopped_exit_code(WEXITSTATUS(status))) || ended_on_request) &&
      !stopping_) {
    stopped_on_request(r, status);
    return false;
  }
  // Exit code 2 is bad input (dtrain's, argparse's): the same again in a replacement.
  const bool bad_input = WIFEXITED(status) && WEXITSTATUS(status) == 2;
  // Killed for hanging after training ended: the job's result stands unless it is of the
  // leading replica (or none closed the job yet), whose end is then missing.
  const bool hung_at_end = !ok && r.silent_at_end;
  const bool end_missing =
      hung_at_end && (closed_by_ < 0 || r.rank / o_.replica_size == closed_by_ / o_.replica_size);
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
    return replace_failed(r, status);
  } else if (!ok && !stopping_) {
    record_failure(r, status, end_missing);
  }
  return false;
}

void Attempt::stopped_on_request(Rank& r, int status) {
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
}

bool Attempt::replace_failed(Rank& r, int status) {
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
    say("started rank %d again (replacement %d of at most %d, "
        "pid %d); it joins the others\n",
        r.rank, r.replacements, o_.max_replacements, static_cast<int>(r.pid));
    return true;
  }
  return false;
}

void Attempt::record_failure(Rank& r, int status, bool end_missing) {
  drain(r, false);  // what it still wrote: its own error line names the cause
  Outcome mine;
  mine.failed = true;
  mine.code = exit_code_of(status);
  if (mine.code == 0) mine.code = 1;
  mine.description = concat(
      nnodes_ > 1 ? concat("node ", node_rank_, " ") : "", "rank ", r.rank, " (pid ", r.pid, ") ",
      end_missing ? "hung after training ended, before its replica ended the job (its "
                    "final evaluation, checkpoint and summary), and was killed"
                  : describe_status(status),
      r.error_line.empty() ? "" : ": " + r.error_line);
  // The first failure, unless it is a consequence (a broken connection) and a rank's
  // own failure comes while it settles: that one is the cause to report.
  if (!local_failure_ || (!outcome_.failed && !is_cause(*local_failure_) && is_cause(mine))) {
    if (!local_failure_) local_failure_at_ = Clock::now();
    local_failure_ = mine;
    if (is_cause(mine)) {
      say("%s; stopping the other ranks\n", mine.description.c_str());
      begin_stop(SIGTERM);
    }
  }
}

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
}  // namespace dtrain::launch::agent
