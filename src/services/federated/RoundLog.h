// What the simulation and the gRPC server both do after a round: one metrics line, the
// progress bar (and a note with the round's test accuracy), and the count of rounds too few
// clients finished in a row (an error past a limit, naming --min-clients).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"

namespace dtrain::services::federated {

class RoundLog {
 public:
  /// `rounds`: the run's last round; `start_round`: rounds already applied (a resumed run
  /// appends to the metrics file).
  RoundLog(const std::string& metrics_file, bool progress, int64_t rounds, int64_t start_round);
  /// Reports `record`; `done` is the server's round after it. Throws when `max_retries` rounds
  /// in a row closed without enough finishers.
  void report(const RoundRecord& record, int64_t done, int64_t min_clients, int max_retries = 10);
  /// Any other record (e.g. the personalization summary).
  void write(const train::MetricRecord& record) { metrics_.write(record); }

 private:
  train::MetricsWriter metrics_;
  train::ProgressBar bar_;
  const bool progress_;
  const int64_t rounds_, start_round_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  int retries_ = 0;
};

}  // namespace dtrain::services::federated
