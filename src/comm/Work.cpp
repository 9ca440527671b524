// PromiseWork and helpers: Works completed by dtrain's own comm thread.
#include "dtrain/comm/Work.h"

#include "dtrain/common/Error.h"

namespace dtrain::comm {

std::string Work::timeout_diagnosis() const {
  if (!diagnose_) return "";
  try {
    return diagnose_();
  } catch (const std::exception& e) {
    return concat("; (could not read the other ranks' progress: ", first_line(e.what()), ")");
  }
}

PromiseWork::PromiseWork(std::string description, Milliseconds timeout)
    : description_(std::move(description)), timeout_(timeout) {}

void PromiseWork::wait(Milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!done_cv_.wait_for(lock, timeout, [this] { return done_; })) {
    lock.unlock();
    DTRAIN_THROW(TimeoutError, "timed out after ", timeout.count(), " ms: ", description_,
                 timeout_diagnosis());
  }
  if (!error_) return;
  try {
    std::rethrow_exception(error_);
  } catch (const TimeoutError& e) {  // a step of the algorithm timed out: the op did
    const std::string diagnosis = timeout_diagnosis();
    if (diagnosis.empty()) throw;
    throw TimeoutError(e.message() + diagnosis, __FILE__, __LINE__);
  }
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
