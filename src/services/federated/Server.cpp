#include "dtrain/services/federated/Server.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/federated.grpc.pb.h"
#include "services/federated/FlWire.h"
#include "services/federated/RoundLog.h"
#include "services/federated/SecureRound.h"
#include "services/federated/SecureServerRound.h"
#include "dtrain/services/federated/SecureAggregation.h"

namespace dtrain::federated {

using Clock = std::chrono::steady_clock;

std::map<std::string, std::string> read_client_tokens(const std::string& path) {
  std::ifstream in(path);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read the client tokens file ", path);
  std::map<std::string, std::string> tokens;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    std::istringstream words(line);
    std::string client, token, extra;
    if (!(words >> client) || client[0] == '#') continue;
    DTRAIN_CHECK_INPUT(static_cast<bool>(words >> token) && !(words >> extra), path, ":", number,
                       ": expected 'CLIENT_ID TOKEN'");
    DTRAIN_CHECK_INPUT(valid_client_id(client), path, ":", number, ": '", client,
                       "' is not a client id (1 to 128 of [A-Za-z0-9._-])");
    DTRAIN_CHECK_INPUT(tokens.emplace(client, token).second, path, ":", number, ": client '",
                       client, "' is listed twice");
  }
  DTRAIN_CHECK_INPUT(!tokens.empty(), path, " lists no clients");
  return tokens;
}

namespace {

// A stable 64-bit hash of a client id (FNV-1a): its per-round seed.
uint64_t id_hash(const std::string& id) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : id) h = (h ^ c) * 1099511628211ULL;
  return h;
}

grpc::Status invalid(const std::string& why) { return {grpc::StatusCode::INVALID_ARGUMENT, why}; }

constexpr int64_t kMaxWaitMs = 30000;
constexpr size_t kRefusalsKept = 20;

}  // namespace

class Server::Service final : public dtrain::fl::Federated::Service {
 public:
  Service(at::Tensor initial, ServerOptions options, Evaluate evaluate)
      : o_(std::move(options)), evaluate_(std::move(evaluate)),
        rounds_(initial, round_options(o_)), numel_(initial.numel()),
        dtype_(initial.scalar_type()) {
    validate(o_.local);
    DTRAIN_CHECK_INPUT(o_.rounds >= 1, "--rounds must be >= 1, got ", o_.rounds);
    DTRAIN_CHECK_INPUT(o_.round_timeout_s > 0 && o_.selection_timeout_s >= 0 &&
                           o_.wait_timeout_s > 0,
                       "--round-timeout and --wait-timeout must be > 0, --selection-timeout >= 0");
    DTRAIN_CHECK_INPUT(o_.eval_every >= 1, "--eval-every must be >= 1, got ", o_.eval_every);
    DTRAIN_CHECK_INPUT(!o_.secure_aggregation || o_.compression.kind == CompressionSpec::None,
                       "--secure-aggregation sends masked 32-bit words, which do not compress: it "
                       "cannot be combined with --compression");
    DTRAIN_CHECK_INPUT(!o_.secure_aggregation || o_.clients_per_round >= 2,
                       "--secure-aggregation needs --clients-per-round >= 2");
    DTRAIN_CHECK_INPUT(o_.secagg_threshold >= 0 && o_.secagg_threshold <= 1 &&
                           o_.secagg_step_timeout_s > 0,
                       "--secagg-threshold must be in [0, 1] and --secagg-step-timeout > 0");
    DTRAIN_CHECK_INPUT(o_.token.empty() || o_.client_tokens.empty(),
                       "give either --auth-token-file or --client-tokens, not both");
    if (!o_.checkpoint_dir.empty()) {
      checkpoint_ = o_.checkpoint_dir + "/server.pt";
      if (std::filesystem::exists(checkpoint_)) rounds_.load(checkpoint_);
    }
    server_ = rpc::start_server("the federated server", o_.listen, o_.tls_cert, o_.tls_key, this,
                                true, &port_);
  }

