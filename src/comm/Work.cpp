// PromiseWork and helpers: Works completed by dtrain's own comm thread.
#include "dtrain/comm/Work.h"

#include "dtrain/common/Error.h"

namespace dtrain::comm {

PromiseWork::PromiseWork(std::string description, Milliseconds timeout)
    : description_(std::move(description)), timeout_(timeout) {}

void PromiseWork::wait(Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!done_cv_.wait_for(lock, timeout, [this] { return done_; })) {
    DTRAIN_THROW(TimeoutError, "timed out after ", timeout.count(), " ms: ", description_);
  }
  if (error_) std::rethrow_exception(error_);
}

bool PromiseWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void PromiseWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = error;
  }
  done_cv_.notify_all();
}

WorkPtr completed_work(std::string description) {
  auto work = std::make_shared<PromiseWork>(std::move(description), Milliseconds(0));
  work->finish();
  return work;
}

void wait_all(const std::vector<WorkPtr>& works) {
  for (const auto& work : works) work->wait();
}

}  // namespace dtrain::comm
