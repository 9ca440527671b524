// The federated server's gRPC handlers: clients check in (and are told to train, wait or
// stop), download the round's model and upload their updates; every field is checked before
// it touches the round, and a refusal is counted and named. Also who may call (tokens), and
// the Server facade.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "services/federated/service/FlWire.h"
#include "services/federated/service/ServerService.h"

namespace dtrain::services::federated {

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

}  // namespace

Server::Service::Service(at::Tensor initial, ServerOptions options, Evaluate evaluate)
    : o_(std::move(options)),
      evaluate_(std::move(evaluate)),
      rounds_(initial, o_.round),
      numel_(initial.numel()),
      dtype_(initial.scalar_type()) {
  validate(o_.round.local);
  DTRAIN_CHECK_INPUT(o_.rounds >= 1, "--rounds must be >= 1, got ", o_.rounds);
  DTRAIN_CHECK_INPUT(o_.round_timeout_s > 0 && o_.selection_timeout_s >= 0 && o_.wait_timeout_s > 0,
                     "--round-timeout and --wait-timeout must be > 0, --selection-timeout >= 0");
  DTRAIN_CHECK_INPUT(o_.eval_every >= 1, "--eval-every must be >= 1, got ", o_.eval_every);
  DTRAIN_CHECK_INPUT(
      !o_.round.secure_aggregation || o_.compression.kind == comm::CompressionSpec::None,
      "--secure-aggregation sends masked 32-bit words, which do not compress: it "
      "cannot be combined with --compression");
  DTRAIN_CHECK_INPUT(!o_.round.secure_aggregation || o_.round.clients_per_round >= 2,
                     "--secure-aggregation needs --clients-per-round >= 2");
  DTRAIN_CHECK_INPUT(
      o_.secagg_threshold >= 0 && o_.secagg_threshold <= 1 && o_.secagg_step_timeout_s > 0,
      "--secagg-threshold must be in [0, 1] and --secagg-step-timeout > 0");
  DTRAIN_CHECK_INPUT(o_.secagg_dropout >= 0 && o_.secagg_dropout < 1,
                     "--secagg-dropout must be a fraction in [0, 1), got ", o_.secagg_dropout);
  if (o_.round.secure_aggregation &&
      (o_.secagg_graph > 0 || o_.secagg_graph == secagg::kAutoGraph)) {
    secagg::round_degree(o_.secagg_graph, o_.round.clients_per_round, o_.secagg_threshold,
                         o_.secagg_dropout);
    if (o_.secagg_graph == secagg::kAutoGraph) {
      secagg::check_auto_graph(o_.round.clients_per_round, o_.secagg_threshold, o_.secagg_dropout);
    }
    if (o_.secagg_graph == secagg::kAutoGraph) {
      std::fprintf(stderr, "fl server: %s\n",
                   secagg::describe_auto_degree(o_.round.clients_per_round, o_.secagg_threshold,
                                                o_.secagg_dropout)
                       .c_str());
    }
  }
  DTRAIN_CHECK_INPUT(o_.token.empty() || o_.client_tokens.empty(),
                     "give either --auth-token-file or --client-tokens, not both");
  if (!o_.checkpoint_dir.empty()) {
    checkpoint_ = o_.checkpoint_dir + "/server.pt";
    if (std::filesystem::exists(checkpoint_)) rounds_.load(checkpoint_);
  }
  // A resumed buffered server: the clients training when it was saved may still upload (with
  // their staleness), each within a new --round-timeout.
  for (const auto& [id, step] : rounds_.training_steps()) {
    flights_[id] = {step, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(o_.round_timeout_s))};
  }
  server_ = comm::rpc::start_server("the federated server", o_.listen, o_.tls_cert, o_.tls_key,
                                    this, true, &port_);
}

Server::Service::~Service() {
  stop();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void Server::Service::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  stopping_ = true;
  changed_.notify_all();
}

