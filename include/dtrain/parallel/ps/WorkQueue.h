// Sandblaster's work units (DistBelief): every evaluation of the loss is cut into many more
// units than workers, handed out one at a time as workers ask, so a fast worker does more of
// them. Near the end of an evaluation, a worker with nothing left to do gets a backup copy of
// a unit another worker is still running; whichever copy finishes first counts (MapReduce's
// backup tasks: a straggler no longer sets the pace). A unit running far longer than units
// take (its worker died) is handed out again, backups or not. The queue is the coordinator's
// scheduling logic, without the network: services/ps/WorkCoordinator serves it over gRPC.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain::parallel::ps {

struct WorkQueueOptions {
  /// Hand idle workers backup copies of the units still running once none is left to start.
  bool backup_tasks = true;
  /// Copies of a unit running at once (the first included).
  int max_copies = 2;
  /// A unit running longer than this many times the median unit (and at least `min_lost`) is
  /// presumed lost - its worker died - and handed out again.
  double lost_factor = 5.0;
  std::chrono::milliseconds min_lost{2000};
  /// Unit sizes: tapered (the last 2 x `workers` units half and a quarter of the others' size,
  /// so an evaluation ends on small units) or equal.
  bool tapered_units = true;
  /// Workers expected (for the taper).
  int workers = 1;
};

/// Bounds of `units` contiguous units over `examples` (units + 1 values from 0 to examples):
/// equal, or tapered as WorkQueueOptions says (equal when there are fewer than 4 x workers
/// units or examples for them).
std::vector<int64_t> unit_bounds(int64_t examples, int64_t units, int workers, bool tapered);

struct Assignment {
  enum Kind { Wait, Unit, Done };
  Kind kind = Wait;
  int64_t round = 0, unit = 0, units = 0;
  /// The unit's examples [begin, end) (0, 0 while the training-set size is unknown: no worker
  /// has reported it through check_examples()).
  int64_t begin = 0, end = 0;
  bool backup = false;
  /// Done: why ("" when the run finished).
  std::string reason;
};

struct WorkStats {
  int64_t rounds = 0;
  /// Copies handed out: all, backups, and units handed out again because they were lost.
  int64_t issued = 0, backups = 0, reissued = 0;
  /// Units whose counted copy was a backup or a reissue (the first copy lost the race).
  int64_t backups_won = 0;
  /// Reports that did not count (another copy was first, or their round was over).
  int64_t late_reports = 0;
  /// Counted units per worker.
  std::map<int, int64_t> units_by_worker;
};

class WorkQueue {
 public:
  explicit WorkQueue(WorkQueueOptions options = {});
  /// Opens round `round` (> every earlier one) of `units` units.
  void open(int64_t round, int64_t units);
  /// The next copy for `worker`, waiting up to `wait` while there is none to give yet.
  Assignment next(int worker, std::chrono::milliseconds wait);
  /// A worker finished a unit with `loss`; true when this report counts (the first copy of a
  /// unit of the open round).
  bool finish(int worker, int64_t round, int64_t unit, double loss, double seconds);
  /// Waits until every unit of the open round has counted and returns their summed loss. An
  /// Error when no unit counted for `stall` (naming the units missing and who holds them) or
  /// the queue was closed.
  double wait_round(std::chrono::milliseconds stall);
  /// Ends the run: next() answers Done with `reason` from now on.
  void close(const std::string& reason = "");
  /// Workers that asked for work since the start and have not yet been told Done.
  std::vector<int> workers_not_told_done() const;
  WorkStats stats() const;
  /// The training-set size every worker must report (the first one sets it); "" or why not.
  std::string check_examples(int worker, int64_t examples);

 private:
  struct Copy {
    int worker = 0;
    std::chrono::steady_clock::time_point start;
    bool copy = false;  // a backup or a reissue, not the unit's first copy
  };
  struct UnitState {
    bool done = false;
    bool first_copy_counted = false;
    std::vector<Copy> running;
  };
  double median_seconds() const;
  /// Seconds `worker` is expected to take for `unit` (its measured examples per second; < 0
  /// when unknown). The lock is held.
  double expected_seconds(int worker, int64_t unit) const;
  /// The unit an idle `worker` should copy: the running one expected to finish last, when this
  /// worker's copy is expected to finish before it; -1 for none (the lock is held).
  int64_t backup_candidate(int worker, std::chrono::steady_clock::time_point now) const;
  WorkQueueOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  int64_t round_ = 0;
  std::vector<UnitState> units_;
  int64_t next_pending_ = 0;  // units below it have been handed out at least once
  int64_t done_ = 0;
  double loss_ = 0.0;
  std::chrono::steady_clock::time_point last_progress_;
  bool closed_ = false;
  std::string reason_;
  std::vector<double> seconds_;  // of counted units
  std::vector<int64_t> bounds_;  // of the open round's units (empty until examples_ is known)
  std::map<int, double> rate_;   // examples per second each worker computed, smoothed
  std::map<int, bool> workers_;  // worker -> told Done
  int64_t examples_ = -1;
  WorkStats stats_;
};

struct WorkCoordinatorOptions {
  /// host:port to listen on (port 0: any free port).
  std::string listen = "127.0.0.1:0";
  /// Token every call must carry ("" = none); TLS certificate and key ("" = plaintext).
  std::string auth_token;
  std::string tls_cert, tls_key;
};

/// Serves a queue to the workers over the network. The gRPC WorkCoordinator service
/// (services/ps/WorkCoordinator.h) is the one dtrain has; it installs itself when the library
/// loads, so this layer holds the scheduling logic and no network code.
class WorkQueueHost {
 public:
  virtual ~WorkQueueHost() = default;
  virtual int port() const = 0;
  virtual void shutdown() = 0;
};

using WorkQueueHostFactory =
    std::function<std::unique_ptr<WorkQueueHost>(WorkQueue&, const WorkCoordinatorOptions&)>;

/// Installs how queues are served (services/ps/WorkCoordinator.cpp does, at load).
void set_work_queue_host(WorkQueueHostFactory factory);

/// Serves `queue` as `options` say (an Error when no host is installed).
std::unique_ptr<WorkQueueHost> host_work_queue(WorkQueue& queue,
                                               const WorkCoordinatorOptions& options);

}  // namespace dtrain::parallel::ps
