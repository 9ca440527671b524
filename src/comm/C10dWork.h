// Work over a c10d Work: dtrain's description, timeout and error wording for every c10d-based
// backend (gloo/, nccl/), plus a completion step run once after a successful wait.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <mutex>
#include <string>

#include "dtrain/comm/Work.h"
#include "dtrain/common/Error.h"

namespace dtrain::comm {

using dtrain::first_line;

/// What a transport's error means in dtrain's words, ahead of it: a connection a peer closed
/// is that peer's end (its own failure, or a stop), not this rank's fault.
inline std::string in_our_words(const std::string& cause) {
  const bool peer_gone = cause.find("closed by peer") != std::string::npos ||
                         cause.find("reset by peer") != std::string::npos ||
                         cause.find("Broken pipe") != std::string::npos;
  return peer_gone ? "a peer rank is gone (it failed or was stopped first: its launcher, or srun, "
                     "names it and why): "
                   : "";
}

/// Runs a c10d call that may throw synchronously (e.g. posting to a closed connection).
template <typename Call>
inline c10::intrusive_ptr<c10d::Work> issue(const std::string& description, Call&& call) {
  try {
    return call();
  } catch (const std::exception& e) {
    const std::string cause = first_line(e.what());
    DTRAIN_THROW(CommError, in_our_words(cause), description, " failed: ", cause);
  }
}

/// A c10d Work plus dtrain's description, timeout, and a completion step run once after a
/// successful wait (dividing for AVG, copying back into a non-contiguous tensor).
class C10dWork : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string description, Milliseconds timeout,
           std::function<void()> then = nullptr)
      : work_(std::move(work)),
        description_(std::move(description)),
        timeout_(timeout),
        then_(std::move(then)) {}

  void wait(Milliseconds timeout) override {
    try {
      work_->wait(timeout);
    } catch (const std::exception& e) {
      const std::string cause = first_line(e.what());
      if (cause.find("timed out") != std::string::npos ||
          cause.find("Timed out") != std::string::npos) {
        DTRAIN_THROW(TimeoutError, "timed out after ", timeout.count(), " ms: ", description_, " (",
                     cause, ")", timeout_diagnosis());
      }
      DTRAIN_THROW(CommError, in_our_words(cause), description_, " failed: ", cause);
    }
    std::call_once(then_once_, [this] {
      if (then_) then_();
    });
  }
  bool is_completed() override { return work_->isCompleted(); }
  const std::string& description() const override { return description_; }
  Milliseconds default_timeout() const override { return timeout_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string description_;
  Milliseconds timeout_;
  std::function<void()> then_;
  std::once_flag then_once_;
};

}  // namespace dtrain::comm
