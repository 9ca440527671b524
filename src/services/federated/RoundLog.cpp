#include "services/federated/RoundLog.h"

#include <algorithm>
#include <cmath>

#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

RoundLog::RoundLog(const std::string& metrics_file, bool progress, int64_t rounds,
                   int64_t start_round)
    : metrics_(metrics_file, start_round > 0),
      bar_(stderr, train::ProgressBar::is_terminal(stderr), std::max<int64_t>(1, rounds / 20)),
      progress_(progress),
      rounds_(rounds),
      start_round_(start_round) {}

void RoundLog::report(const RoundRecord& record, int64_t done, int64_t min_clients,
                      int max_retries) {
  const RoundOutcome& outcome = record.outcome;
  train::MetricRecord line{{"event", std::string("round")},
                           {"round", done},
                           {"applied", static_cast<int64_t>(outcome.applied)},
                           {"selected", outcome.selected},
                           {"finished", outcome.finished},
                           {"dropped", outcome.dropped},
                           {"train_loss", outcome.train_loss},
                           {"uplink_bytes", record.uplink_bytes},
                           {"downlink_bytes", record.downlink_bytes},
                           {"round_s", record.seconds}};
  if (record.dp_epsilon >= 0) line["dp_epsilon"] = record.dp_epsilon;
  if (outcome.dp_clip > 0) line["dp_clip"] = outcome.dp_clip;
  if (record.available >= 0) line["available"] = record.available;
  if (record.faulty >= 0) line["faulty"] = record.faulty;
  if (record.server_masks > 0) line["server_masks"] = record.server_masks;
  if (record.secagg_degree >= 0) line["secagg_degree"] = record.secagg_degree;
  if (record.client_masks > 0) line["client_masks"] = record.client_masks;
  if (record.sim_minutes >= 0) line["sim_minutes"] = record.sim_minutes;
  if (outcome.staleness >= 0) line["staleness"] = outcome.staleness;
  if (record.server_aggregation_s > 0) line["server_aggregation_s"] = record.server_aggregation_s;
  if (record.client_aggregation_s > 0) line["client_aggregation_s"] = record.client_aggregation_s;
  if (record.client_training_s > 0) line["client_training_s"] = record.client_training_s;
  if (record.test_accuracy >= 0) {
    line["test_accuracy"] = record.test_accuracy;
    line["test_loss"] = record.test_loss;
  }
  metrics_.write(line);
  if (progress_) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
    const auto rounds_here = static_cast<double>(done - start_round_);
    const double eta =
        rounds_here > 0 ? elapsed / rounds_here * static_cast<double>(rounds_ - done) : NAN;
    train::ProgressLine line;
    line.unit = "round";
    line.done = done;
    line.total = rounds_;
    line.loss = outcome.train_loss;
    line.samples_per_s = static_cast<double>(outcome.examples) / std::max(1e-9, record.seconds);
    line.step_ms = record.seconds * 1e3;
    line.eta_s = eta;
    bar_.update(line);
    if (record.test_accuracy >= 0) {
      bar_.note(concat("round ", done, ": test accuracy ", record.test_accuracy, ", loss ",
                       record.test_loss, " (", outcome.finished, "/", outcome.selected,
                       " clients)"));
    } else if (!outcome.applied) {
      bar_.note(concat("round ", done + 1, ": only ", outcome.finished, " of ", outcome.selected,
                       " clients finished (--min-clients ", min_clients, "); retried",
                       record.clients_needed_s >= 0
                           ? concat(" (clients out of time said its plan needs up to ",
                                    std::llround(record.clients_needed_s), " s of local training)")
                           : std::string()));
    }
  }
  if (outcome.applied) {
    retries_ = 0;
    return;
  }
  DTRAIN_CHECK_T(Error, ++retries_ < max_retries, "round ", done + 1, ": only ", outcome.finished,
                 " of ", outcome.selected, " clients finished, ", max_retries,
                 " times in a row (--min-clients ", min_clients, ")");
}

}  // namespace dtrain::services::federated
