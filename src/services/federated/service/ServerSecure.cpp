// The federated server's secure-aggregation phases (Bonawitz et al.): the SecAgg handler that
// takes each step's messages, and the driver that moves the open round through advertise keys,
// share keys, masked input and reveal, within each step's timeout, submitting only the
// unmasked sum to RoundServer (or aborting the round, nothing submitted).
#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "services/federated/secagg/SecureRound.h"
#include "services/federated/service/FlWire.h"
#include "services/federated/service/ServerService.h"

namespace dtrain::services::federated {

namespace {

// The secure rounds whose dropouts --secagg-graph auto looks back on.
constexpr size_t kDropoutsRemembered = 5;

}  // namespace

grpc::Status Server::Service::SecAgg(grpc::ServerContext* context,
                                     const dtrain::fl::SecAggRequest* request,
                                     dtrain::fl::SecAggReply* reply) {
  const std::string& id = request->client_id();
  if (!valid_client_id(id)) {
    return invalid("SecAgg: field 'client_id' must be 1 to 128 of [A-Za-z0-9._-]");
  }
  if (grpc::Status s = authorize(*context, id); !s.ok()) return s;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!open_ || !secure_ || selected_.count(id) == 0 || request->round() != open_round_) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("SecAgg: client '", id, "' is not in a secure round ", request->round())};
  }
  SecureServerRound& st = *secure_;
  const uint64_t generation = secure_generation_;
  if (st.phase == SecureServerRound::Aborted) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("SecAgg: round ", open_round_, " was aborted: ", st.abort_reason)};
  }
  const uint32_t me = st.ids.at(id);
  uplink_ += wire::message_bytes(*request);
  if (request->send()) {
    const auto start = Clock::now();
    const SecureServerRound::StepResult done = st.apply(*request, me);
    switch (done.kind) {
      case SecureServerRound::StepResult::Late:
        return too_late(id, done.why.c_str());
      case SecureServerRound::StepResult::Malformed:
        return invalid(done.why);
      case SecureServerRound::StepResult::Refused:
        return refuse_locked(id, concat("SecAgg: ", done.why));
      case SecureServerRound::StepResult::Applied:
        break;
    }
    st.server_s += std::chrono::duration<double>(Clock::now() - start).count();
    changed_.notify_all();
  }
  // The step's reply is ready once the protocol has moved past it.
  const SecureServerRound::Phase needed = SecureServerRound::ready_at(request->step());
  const int64_t wait_ms = std::clamp<int64_t>(request->wait_ms(), 0, kMaxWaitMs);
  changed_.wait_until(lock, Clock::now() + std::chrono::milliseconds(wait_ms),
                      [&] { return stopping_ || !secure_ || secure_->phase >= needed; });
  // (The round may have ended while waiting: `st` is then gone.)
  if (!secure_ || generation != secure_generation_ || !open_ ||
      secure_->phase == SecureServerRound::Aborted) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("SecAgg: round ", request->round(), " was aborted or is over",
                   secure_ && generation == secure_generation_ ? ": " + secure_->abort_reason
                                                               : std::string())};
  }
  if (secure_->phase < needed) {
    reply->set_ready(false);
    return grpc::Status::OK;
  }
  reply->set_ready(true);
  st.fill_reply(request->step(), me, reply);
  return grpc::Status::OK;
}

grpc::Status Server::Service::too_late(const std::string& id, const char* what) {
  ++late_;
  return {grpc::StatusCode::FAILED_PRECONDITION,
          concat("SecAgg: client '", id, "' sent ", what, " after that step of round ", open_round_,
                 " was over")};
}