  ~Service() override {
    stop();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  int port() const { return port_; }
  int64_t round() const { return rounds_.round(); }
  const ServerOptions& options() const { return o_; }

  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }

  grpc::Status CheckIn(grpc::ServerContext* context, const dtrain::fl::CheckInRequest* request,
                       dtrain::fl::CheckInReply* reply) override {
    const std::string& id = request->client_id();
    if (!valid_client_id(id)) {
      return invalid("CheckIn: field 'client_id' must be 1 to 128 of [A-Za-z0-9._-]");
    }
    if (grpc::Status s = authorize(*context, id); !s.ok()) return s;
    if (request->examples() < 1) {
      return invalid(concat("CheckIn: field 'examples' is ", request->examples(), " (>= 1)"));
    }
    const int64_t wait_ms = std::clamp<int64_t>(request->wait_ms(), 0, kMaxWaitMs);
    std::unique_lock<std::mutex> lock(mutex_);
    known_.insert(id);
    examples_[id] = request->examples();
    auto selected_now = [&] { return open_ && selected_.count(id) > 0 && finished_.count(id) == 0; };
    if (!selected_now() && !done_) {
      ++waiting_[id];
      changed_.notify_all();
      changed_.wait_until(lock, Clock::now() + std::chrono::milliseconds(wait_ms),
                          [&] { return selected_now() || done_ || stopping_; });
      if (--waiting_[id] == 0) waiting_.erase(id);
    }
    if (selected_now()) {
      reply->set_action(dtrain::fl::CheckInReply::TRAIN);
      reply->set_round(open_round_);
      reply->set_deadline_ms(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()).count()));
      auto* plan = reply->mutable_plan();
      const LocalTraining local = rounds_.plan();  // the aggregator's, for the open round
      plan->set_epochs(local.epochs);
      plan->set_batch(local.batch);
      plan->set_lr(local.lr);
      plan->set_momentum(local.momentum);
      plan->set_weight_decay(local.weight_decay);
      plan->set_prox_mu(local.prox_mu);
      plan->set_clip_norm(o_.dp.clip);
      plan->set_compression(o_.compression.kind == CompressionSpec::TopK
                                ? concat("topk:", o_.compression.fraction)
                                : to_string(o_.compression));
      reply->set_parameters(numel_);
      reply->set_model(o_.model);
      for (int64_t h : o_.hidden) reply->add_hidden(h);
      reply->set_seed(id_hash(id) ^ (static_cast<uint64_t>(open_round_) * 0x9E3779B97F4A7C15ULL) ^
                      o_.seed);
      if (secure_) {
        auto* setup = reply->mutable_secagg();
        setup->set_id(secure_->ids.at(id));
        setup->set_threshold(secure_->threshold);
        setup->set_frac_bits(o_.secagg_frac_bits);
        setup->set_ref(secure_->ref);
      }
    } else if (done_) {
      reply->set_action(dtrain::fl::CheckInReply::DONE);
      reply->set_reason(stopping_ ? "the server stopped" : "the last round is over");
      // One that wants the final model is done when it has downloaded it.
      if (!request->final_model()) told_done_.insert(id);
      changed_.notify_all();
    } else {
      reply->set_action(dtrain::fl::CheckInReply::WAIT);
    }
    return grpc::Status::OK;
  }

  grpc::Status Download(grpc::ServerContext* context, const dtrain::fl::DownloadRequest* request,
                        grpc::ServerWriter<dtrain::fl::ModelChunk>* writer) override {
    const std::string& id = request->client_id();
    if (!valid_client_id(id)) {
      return invalid("Download: field 'client_id' must be 1 to 128 of [A-Za-z0-9._-]");
    }
    if (grpc::Status s = authorize(*context, id); !s.ok()) return s;
    at::Tensor model;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Round 0 once training is over: the final model (for personalization).
      if (done_ && request->round() == 0) {
        model = rounds_.global();
      } else if (!open_ || selected_.count(id) == 0 || request->round() != open_round_) {
        return {grpc::StatusCode::FAILED_PRECONDITION,
                concat("Download: client '", id, "' is not selected for round ", request->round(),
                       open_ ? concat(" (round ", open_round_, " is open)") : " (no round is open)")};
      } else {
        model = round_model_;
      }
    }
    int64_t bytes = 0;
    bool open = true;
    wire::for_each_chunk({{"", model}}, rpc::kDefaultChunkBytes, [&](rpc::TensorChunk&& chunk) {
      if (!open) return;
      dtrain::fl::ModelChunk message;
      message.set_round(request->round());
      *message.mutable_chunk() = std::move(chunk);
      bytes += wire::message_bytes(message);
      open = !context->IsCancelled() && writer->Write(message);
    });
    std::lock_guard<std::mutex> lock(mutex_);
    downlink_ += bytes;
    if (done_ && request->round() == 0) {
      told_done_.insert(id);
      changed_.notify_all();
    }
    return open ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }

  grpc::Status Upload(grpc::ServerContext* context,
                      grpc::ServerReader<dtrain::fl::UpdateChunk>* reader,
                      dtrain::fl::UploadReply* reply) override {
    wire::UpdateReader update(numel_);
    dtrain::fl::UpdateChunk message;
    int64_t bytes = 0;
    std::string id;
    while (reader->Read(&message)) {
      if (update.messages() == 0) {
        id = message.client_id();
        if (!valid_client_id(id)) {
          return invalid("Upload: field 'client_id' must be 1 to 128 of [A-Za-z0-9._-]");
        }
        if (grpc::Status s = authorize(*context, id); !s.ok()) return s;
        if (grpc::Status s = check_open(id, message.round()); !s.ok()) return s;
      }
      bytes += wire::message_bytes(message);
      const std::string why = update.add(message);
      if (!why.empty()) return refuse(id, "Upload: " + why);
    }
    if (update.messages() == 0) return invalid("Upload: the stream held no messages");
    EncodedUpdate encoded;
    at::Tensor dense;
    std::string why = update.finish(&encoded);
    const bool masked = encoded.encoding == "secagg";
    if (why.empty() && !masked) why = decode_update(encoded, numel_, dtype_, &dense);
    if (why.empty() && masked &&
        (encoded.parts.size() != 1 || encoded.parts[0].first != "masked" ||
         encoded.parts[0].second.scalar_type() != at::kInt ||
         encoded.parts[0].second.numel() != numel_ + 2)) {
      why = concat("a secagg update must be one int32 part 'masked' of ", numel_ + 2, " elements");
    }
    if (!why.empty()) return refuse(id, "Upload: " + why);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_ || open_round_ != update.header().round()) {
      ++late_;
      return {grpc::StatusCode::FAILED_PRECONDITION,
              concat("Upload: round ", update.header().round(), " closed before the update arrived")};
    }
    if (masked != static_cast<bool>(secure_)) {
      return refuse_locked(id, secure_ ? "Upload: this round uses secure aggregation (encoding secagg)"
                                       : "Upload: this round does not use secure aggregation");
    }
    if (masked) {
      // (Selected when the stream began; a retried round may have selected others since.)
      if (secure_->ids.count(id) == 0) {
        return refuse_locked(id, concat("Upload: client '", id, "' is not in this secure round"));
      }
      if (secure_->phase != SecureServerRound::Masking) return too_late(id, "the masked input");
      const auto start = Clock::now();
      try {
        secure_->session->add_masked(secure_->ids.at(id), encoded.parts[0].second);
      } catch (const Error& e) {
        return refuse_locked(id, concat("Upload: ", e.what()));
      }
      secure_->sent_masked.insert(secure_->ids.at(id));
      secure_->server_s += std::chrono::duration<double>(Clock::now() - start).count();
    } else {
      why = rounds_.submit(id, dense, update.header().examples(), update.header().train_loss());
      if (!why.empty()) return refuse_locked(id, "Upload: " + why);
    }
    finished_.insert(id);
    uplink_ += bytes;
    changed_.notify_all();
    reply->set_accepted(true);
    reply->set_bytes(bytes);
    return grpc::Status::OK;
  }

  grpc::Status SecAgg(grpc::ServerContext* context, const dtrain::fl::SecAggRequest* request,
                      dtrain::fl::SecAggReply* reply) override {
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
        case SecureServerRound::StepResult::Late: return too_late(id, done.why.c_str());
        case SecureServerRound::StepResult::Malformed: return invalid(done.why);
        case SecureServerRound::StepResult::Refused:
          return refuse_locked(id, concat("SecAgg: ", done.why));
        case SecureServerRound::StepResult::Applied: break;
      }
      st.server_s += std::chrono::duration<double>(Clock::now() - start).count();
      changed_.notify_all();
    }
    // The step's reply is ready once the protocol has moved past it.
    const SecureServerRound::Phase needed = SecureServerRound::ready_at(request->step());
    const int64_t wait_ms = std::clamp<int64_t>(request->wait_ms(), 0, kMaxWaitMs);
    changed_.wait_until(lock, Clock::now() + std::chrono::milliseconds(wait_ms), [&] {
      return stopping_ || !secure_ || secure_->phase >= needed;
    });
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

  ServerResult run() {
    ServerResult result;
    result.start_round = rounds_.round();
    const int64_t min_clients = std::max<int64_t>(1, o_.min_clients);
    RoundLog log(o_.metrics_file, o_.progress, o_.rounds, result.start_round);
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
        return stopping_ || n >= o_.clients_per_round ||
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
      open_round_ = rounds_.round() + 1;
      deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(o_.round_timeout_s));
      uplink_ = downlink_ = 0;
      if (o_.secure_aggregation) start_secure(chosen);
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
      if (evaluate_ && record.outcome.applied &&
          (done % o_.eval_every == 0 || done == o_.rounds)) {
        std::tie(record.test_loss, record.test_accuracy) = evaluate_(rounds_.global());
      }
      record.seconds = std::chrono::duration<double>(Clock::now() - round_start).count();
      if (o_.dp.enabled()) {
        std::lock_guard<std::mutex> seen(mutex_);
        const double q = std::min(1.0, static_cast<double>(o_.clients_per_round) /
                                           static_cast<double>(std::max<size_t>(1, known_.size())));
        record.dp_epsilon = dp_epsilon(q, o_.dp.noise_multiplier, done, o_.dp.delta).first;
      }
      if (!checkpoint_.empty() && record.outcome.applied) rounds_.save(checkpoint_);
      log.report(record, done, min_clients);
      result.rounds.push_back(record);
    }
    // Tell every client that checked in that training is over (those still training find out
    // when they next check in), within a bounded linger.
    std::unique_lock<std::mutex> lock(mutex_);
    done_ = true;
    changed_.notify_all();
    const auto linger_end =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                           std::min(o_.round_timeout_s, 30.0)));
    changed_.wait_until(lock, linger_end, [&] {
      return std::includes(told_done_.begin(), told_done_.end(), known_.begin(), known_.end());
    });
    result.rounds_done = rounds_.round();
    result.global = rounds_.global();
    result.refused = refused_;
    result.late = late_;
    result.refusals = refusals_;
    return result;
  }

 private:
  static RoundServerOptions round_options(const ServerOptions& o) {
    RoundServerOptions r;
    r.clients_per_round = o.clients_per_round;
    r.min_clients = std::min(o.clients_per_round, std::max<int64_t>(1, o.min_clients));
    DTRAIN_CHECK_INPUT(o.min_clients <= o.clients_per_round, "--min-clients ", o.min_clients,
                       " is more than --clients-per-round ", o.clients_per_round);
    r.algorithm = o.algorithm;
    r.optimizer = o.optimizer;
    r.local = o.local;
    r.secure_aggregation = o.secure_aggregation;
    r.seed = o.seed;
    r.dp = o.dp;
    return r;
  }


  grpc::Status too_late(const std::string& id, const char* what) {
    ++late_;
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("SecAgg: client '", id, "' sent ", what, " after that step of round ",
                   open_round_, " was over")};
  }

  // The weight reference: the largest example count checked in (1 with differential
  // privacy's equal weights).
  void start_secure(const std::vector<std::string>& chosen) {
    int64_t ref = 1;
    if (!o_.dp.enabled()) {
      for (const auto& id : chosen) ref = std::max(ref, examples_[id]);
    }
    secure_ = std::make_unique<SecureServerRound>(chosen, o_.secagg_threshold, ref, numel_);
    ++secure_generation_;
  }

  // Drives the protocol's steps for the open round (the lock held, released while waiting);
  // the unmasked sum is submitted to the RoundServer, or the round aborted (nothing submitted).
  void run_secure(std::unique_lock<std::mutex>& lock, RoundRecord* record) {
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
        throw Error(concat("secure aggregation: ", st.ids.size(), " clients selected, fewer than "
                           "the threshold ", st.threshold), __FILE__, __LINE__);
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
    record->server_aggregation_s = st.server_s;
    changed_.notify_all();
  }

  grpc::Status authorize(const grpc::ServerContext& context, const std::string& id) const {
    if (o_.client_tokens.empty()) return rpc::check_token(context, o_.token);
    const auto found = o_.client_tokens.find(id);
    if (found == o_.client_tokens.end()) {
      return {grpc::StatusCode::UNAUTHENTICATED, concat("client '", id, "' is not in --client-tokens")};
    }
    return rpc::check_token(context, found->second);
  }

  grpc::Status check_open(const std::string& id, int64_t round) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (open_ && round == open_round_ && selected_.count(id) > 0) return grpc::Status::OK;
    if (open_ && round == open_round_) return refuse_locked(id, concat("Upload: client '", id,
                                                                       "' was not selected for round ", round));
    ++late_;
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("Upload: round ", round, " is not open",
                   open_ ? concat(" (round ", open_round_, " is)") : std::string())};
  }

  grpc::Status refuse(const std::string& id, const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    return refuse_locked(id, why);
  }

  // Counts and logs a refused update (the round goes on without it).
  grpc::Status refuse_locked(const std::string& id, const std::string& why) {
    ++refused_;
    const std::string line = concat("client '", id, "': ", why);
    if (refusals_.size() < kRefusalsKept) refusals_.push_back(line);
    std::fprintf(stderr, "fl server: refused an update from %s\n", line.c_str());
    return invalid(why);
  }

  const ServerOptions o_;
  const Evaluate evaluate_;
  RoundServer rounds_;
  const int64_t numel_;
  const at::ScalarType dtype_;
  std::string checkpoint_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, int> waiting_;  // client -> CheckIn calls waiting now
  std::set<std::string> known_, told_done_;
  std::map<std::string, int64_t> examples_;  // client -> examples at its last check-in
  std::unique_ptr<SecureServerRound> secure_;
  uint64_t secure_generation_ = 0;  // one per secure round attempt
  bool open_ = false, done_ = false, stopping_ = false;
  int64_t open_round_ = 0;
  std::set<std::string> selected_, finished_;
  at::Tensor round_model_;
  Clock::time_point deadline_;
  int64_t uplink_ = 0, downlink_ = 0;
  int64_t refused_ = 0, late_ = 0;
  std::vector<std::string> refusals_;
};

Server::Server(at::Tensor initial, ServerOptions options, Evaluate evaluate)
    : service_(std::make_unique<Service>(std::move(initial), std::move(options), std::move(evaluate))) {}

Server::~Server() = default;

int Server::port() const { return service_->port(); }

int64_t Server::round() const { return service_->round(); }

std::string Server::address() const {
  return rpc::local_address(service_->options().listen, port());
}

ServerResult Server::run() { return service_->run(); }

void Server::stop() { service_->stop(); }

}  // namespace dtrain::federated
