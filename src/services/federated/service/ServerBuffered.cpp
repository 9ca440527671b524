// The federated server without rounds (FedBuff, --buffer-size K): a client that checks in starts
// training from the current model whenever fewer than --concurrency clients are, each with its
// own deadline (--round-timeout); its update is taken whenever it arrives (RoundServer weighs it
// by its staleness), and every K accepted updates the loop applies the buffer as one step:
// evaluated, checkpointed (with who is training from which step) and reported like a round.
#include <cstdio>
#include <tuple>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/Privacy.h"
#include "services/federated/service/ServerService.h"

namespace dtrain::services::federated {

void Server::Service::end_flight(const std::string& id) {
  const auto flight = flights_.find(id);
  if (flight == flights_.end()) return;
  const int64_t version = flight->second.version;
  flights_.erase(flight);
  // The model version goes when nobody trains from it and it is not the current one.
  for (const auto& entry : flights_) {
    if (entry.second.version == version) return;
  }
  if (version != rounds_.round()) versions_.erase(version);
}

void Server::Service::check_in_buffered(const std::string& id, int64_t wait_ms,
                                        std::unique_lock<std::mutex>& lock,
                                        dtrain::fl::CheckInReply* reply) {
  if (flights_.count(id) > 0) {
    // Checking in while training: it restarted and lost that work.
    rounds_.leave(id);
    end_flight(id);
  }
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o_.round_timeout_s));
  const auto try_start = [&] {
    if (done_ || stopping_ || !rounds_.start(id).empty()) return false;
    const int64_t version = rounds_.round();
    if (versions_.count(version) == 0) versions_[version] = rounds_.global();
    flights_[id] = {version, Clock::now() + timeout};
    return true;
  };
  bool started = try_start();
  if (!started && !done_) {
    ++waiting_[id];
    changed_.notify_all();
    changed_.wait_until(lock, Clock::now() + std::chrono::milliseconds(wait_ms),
                        [&] { return (started = try_start()) || done_ || stopping_; });
    if (--waiting_[id] == 0) waiting_.erase(id);
  }
  if (started) {
    const Flight& flight = flights_.at(id);
    fill_train(id, flight.version + 1, flight.deadline, reply);
  } else if (done_) {
    reply->set_action(dtrain::fl::CheckInReply::DONE);
    reply->set_reason(stopping_ ? "the server stopped" : "the last round is over");
    told_done_.insert(id);
    changed_.notify_all();
  } else {
    reply->set_action(dtrain::fl::CheckInReply::WAIT);
  }
}

void Server::Service::run_buffered(ServerResult& result, RoundLog& log) {
  while (rounds_.round() < o_.rounds) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (stopping_) break;
    const auto step_start = Clock::now();
    auto progress = step_start;
    int64_t buffered_before = -1;
    const auto give_up = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(o_.wait_timeout_s));
    while (!stopping_ && !rounds_.buffer_full()) {
      // Clients past their deadline stop counting against --concurrency.
      const auto now = Clock::now();
      for (auto it = flights_.begin(); it != flights_.end();) {
        const std::string id = (it++)->first;
        const Flight& flight = flights_.at(id);
        if (flight.deadline > now) continue;
        std::fprintf(stderr,
                     "fl server: client '%s' did not send its update from step %lld "
                     "within --round-timeout %g s; it no longer counts\n",
                     id.c_str(), static_cast<long long>(flight.version), o_.round_timeout_s);
        rounds_.leave(id);
        end_flight(id);
        ++expired_;
        changed_.notify_all();
      }
      const int64_t in_flight = static_cast<int64_t>(flights_.size());
      if (in_flight != buffered_before) {
        buffered_before = in_flight;
        progress = now;
      }
      DTRAIN_CHECK_T(TimeoutError, in_flight > 0 || now - progress < give_up,
                     "federated server, step ", rounds_.round() + 1,
                     ": no client training and the buffer not full after ", o_.wait_timeout_s,
                     " s (--wait-timeout; --buffer-size ", o_.round.buffer.size, ")");
      changed_.wait_until(lock, now + std::chrono::milliseconds(200));
    }
    if (stopping_) break;
    RoundRecord record;
    record.uplink_bytes = uplink_;
    record.downlink_bytes = downlink_;
    uplink_ = downlink_ = 0;
    // Applied with the lock held: an upload arriving meanwhile goes into the next buffer, not
    // this one (uploads submit under the same lock).
    const auto closing = Clock::now();
    record.outcome = rounds_.close();
    record.server_aggregation_s += std::chrono::duration<double>(Clock::now() - closing).count();
    const int64_t done = rounds_.round();
    // The new version is the one clients start from now; the old goes when nobody uses it.
    versions_[done] = rounds_.global();
    bool used = false;
    for (const auto& entry : flights_) used = used || entry.second.version == done - 1;
    if (!used) versions_.erase(done - 1);
    changed_.notify_all();
    lock.unlock();
    if (evaluate_ && (done % o_.eval_every == 0 || done == o_.rounds)) {
      std::tie(record.test_loss, record.test_accuracy) = evaluate_(rounds_.global());
    }
    record.seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    if (o_.round.dp.enabled()) {
      std::lock_guard<std::mutex> seen(mutex_);
      const double q = std::min(1.0, static_cast<double>(o_.round.buffer.size) /
                                         static_cast<double>(std::max<size_t>(1, known_.size())));
      record.dp_epsilon =
          dp_epsilon(q, o_.round.dp.noise_multiplier, done, o_.round.dp.delta).first;
    }
    if (!checkpoint_.empty()) rounds_.save(checkpoint_);
    log.report(record, done, 1);
    result.rounds.push_back(record);
  }
}

}  // namespace dtrain::services::federated
