#include "dtrain/parallel/ps/WorkQueue.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ps {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

std::vector<int64_t> unit_bounds(int64_t examples, int64_t units, int workers, bool tapered) {
  DTRAIN_CHECK(units >= 1 && examples >= 0 && workers >= 1, "unit_bounds(", examples, ", ", units,
               ", ", workers, ")");
  // In quarters of a body unit: body units 4, then `workers` units of 2 and `workers` of 1.
  const int64_t tail = 2 * int64_t{workers};
  const bool taper = tapered && units >= 2 * tail && examples >= 4 * units;
  std::vector<int64_t> bounds(static_cast<size_t>(units) + 1, 0);
  const int64_t total = taper ? 4 * (units - tail) + 3 * int64_t{workers} : units;
  int64_t sum = 0;
  for (int64_t i = 0; i < units; ++i) {
    sum += !taper ? 1 : i < units - tail ? 4 : i < units - workers ? 2 : 1;
    bounds[static_cast<size_t>(i) + 1] = examples * sum / total;
  }
  return bounds;
}

WorkQueue::WorkQueue(WorkQueueOptions options) : options_(options) {
  DTRAIN_CHECK_INPUT(options_.max_copies >= 1, "a work unit needs at least one copy");
  last_progress_ = Clock::now();
}

void WorkQueue::open(int64_t round, int64_t units) {
  DTRAIN_CHECK(units >= 1, "a round needs work units");
  std::lock_guard<std::mutex> lock(mutex_);
  DTRAIN_CHECK(round > round_, "round ", round, " opened after round ", round_);
  round_ = round;
  units_.assign(static_cast<size_t>(units), UnitState{});
  bounds_.clear();
  if (examples_ > 0)
    bounds_ = unit_bounds(examples_, units, options_.workers, options_.tapered_units);
  next_pending_ = 0;
  done_ = 0;
  loss_ = 0.0;
  last_progress_ = Clock::now();
  ++stats_.rounds;
  changed_.notify_all();
}

double WorkQueue::median_seconds() const {
  if (seconds_.empty()) return 0.0;
  std::vector<double> sorted = seconds_;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2),
                   sorted.end());
  return sorted[sorted.size() / 2];
}

Assignment WorkQueue::next(int worker, std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mutex_);
  workers_.emplace(worker, false);
  const auto deadline = Clock::now() + wait;
  while (true) {
    if (closed_) {
      workers_[worker] = true;
      Assignment done;
      done.kind = Assignment::Done;
      done.reason = reason_;
      return done;
    }
    const auto units = static_cast<int64_t>(units_.size());
    if (round_ > 0 && done_ < units) {
      const auto now = Clock::now();
      auto hand_out = [&](int64_t unit, bool copy) {
        units_[static_cast<size_t>(unit)].running.push_back({worker, now, copy});
        ++stats_.issued;
        Assignment a;
        a.kind = Assignment::Unit;
        a.round = round_;
        a.unit = unit;
        a.units = units;
        a.backup = copy;
        if (!bounds_.empty()) {
          a.begin = bounds_[static_cast<size_t>(unit)];
          a.end = bounds_[static_cast<size_t>(unit) + 1];
        }
        return a;
      };
      if (next_pending_ < units) return hand_out(next_pending_++, false);
      auto holds = [&](const UnitState& u) {
        return std::any_of(u.running.begin(), u.running.end(),
                           [&](const Copy& c) { return c.worker == worker; });
      };
      // A unit whose every copy has run far longer than units take: its workers died.
      if (!seconds_.empty()) {
        const double lost_after =
            std::max(options_.lost_factor * median_seconds(),
                     std::chrono::duration<double>(options_.min_lost).count());
        for (int64_t i = 0; i < units; ++i) {
          UnitState& u = units_[static_cast<size_t>(i)];
          if (u.done || holds(u)) continue;
          const bool lost = std::all_of(u.running.begin(), u.running.end(), [&](const Copy& c) {
            return seconds_between(c.start, now) > lost_after;
          });
          if (lost) {
            ++stats_.reissued;
            return hand_out(i, true);
          }
        }
      }
      // Backup tasks: a copy of the unit expected to finish last, when this worker's copy
      // would finish before it.
      if (options_.backup_tasks) {
        const int64_t best = backup_candidate(worker, now);
        if (best >= 0) {
          ++stats_.backups;
          return hand_out(best, true);
        }
      }
    }
    const auto now = Clock::now();
    if (now >= deadline) return {};
    // Re-checked every 50 ms: a unit can become lost without anything being reported.
    changed_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(50)));
  }
}

double WorkQueue::expected_seconds(int worker, int64_t unit) const {
  const auto rate = rate_.find(worker);
  if (bounds_.empty() || rate == rate_.end()) return -1.0;
  const auto i = static_cast<size_t>(unit);
  return static_cast<double>(bounds_[i + 1] - bounds_[i]) / rate->second;
}