// The weight reference: the largest example count checked in (1 with differential
// privacy's equal weights).
void Server::Service::start_secure(const std::vector<std::string>& chosen) {
  int64_t ref = 1;
  if (!o_.round.dp.enabled()) {
    for (const auto& id : chosen) ref = std::max(ref, examples_[id]);
  }
  uint64_t graph_seed = 0;
  randombytes_buf(&graph_seed, sizeof graph_seed);  // the round's graph: not the clients' choice
  // --secagg-graph auto: sized for the larger of --secagg-dropout and the dropouts seen lately.
  double dropout = o_.secagg_dropout;
  for (const double seen : dropouts_seen_) dropout = std::max(dropout, seen);
  const auto n = static_cast<int64_t>(chosen.size());
  if (o_.secagg_graph == secagg::kAutoGraph && dropout > o_.secagg_dropout) {
    // (Where no graph is reliable enough at that rate, the full one: the most holders there are.)
    const std::string line =
        "sized for the " + std::to_string(std::lround(dropout * 100)) +
        "% dropouts seen lately: " + secagg::describe_auto_degree(n, o_.secagg_threshold, dropout);
    // Said when it changes, not every round.
    if (line != auto_said_) {
      std::fprintf(stderr, "fl server: round %lld: %s\n", static_cast<long long>(open_round_),
                   line.c_str());
      auto_said_ = line;
    }
  }
  secure_ = std::make_unique<SecureServerRound>(chosen, o_.secagg_threshold, ref, numel_,
                                                o_.secagg_graph, graph_seed, dropout);
  ++secure_generation_;
}

// Drives the protocol's steps for the open round (the lock held, released while waiting);
// the unmasked sum is submitted to the RoundServer, or the round aborted (nothing submitted).
void Server::Service::run_secure(std::unique_lock<std::mutex>& lock, RoundRecord* record) {
  SecureServerRound& st = *secure_;
  const auto step_limit = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o_.secagg_step_timeout_s));
  auto wait_for = [&](const std::set<uint32_t>& sent, size_t expected, Clock::time_point until) {
    changed_.wait_until(lock, until, [&] { return stopping_ || sent.size() >= expected; });
  };
  auto abort = [&](const std::string& why) {
    st.phase = SecureServerRound::Aborted;
    st.abort_reason = why;
    changed_.notify_all();
    std::fprintf(stderr, "fl server: round %lld: %s\n", static_cast<long long>(open_round_),
                 why.c_str());
  };
  try {
    if (st.threshold > static_cast<int>(st.ids.size())) {
      throw Error(concat("secure aggregation: ", st.ids.size(),
                         " clients selected, fewer than "
                         "the threshold ",
                         st.threshold),
                  __FILE__, __LINE__);
    }
    wait_for(st.sent_keys, st.ids.size(), std::min(deadline_, Clock::now() + step_limit));
    st.u1 = st.session->advertised();
    st.phase = SecureServerRound::Shares;
    changed_.notify_all();
    wait_for(st.sent_shares, st.u1.size(), std::min(deadline_, Clock::now() + step_limit));
    st.u2 = st.session->shared();
    st.phase = SecureServerRound::Masking;
    changed_.notify_all();
    wait_for(st.sent_masked, st.u2.size(), deadline_);
    st.u3 = st.session->masked();
    st.phase = SecureServerRound::Reveal;
    changed_.notify_all();
    wait_for(st.sent_reveal, st.u3.size(), Clock::now() + step_limit);
    const auto start = Clock::now();
    const SecureSum total = secure_sum(st.session->finish(), numel_, st.ref, o_.secagg_frac_bits);
    std::vector<std::string> finished;
    for (uint32_t v : st.u3) finished.push_back(st.names.at(v));
    const std::string why =
        rounds_.submit_sum(total.weighted_sum, total.weight, finished, total.loss_sum);
    st.server_s += std::chrono::duration<double>(Clock::now() - start).count();
    if (!why.empty()) {
      abort("secure aggregation: the sum was refused: " + why);
    } else {
      st.phase = SecureServerRound::Done;
      finished_.insert(finished.begin(), finished.end());
    }
  } catch (const Error& e) {
    abort(e.what());
  }
  // The share of the chosen clients lost before their masked inputs (those that never sent
  // keys included: their neighbours hold one share fewer too), once the inputs were awaited.
  if (!st.u2.empty()) {
    dropouts_seen_.push_back(1.0 - static_cast<double>(st.sent_masked.size()) /
                                       static_cast<double>(st.ids.size()));
    if (dropouts_seen_.size() > kDropoutsRemembered) dropouts_seen_.pop_front();
  }
  record->server_aggregation_s = st.server_s;
  record->secagg_degree = st.degree;
  changed_.notify_all();
}

}  // namespace dtrain::services::federated
