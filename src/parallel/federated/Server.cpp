#include "dtrain/parallel/federated/Server.h"

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
#include "parallel/federated/FlWire.h"
#include "parallel/federated/RoundLog.h"

namespace dtrain::federated {

using Clock = std::chrono::steady_clock;

bool valid_client_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

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
    DTRAIN_CHECK_INPUT(o_.token.empty() || o_.client_tokens.empty(),
                       "give either --auth-token-file or --client-tokens, not both");
    if (!o_.checkpoint_dir.empty()) {
      checkpoint_ = o_.checkpoint_dir + "/server.pt";
      if (std::filesystem::exists(checkpoint_)) rounds_.load(checkpoint_);
    }
    rpc::RpcSecurity security;
    security.tls_cert = o_.tls_cert;
    security.tls_key = o_.tls_key;
    grpc::ServerBuilder builder;
    builder.AddListeningPort(o_.listen, rpc::server_credentials(security), &port_);
    builder.SetMaxReceiveMessageSize(static_cast<int>(rpc::kMaxChunkBytes + (1 << 20)));
    rpc::tune_bulk_transfer(builder);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    DTRAIN_CHECK_INPUT(server_ && port_ > 0, "the federated server cannot listen on ", o_.listen,
                       " (address in use or not this machine's?)");
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
      plan->set_epochs(o_.local.epochs);
      plan->set_batch(o_.local.batch);
      plan->set_lr(o_.local.lr);
      plan->set_momentum(o_.local.momentum);
      plan->set_weight_decay(o_.local.weight_decay);
      plan->set_prox_mu(o_.local.prox_mu);
      plan->set_clip_norm(o_.dp.clip);
      plan->set_compression(o_.compression.kind == CompressionSpec::TopK
                                ? concat("topk:", o_.compression.fraction)
                                : to_string(o_.compression));
      reply->set_parameters(numel_);
      reply->set_model(o_.model);
      for (int64_t h : o_.hidden) reply->add_hidden(h);
      reply->set_seed(id_hash(id) ^ (static_cast<uint64_t>(open_round_) * 0x9E3779B97F4A7C15ULL) ^
                      o_.seed);
    } else if (done_) {
      reply->set_action(dtrain::fl::CheckInReply::DONE);
      reply->set_reason(stopping_ ? "the server stopped" : "the last round is over");
      told_done_.insert(id);
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
      if (!open_ || selected_.count(id) == 0 || request->round() != open_round_) {
        return {grpc::StatusCode::FAILED_PRECONDITION,
                concat("Download: client '", id, "' is not selected for round ", request->round(),
                       open_ ? concat(" (round ", open_round_, " is open)") : " (no round is open)")};
      }
      model = round_model_;
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
    if (why.empty()) why = decode_update(encoded, numel_, dtype_, &dense);
    if (!why.empty()) return refuse(id, "Upload: " + why);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_ || open_round_ != update.header().round()) {
      ++late_;
      return {grpc::StatusCode::FAILED_PRECONDITION,
              concat("Upload: round ", update.header().round(), " closed before the update arrived")};
    }
    why = rounds_.submit(id, dense, update.header().examples(), update.header().train_loss());
    if (!why.empty()) return refuse_locked(id, "Upload: " + why);
    finished_.insert(id);
    uplink_ += bytes;
    changed_.notify_all();
    reply->set_accepted(true);
    reply->set_bytes(bytes);
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
      open_ = true;
      changed_.notify_all();
      changed_.wait_until(lock, deadline_,
                          [&] { return stopping_ || finished_.size() == selected_.size(); });
      open_ = false;
      selected_.clear();
      RoundRecord record;
      record.uplink_bytes = uplink_;
      record.downlink_bytes = downlink_;
      lock.unlock();
      record.outcome = rounds_.close();
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
    r.optimizer = o.optimizer;
    r.seed = o.seed;
    r.dp = o.dp;
    return r;
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
  const std::string& listen = service_->options().listen;
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = "127.0.0.1";
  return concat(host, ":", port());
}

ServerResult Server::run() { return service_->run(); }

void Server::stop() { service_->stop(); }

}  // namespace dtrain::federated