grpc::Status Server::Service::CheckIn(grpc::ServerContext* context,
                                      const dtrain::fl::CheckInRequest* request,
                                      dtrain::fl::CheckInReply* reply) {
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
  if (const auto& late = request->late(); late.round() > 0 && late.steps_planned() > 0) {
    // Its last round's deadline passed during local training: say what the plan needs.
    const int64_t done = std::clamp<int64_t>(late.steps_done(), 0, late.steps_planned());
    const int64_t ms = std::max<int64_t>(0, late.trained_ms());
    const std::string line =
        concat("round ", late.round(), ": client '", id, "' ran out of time after ", done, " of ",
               late.steps_planned(), " local steps in ", static_cast<double>(ms) / 1000.0,
               " s; the plan needs ", wire::needed_seconds(done, late.steps_planned(), ms),
               " s there, --round-timeout is ", o_.round_timeout_s,
               " s: raise it, or shrink the plan (--local-epochs, more --local-batch, fewer "
               "examples)");
    std::fprintf(stderr, "fl server: %s\n", line.c_str());
    if (out_of_time_.size() < kRefusalsKept) out_of_time_.push_back(line);
    const double needed = done > 0 ? static_cast<double>(ms) / 1000.0 *
                                         static_cast<double>(late.steps_planned()) /
                                         static_cast<double>(done)
                                   : static_cast<double>(ms) / 1000.0;
    double& most = needed_s_[late.round()];
    most = std::max(most, needed);
  }
  examples_[id] = request->examples();
  if (rounds_.buffered()) {
    check_in_buffered(id, wait_ms, lock, reply);
    return grpc::Status::OK;
  }
  auto selected_now = [&] { return open_ && selected_.count(id) > 0 && finished_.count(id) == 0; };
  if (!selected_now() && !done_) {
    ++waiting_[id];
    changed_.notify_all();
    changed_.wait_until(lock, Clock::now() + std::chrono::milliseconds(wait_ms),
                        [&] { return selected_now() || done_ || stopping_; });
    if (--waiting_[id] == 0) waiting_.erase(id);
  }
  if (selected_now()) {
    fill_train(id, open_round_, deadline_, reply);
    if (secure_) {
      auto* setup = reply->mutable_secagg();
      setup->set_id(secure_->ids.at(id));
      setup->set_threshold(secure_->threshold);
      setup->set_frac_bits(o_.secagg_frac_bits);
      setup->set_ref(secure_->ref);
      setup->set_degree(secure_->degree);
      setup->set_graph_seed(secure_->graph_seed);
      setup->set_clients(static_cast<int32_t>(secure_->ids.size()));
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

void Server::Service::fill_train(const std::string& id, int64_t round, Clock::time_point deadline,
                                 dtrain::fl::CheckInReply* reply) {
  reply->set_action(dtrain::fl::CheckInReply::TRAIN);
  reply->set_round(round);
  reply->set_deadline_ms(std::max<int64_t>(
      0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  auto* plan = reply->mutable_plan();
  const LocalTraining local = rounds_.plan();  // the aggregator's, for the open round
  plan->set_epochs(local.epochs);
  plan->set_batch(local.batch);
  plan->set_lr(local.lr);
  plan->set_momentum(local.momentum);
  plan->set_weight_decay(local.weight_decay);
  plan->set_prox_mu(local.prox_mu);
  plan->set_correction(local.correction);
  plan->set_scaffold_option(local.scaffold_option);
  plan->set_clip_norm(rounds_.dp_clip());
  plan->set_compression(o_.compression.kind == comm::CompressionSpec::TopK
                            ? concat("topk:", o_.compression.fraction)
                            : to_string(o_.compression));
  reply->set_parameters(numel_);
  reply->set_model(o_.model);
  for (int64_t h : o_.hidden) reply->add_hidden(h);
  reply->set_seed(id_hash(id) ^ (static_cast<uint64_t>(round) * 0x9E3779B97F4A7C15ULL) ^
                  o_.round.seed);
}

grpc::Status Server::Service::Download(grpc::ServerContext* context,
                                       const dtrain::fl::DownloadRequest* request,
                                       grpc::ServerWriter<dtrain::fl::ModelChunk>* writer) {
  const std::string& id = request->client_id();
  if (!valid_client_id(id)) {
    return invalid("Download: field 'client_id' must be 1 to 128 of [A-Za-z0-9._-]");
  }
  if (grpc::Status s = authorize(*context, id); !s.ok()) return s;
  at::Tensor model, control;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Round 0 once training is over: the final model (for personalization).
    if (done_ && request->round() == 0) {
      model = rounds_.global();
    } else if (rounds_.buffered()) {
      // The model version it started training from.
      const auto flight = flights_.find(id);
      const auto version =
          flight == flights_.end() ? versions_.end() : versions_.find(flight->second.version);
      if (version == versions_.end() || request->round() != flight->second.version + 1) {
        return {grpc::StatusCode::FAILED_PRECONDITION,
                concat("Download: client '", id, "' is not training from step ",
                       request->round() - 1, " (its time ran out, or the server restarted)")};
      }
      model = version->second;
    } else if (!open_ || selected_.count(id) == 0 || request->round() != open_round_) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              concat("Download: client '", id, "' is not selected for round ", request->round(),
                     open_ ? concat(" (round ", open_round_, " is open)") : " (no round is open)")};
    } else {
      model = round_model_;
      control = round_control_;
    }
  }
  wire::Parts parts{{"", model}};
  if (control.defined()) parts.emplace_back("control", control);
  int64_t bytes = 0;
  bool open = true;
  wire::for_each_chunk(parts, comm::rpc::kDefaultChunkBytes, [&](comm::rpc::TensorChunk&& chunk) {
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

grpc::Status Server::Service::Upload(grpc::ServerContext* context,
                                     grpc::ServerReader<dtrain::fl::UpdateChunk>* reader,
                                     dtrain::fl::UploadReply* reply) {
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
  comm::EncodedUpdate encoded;
  at::Tensor dense, control;
  std::string why = update.finish(&encoded);
  const comm::EncodedUpdate control_encoded = wire::split_control(&encoded);
  const bool masked = encoded.encoding == "secagg";
  if (why.empty() && !masked) why = comm::decode_update(encoded, numel_, dtype_, &dense);
  if (why.empty() && !control_encoded.parts.empty()) {
    why = comm::decode_update(control_encoded, numel_, dtype_, &control);
    if (!why.empty()) why = "its control-variate change: " + why;
  }
  if (why.empty() && masked &&
      (encoded.parts.size() != 1 || encoded.parts[0].first != "masked" ||
       encoded.parts[0].second.scalar_type() != at::kInt ||
       encoded.parts[0].second.numel() != numel_ + 2)) {
    why = concat("a secagg update must be one int32 part 'masked' of ", numel_ + 2, " elements");
  }
  if (!why.empty()) return refuse(id, "Upload: " + why);
  std::unique_lock<std::mutex> lock(mutex_);
  if (rounds_.buffered()) {
    // A full buffer is applied first (the step loop wakes on it): this update goes into the
    // next one, K updates a step.
    changed_.wait(lock, [&] { return stopping_ || done_ || !rounds_.buffer_full(); });
    const auto flight = flights_.find(id);
    if (flight == flights_.end() || flight->second.version + 1 != update.header().round()) {
      ++late_;
      return {grpc::StatusCode::FAILED_PRECONDITION,
              concat("Upload: client '", id, "''s time ran out before its update arrived")};
    }
    if (masked) return refuse_locked(id, "Upload: buffered aggregation takes no secagg updates");
    const int within = update.header().within_clip() == 1   ? 1
                       : update.header().within_clip() == 2 ? 0
                                                            : -1;
    why = rounds_.submit(id, dense, update.header().examples(), update.header().train_loss(),
                         control, within);
    if (!why.empty()) rounds_.leave(id);  // refused: it is not training any more
    end_flight(id);
    if (!why.empty()) return refuse_locked(id, "Upload: " + why);
    uplink_ += bytes;
    changed_.notify_all();
    reply->set_accepted(true);
    reply->set_bytes(bytes);
    return grpc::Status::OK;
  }
  if (!open_ || open_round_ != update.header().round()) {
    ++late_;
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("Upload: round ", update.header().round(), " closed before the update arrived")};
  }
  if (masked != static_cast<bool>(secure_)) {
    return refuse_locked(id, secure_
                                 ? "Upload: this round uses secure aggregation (encoding secagg)"
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
    const int within = update.header().within_clip() == 1   ? 1
                       : update.header().within_clip() == 2 ? 0
                                                            : -1;
    why = rounds_.submit(id, dense, update.header().examples(), update.header().train_loss(),
                         control, within);
    if (!why.empty()) return refuse_locked(id, "Upload: " + why);
  }
  finished_.insert(id);
  uplink_ += bytes;
  changed_.notify_all();
  reply->set_accepted(true);
  reply->set_bytes(bytes);
  return grpc::Status::OK;
}

grpc::Status Server::Service::authorize(const grpc::ServerContext& context,
                                        const std::string& id) const {
  if (o_.client_tokens.empty()) return comm::rpc::check_token(context, o_.token);
  const auto found = o_.client_tokens.find(id);
  if (found == o_.client_tokens.end()) {
    return {grpc::StatusCode::UNAUTHENTICATED,
            concat("client '", id, "' is not in --client-tokens")};
  }
  return comm::rpc::check_token(context, found->second);
}

grpc::Status Server::Service::check_open(const std::string& id, int64_t round) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (rounds_.buffered()) {
    const auto flight = flights_.find(id);
    if (flight != flights_.end() && flight->second.version + 1 == round) return grpc::Status::OK;
    ++late_;
    return {grpc::StatusCode::FAILED_PRECONDITION,
            concat("Upload: client '", id, "' is not training from step ", round - 1,
                   " (its --round-timeout ran out)")};
  }
  if (open_ && round == open_round_ && selected_.count(id) > 0) return grpc::Status::OK;
  if (open_ && round == open_round_)
    return refuse_locked(id,
                         concat("Upload: client '", id, "' was not selected for round ", round));
  ++late_;
  return {grpc::StatusCode::FAILED_PRECONDITION,
          concat("Upload: round ", round, " is not open",
                 open_ ? concat(" (round ", open_round_, " is)") : std::string())};
}

grpc::Status Server::Service::refuse(const std::string& id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  return refuse_locked(id, why);
}

// Counts and logs a refused update (the round goes on without it).
grpc::Status Server::Service::refuse_locked(const std::string& id, const std::string& why) {
  ++refused_;
  const std::string line = concat("client '", id, "': ", why);
  if (refusals_.size() < kRefusalsKept) refusals_.push_back(line);
  std::fprintf(stderr, "fl server: refused an update from %s\n", line.c_str());
  return invalid(why);
}

Server::Server(at::Tensor initial, ServerOptions options, Evaluate evaluate)
    : service_(
          std::make_unique<Service>(std::move(initial), std::move(options), std::move(evaluate))) {}

Server::~Server() = default;

int Server::port() const { return service_->port(); }

int64_t Server::round() const { return service_->round(); }

std::string Server::address() const {
  return comm::rpc::local_address(service_->options().listen, port());
}

ServerResult Server::run() { return service_->run(); }

void Server::stop() { service_->stop(); }

}  // namespace dtrain::services::federated
