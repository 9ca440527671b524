// Work: the handle every asynchronous communication op returns (c10d's Work, reduced to what
// dtrain needs). Errors travel in it as exceptions; every wait is bounded.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace dtrain::comm {

using Milliseconds = std::chrono::milliseconds;

/// An in-flight communication op. `wait()` blocks until it completes (or its timeout passes)
/// and rethrows its error as dtrain::CommError / dtrain::TimeoutError naming op, group, ranks.
class Work {
 public:
  virtual ~Work() = default;
  /// Waits with the timeout the op was issued with.
  void wait() { wait(default_timeout()); }
  /// Waits at most `timeout`; throws TimeoutError when it passes.
  virtual void wait(Milliseconds timeout) = 0;
  virtual bool is_completed() = 0;
  /// "allreduce(sum, 1024 x float) on group world [rank 0 of 2]", used in error messages.
  virtual const std::string& description() const = 0;
  virtual Milliseconds default_timeout() const = 0;

  /// For collectives: called when the op times out, returns which ranks did not arrive (from
  /// the group's progress board), appended to the TimeoutError's message.
  void set_timeout_diagnosis(std::function<std::string()> diagnose) {
    diagnose_ = std::move(diagnose);
  }

 protected:
  /// "" or "; did not arrive: ..." (never throws).
  std::string timeout_diagnosis() const;

 private:
  std::function<std::string()> diagnose_;
};
using WorkPtr = std::shared_ptr<Work>;

/// A Work completed by a function running elsewhere (a comm thread); used by algorithms that
/// dtrain implements itself on top of point-to-point ops.
class PromiseWork : public Work {
 public:
  PromiseWork(std::string description, Milliseconds timeout);
  void wait(Milliseconds timeout) override;
  bool is_completed() override;
  const std::string& description() const override { return description_; }
  Milliseconds default_timeout() const override { return timeout_; }
  /// Marks the op finished, with `error` if it failed.
  void finish(std::exception_ptr error = nullptr);

 private:
  std::string description_;
  Milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

/// A Work that is already complete (ops on a 1-rank group).
WorkPtr completed_work(std::string description);

/// Waits for every work in `works` (each with its own timeout).
void wait_all(const std::vector<WorkPtr>& works);

}  // namespace dtrain::comm