int64_t WorkQueue::backup_candidate(int worker, Clock::time_point now) const {
  // A copy whose worker has no measured speed yet, or that runs past what its speed predicts,
  // is of unknown remaining time: those come first (the one running longest), as the worker is
  // likely slow or gone; among the rest, the one expected to finish last, if this worker's copy
  // would finish before it.
  int64_t best = -1;
  double best_score = -1.0;
  for (int64_t i = 0; i < static_cast<int64_t>(units_.size()); ++i) {
    const UnitState& u = units_[static_cast<size_t>(i)];
    if (u.done || u.running.empty() || static_cast<int>(u.running.size()) >= options_.max_copies)
      continue;
    bool held = false, unknown = false;
    double remaining = std::numeric_limits<double>::infinity(), elapsed = 0.0;
    for (const Copy& c : u.running) {
      held = held || c.worker == worker;
      const double running = seconds_between(c.start, now);
      elapsed = std::max(elapsed, running);
      const double expected = expected_seconds(c.worker, i);
      if (expected < 0 || running > expected) {
        unknown = true;
      } else {
        remaining = std::min(remaining, expected - running);
      }
    }
    if (held) continue;
    double score = 0.0;
    if (unknown) {
      score = 1e12 + elapsed;
    } else {
      const double mine = expected_seconds(worker, i);
      if (mine >= 0 && mine >= remaining) continue;  // a copy would not finish first
      score = remaining;
    }
    if (score > best_score) {
      best_score = score;
      best = i;
    }
  }
  return best;
}

bool WorkQueue::finish(int worker, int64_t round, int64_t unit, double loss, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (round != round_ || unit < 0 || unit >= static_cast<int64_t>(units_.size())) {
    ++stats_.late_reports;
    return false;
  }
  if (!bounds_.empty() && seconds > 0) {  // this worker's speed, smoothed over its units
    const auto i = static_cast<size_t>(unit);
    const double rate = static_cast<double>(bounds_[i + 1] - bounds_[i]) / seconds;
    const auto known = rate_.find(worker);
    rate_[worker] = known == rate_.end() ? rate : 0.7 * known->second + 0.3 * rate;
  }
  UnitState& u = units_[static_cast<size_t>(unit)];
  bool copy = false;
  const auto mine = std::find_if(u.running.begin(), u.running.end(),
                                 [&](const Copy& c) { return c.worker == worker; });
  if (mine != u.running.end()) {
    copy = mine->copy;
    u.running.erase(mine);
  }
  if (u.done) {
    ++stats_.late_reports;
    return false;
  }
  u.done = true;
  u.running.clear();
  ++done_;
  loss_ += loss;
  if (seconds_.size() >= 1000) seconds_.erase(seconds_.begin());
  seconds_.push_back(seconds);
  if (copy) ++stats_.backups_won;
  ++stats_.units_by_worker[worker];
  last_progress_ = Clock::now();
  changed_.notify_all();
  return true;
}

double WorkQueue::wait_round(std::chrono::milliseconds stall) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (done_ < static_cast<int64_t>(units_.size())) {
    DTRAIN_CHECK(!closed_, "Sandblaster: the run was stopped (", reason_, ")");
    if (Clock::now() - last_progress_ > stall) {
      std::string missing;
      int listed = 0;
      for (size_t i = 0; i < units_.size() && listed < 8; ++i) {
        if (units_[i].done) continue;
        missing += concat(listed++ ? ", " : "", "unit ", i);
        if (units_[i].running.empty()) missing += " (not handed out)";
        for (const Copy& c : units_[i].running) missing += concat(" (worker ", c.worker, ")");
      }
      DTRAIN_THROW(CommError, "Sandblaster: no work unit of evaluation ", round_, " finished for ",
                   stall.count(), " ms; ", units_.size() - static_cast<size_t>(done_), " of ",
                   units_.size(), " missing: ", missing,
                   " - are the workers alive and reaching the coordinator?");
    }
    changed_.wait_for(lock, std::chrono::milliseconds(100));
  }
  return loss_;
}

void WorkQueue::close(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  closed_ = true;
  reason_ = reason;
  changed_.notify_all();
}

std::vector<int> WorkQueue::workers_not_told_done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> out;
  for (const auto& [worker, told] : workers_) {
    if (!told) out.push_back(worker);
  }
  return out;
}

WorkStats WorkQueue::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

std::string WorkQueue::check_examples(int worker, int64_t examples) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (examples_ < 0) {
    examples_ = examples;
    if (round_ > 0 && bounds_.empty()) {
      bounds_ = unit_bounds(examples_, static_cast<int64_t>(units_.size()), options_.workers,
                            options_.tapered_units);
    }
  }
  if (examples == examples_) return "";
  return concat("worker ", worker, " has ", examples, " training examples, the first worker had ",
                examples_, ": every worker must cut the same data into work units");
}

namespace {
WorkQueueHostFactory& installed_host() {
  static WorkQueueHostFactory factory;
  return factory;
}
}  // namespace

void set_work_queue_host(WorkQueueHostFactory factory) { installed_host() = std::move(factory); }

std::unique_ptr<WorkQueueHost> host_work_queue(WorkQueue& queue,
                                               const WorkCoordinatorOptions& options) {
  if (!installed_host()) {
    DTRAIN_THROW(Error,
                 "Sandblaster's coordinator: no work-queue host is installed (the library was "
                 "built without services/ps/WorkCoordinator.cpp)");
  }
  return installed_host()(queue, options);
}

}  // namespace dtrain::parallel::ps
