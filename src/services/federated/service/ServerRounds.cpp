// The federated server's round loop: wait for enough clients (K, or --min-clients after the
// selection timeout), select, open the round, wait for the updates (or run the secure phases),
// close it through RoundServer (the aggregator), evaluate, checkpoint, report; then tell every
// client that training is over.
#include <algorithm>
#include <cstdio>
#include <tuple>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/Privacy.h"
#include "services/federated/RoundLog.h"
#include "services/federated/service/ServerService.h"

namespace dtrain::services::federated {

ServerResult Server::Service::run() {
  ServerResult result;
  result.start_round = rounds_.round();
  const int64_t min_clients = std::max<int64_t>(1, o_.round.min_clients);
  RoundLog log(o_.metrics_file, o_.progress, o_.rounds, result.start_round);
  if (rounds_.buffered()) {
    run_buffered(result, log);
  } else {
    run_rounds(result, log, min_clients);
  }
  // Tell every client that checked in that training is over (those still training find out
  // when they next check in), within a bounded linger.
  std::unique_lock<std::mutex> lock(mutex_);
  done_ = true;
  changed_.notify_all();
  const auto linger_end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::min(o_.round_timeout_s, 30.0)));
  changed_.wait_until(lock, linger_end, [&] {
    return std::includes(told_done_.begin(), told_done_.end(), known_.begin(), known_.end());
  });
  result.rounds_done = rounds_.round();
  result.global = rounds_.global();
  result.refused = refused_;
  result.late = late_;
  result.refusals = refusals_;
  result.out_of_time = out_of_time_;
  return result;
}

void Server::Service::run_rounds(ServerResult& result, RoundLog& log, int64_t min_clients) {
  while (rounds_.round() < o_.rounds) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (stopping_) break;
    // Wait for K clients, or for min_clients once the selection timeout has passed.
    const auto waiting_since = Clock::now();
    const auto selection_deadline =
        waiting_since + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(o_.selection_timeout_s));
    const auto give_up = waiting_since + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(o_.wait_timeout_s));
    auto enough = [&] {
      const auto n = static_cast<int64_t>(waiting_.size());
      return stopping_ || n >= o_.round.clients_per_round ||
             (n >= min_clients && Clock::now() >= selection_deadline);
    };
    while (!enough()) {
      DTRAIN_CHECK_T(TimeoutError, Clock::now() < give_up, "federated server, round ",
                     rounds_.round() + 1, ": ", waiting_.size(), " clients waiting after ",
                     o_.wait_timeout_s, " s, fewer than --min-clients ", min_clients,
                     " (--wait-timeout)");
      changed_.wait_until(lock, std::min(Clock::now() + std::chrono::milliseconds(200), give_up));
    }
    if (stopping_) break;
    const auto round_start = Clock::now();
    std::vector<std::string> ids;
    for (const auto& entry : waiting_) ids.push_back(entry.first);
    const std::vector<std::string> chosen = rounds_.select(ids);
    selected_ = std::set<std::string>(chosen.begin(), chosen.end());
    finished_.clear();
    round_model_ = rounds_.global();
    round_control_ = rounds_.client_control();
    if (!round_control_.defined() && rounds_.aggregator().needs_control_deltas()) {
      round_control_ = at::zeros_like(round_model_);
    }
    open_round_ = rounds_.round() + 1;
    deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(o_.round_timeout_s));
    uplink_ = downlink_ = 0;
    if (o_.round.secure_aggregation) start_secure(chosen);
    open_ = true;
    changed_.notify_all();
    RoundRecord record;
    if (secure_) {
      run_secure(lock, &record);
    } else {
      changed_.wait_until(lock, deadline_,
                          [&] { return stopping_ || finished_.size() == selected_.size(); });
    }
    open_ = false;
    selected_.clear();
    secure_.reset();
    changed_.notify_all();
    record.uplink_bytes = uplink_;
    record.downlink_bytes = downlink_;
    lock.unlock();
    const auto closing = Clock::now();
    record.outcome = rounds_.close();
    record.server_aggregation_s += std::chrono::duration<double>(Clock::now() - closing).count();
    const int64_t done = rounds_.round();
    if (evaluate_ && record.outcome.applied && (done % o_.eval_every == 0 || done == o_.rounds)) {
      std::tie(record.test_loss, record.test_accuracy) = evaluate_(rounds_.global());
    }
    record.seconds = std::chrono::duration<double>(Clock::now() - round_start).count();
    if (o_.round.dp.enabled()) {
      std::lock_guard<std::mutex> seen(mutex_);
      const double q = std::min(1.0, static_cast<double>(o_.round.clients_per_round) /
                                         static_cast<double>(std::max<size_t>(1, known_.size())));
      record.dp_epsilon =
          dp_epsilon(q, o_.round.dp.noise_multiplier, done, o_.round.dp.delta).first;
    }
    if (!record.outcome.applied) {
      // What the clients that ran out of time in earlier attempts said the plan needs.
      std::lock_guard<std::mutex> reports(mutex_);
      const auto it = needed_s_.find(done + 1);
      if (it != needed_s_.end()) record.clients_needed_s = it->second;
    }
    if (!checkpoint_.empty() && record.outcome.applied) rounds_.save(checkpoint_);
    log.report(record, done, min_clients);
    result.rounds.push_back(record);
  }
}

}  // namespace dtrain::services::federated
