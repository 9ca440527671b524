#include "dtrain/services/federated/service/Client.h"

#include <ATen/Parallel.h>
#include <grpcpp/grpcpp.h>
#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/common/Error.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Drift.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "services/federated/secagg/SecureRound.h"
#include "services/federated/service/FlWire.h"

namespace dtrain::services::federated {

namespace {

// Unreachable, gone (restarting?) or silent past the call's deadline: worth another try
// within the retry window.
bool retryable(const grpc::Status& status) {
  return comm::rpc::server_went_away(status) ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

using Steady = std::chrono::steady_clock;

struct Client::State {
  ModelFactory make_model;
  data::TensorDataset train;
  std::vector<int64_t> indices;
  ClientOptions options;
  std::unique_ptr<dtrain::fl::Federated::Stub> stub;
  Model model;
  bool built = false;
  at::Tensor residual;          // top-k's error feedback
  LocalTraining last_plan;      // the plan of the last round trained (personalization reuses it)
  dtrain::fl::LateReport late;  // told at the next check-in (round 0: none)
  at::Tensor memory;            // drift correction's own state (SCAFFOLD's c_i, FedDyn's h_i)

  void say(const std::string& line) const {
    if (options.log) options.log(line);
  }

  // Runs `call` (fresh context, the token, deadline `timeout` but not past `until`) until it
  // succeeds or fails with a status that is not UNAVAILABLE/CANCELLED/DEADLINE_EXCEEDED. Past
  // `until` (a round's deadline) it returns DEADLINE_EXCEEDED; past the retry window it throws
  // CommError naming the call and the server.
  template <class Call>
  grpc::Status with_retry(const char* name, std::chrono::milliseconds timeout, const Call& call,
                          Steady::time_point until = Steady::time_point::max()) {
    const auto give_up = Steady::now() + options.retry_window;
    auto pause = std::chrono::milliseconds(100);
    bool retrying = false;
    for (;;) {
      const auto now = Steady::now();
      if (now >= until) {
        return {grpc::StatusCode::DEADLINE_EXCEEDED, concat(name, ": the round's deadline passed")};
      }
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           std::min<Steady::duration>(timeout, until - now));
      comm::rpc::add_token(context, options.token);
      const grpc::Status status = call(context);
      if (!retryable(status)) {
        if (retrying) say(concat("reached the server ", options.server, " again"));
        return status;
      }
      if (Steady::now() >= until) {
        return {grpc::StatusCode::DEADLINE_EXCEEDED,
                concat(name, ": the round's deadline passed (", status.error_message(), ")")};
      }
      DTRAIN_CHECK_T(CommError, Steady::now() < give_up, "federated client '", options.client_id,
                     "': ", name, " to the server ", options.server, " failed for ",
                     options.retry_window.count(), " ms (unreachable?): ", status.error_message());
      if (!retrying) {
        say(concat(name, " to the server ", options.server, " failed (", status.error_message(),
                   "); retrying for up to ", options.retry_window.count() / 1000, " s"));
        retrying = true;
      }
      std::this_thread::sleep_for(std::min<Steady::duration>(pause, until - Steady::now()));
      pause = std::min(pause * 2, std::chrono::milliseconds(2000));
    }
  }
};

Client::Client(ModelFactory make_model, data::TensorDataset train, std::vector<int64_t> indices,
               ClientOptions options)
    : state_(std::make_unique<State>()) {
  DTRAIN_CHECK_INPUT(valid_client_id(options.client_id), "--client-id '", options.client_id,
                     "' is not a client id (1 to 128 of [A-Za-z0-9._-])");
  DTRAIN_CHECK_INPUT(!indices.empty(), "federated client '", options.client_id,
                     "' has no training examples");
  DTRAIN_CHECK_INPUT(!options.server.empty(), "--server HOST:PORT is required");
  state_->make_model = std::move(make_model);
  state_->train = std::move(train);
  state_->indices = std::move(indices);
  state_->options = std::move(options);
  comm::rpc::RpcSecurity security;
  security.tls = state_->options.tls;
  security.tls_ca = state_->options.tls_ca;
  grpc::ChannelArguments arguments;
  comm::rpc::tune_bulk_transfer(arguments);
  comm::rpc::reconnect_quickly(arguments);
  arguments.SetMaxReceiveMessageSize(static_cast<int>(comm::rpc::kMaxChunkBytes + (1 << 20)));
  state_->stub = dtrain::fl::Federated::NewStub(grpc::CreateCustomChannel(
      state_->options.server, comm::rpc::channel_credentials(security), arguments));
}

Client::~Client() = default;

// One round as this client lives it, step by step.
struct ClientRound {
  dtrain::fl::CheckInReply reply;
  int64_t round = 0;
  at::Tensor global;
  bool secure = false;
  std::unique_ptr<secagg::ClientSession> session;
  std::vector<uint32_t> u2;  // the clients whose key shares were taken
  int64_t secure_bytes = 0;
  Steady::time_point deadline;
  at::Tensor control;  // SCAFFOLD's server control variate, with the model
  ClientUpdate update;
  at::Tensor control_delta;
  int within_clip = 0;  // adaptive clipping: 1 within the plan's clip, 2 above
  int64_t uploaded_bytes = 0;
};

namespace {

// The round is over for this client: it closed, was aborted, or its deadline passed.
bool round_over(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

// The steps of a round; each returns false when the client leaves the round (it goes back to
// checking in), and throws when the server refuses it for good.
class Client::Steps {
 public:
  Steps(State& state, ClientReport& report) : s_(state), o_(state.options), report_(report) {}

  // Checks in (waiting up to --wait for a round); the reply says train, wait or stop.
  dtrain::fl::CheckInReply check_in() {
    dtrain::fl::CheckInRequest request;
    request.set_client_id(o_.client_id);
    request.set_examples(static_cast<int64_t>(s_.indices.size()));
    request.set_wait_ms(o_.wait.count());
    request.set_final_model(o_.personalize_epochs > 0 && s_.built);
    if (s_.late.round() > 0) *request.mutable_late() = s_.late;
    dtrain::fl::CheckInReply reply;
    const grpc::Status status = s_.with_retry(
        "CheckIn", o_.wait + o_.rpc_timeout,
        [&](grpc::ClientContext& c) { return s_.stub->CheckIn(&c, request, &reply); });
    if (!status.ok()) refused("CheckIn", status);
    s_.late.Clear();
    return reply;
  }

  // Selected: the model the server names (built once) and the round's deadline.
  ClientRound begin(dtrain::fl::CheckInReply reply) {
    ClientRound r;
    r.reply = std::move(reply);
    r.round = r.reply.round();
    if (!s_.built) {
      std::vector<int64_t> hidden(r.reply.hidden().begin(), r.reply.hidden().end());
      s_.model = s_.make_model(r.reply.model(), hidden);
      s_.built = true;
    }
    r.global = flatten_parameters(s_.model);
    DTRAIN_CHECK_INPUT(r.global.numel() == r.reply.parameters(), "federated client '", o_.client_id,
                       "': the server's model has ", r.reply.parameters(),
                       " parameters, this client's ", r.global.numel());
    r.secure = r.reply.has_secagg() && r.reply.secagg().id() != 0;
    r.deadline = Steady::now() + std::chrono::milliseconds(r.reply.deadline_ms());
    s_.say(concat("round ", r.round, ": selected (", r.reply.plan().epochs(), " epochs, batch ",
                  r.reply.plan().batch(), ", ", s_.indices.size(), " examples",
                  r.secure ? ", secure" : "", "; deadline in ", r.reply.deadline_ms() / 1000.0,
                  " s)"));
    return r;
  }

  // Secure aggregation before training: advertise keys, then share them.
  bool exchange_keys(ClientRound& r) {
    const auto& setup = r.reply.secagg();
    r.session = std::make_unique<secagg::ClientSession>(setup.id(), r.global.numel() + 2,
                                                        setup.threshold());
    if (setup.degree() > 0) {
      // SecAgg+: the round's graph, drawn from the server's seed as the server drew it.
      std::vector<uint32_t> all(static_cast<size_t>(std::max(0, setup.clients())));
      std::iota(all.begin(), all.end(), 1u);
      std::map<uint32_t, std::vector<uint32_t>> graph;
      try {
        graph = secagg::neighbour_graph(all, setup.degree(), setup.graph_seed());
      } catch (const InputError& e) {
        s_.say(concat("round ", r.round, ": the server's SecAgg+ graph: ", e.what(), "; leaving"));
        return false;
      }
      const auto mine = graph.find(setup.id());
      if (mine == graph.end()) {
        s_.say(concat("round ", r.round, ": secure aggregation: id ", setup.id(),
                      " is not in the round's graph of ", setup.clients(), " clients; leaving"));
        return false;
      }
      r.session->set_neighbours(mine->second);
    }
    const secagg::PublicKeys mine = r.session->advertise();
    dtrain::fl::SecAggRequest keys;
    keys.set_step(dtrain::fl::SecAggRequest::KEYS);
    keys.mutable_keys()->set_id(mine.id);
    keys.mutable_keys()->set_c_public(mine.c_public.data(), 32);
    keys.mutable_keys()->set_s_public(mine.s_public.data(), 32);
    dtrain::fl::SecAggReply answer;
    if (!secagg_step(r, keys, &answer, r.deadline, "its keys were taken")) return false;
    std::vector<secagg::PublicKeys> u1;
    for (const auto& k : answer.keys()) {
      DTRAIN_CHECK_T(CommError, k.c_public().size() == 32 && k.s_public().size() == 32,
                     "federated client '", o_.client_id, "': malformed keys from the server");
      secagg::PublicKeys p;
      p.id = k.id();
      std::memcpy(p.c_public.data(), k.c_public().data(), 32);
      std::memcpy(p.s_public.data(), k.s_public().data(), 32);
      u1.push_back(p);
    }
    dtrain::fl::SecAggRequest shares;
    shares.set_step(dtrain::fl::SecAggRequest::SHARES);
    for (const auto& sealed : r.session->share_keys(u1)) {
      auto* share = shares.add_shares();
      share->set_from(sealed.from);
      share->set_to(sealed.to);
      share->set_ciphertext(sealed.ciphertext.data(), sealed.ciphertext.size());
    }
    answer.Clear();
    if (!secagg_step(r, shares, &answer, r.deadline, "its key shares were taken")) return false;
    r.u2.assign(answer.shared().begin(), answer.shared().end());
    std::vector<secagg::SealedShares> inbox;
    for (const auto& share : answer.inbox()) {
      inbox.push_back({share.from(), share.to(),
                       std::vector<uint8_t>(share.ciphertext().begin(), share.ciphertext().end())});
    }
    r.session->receive(inbox);
    return true;
  }

  // The round's model.
  bool fetch_model(ClientRound& r) {
    const grpc::Status status = download(r.round, &r.global, r.deadline, &r.control);
    if (round_over(status)) return missed(r, "the model was downloaded", status);
    if (!status.ok()) refused("Download", status);
    return true;
  }

  // Trains as the plan says, while available and until the round's deadline (checked between
  // batches); false when it left (unavailable, out of time, diverged).
  bool train(ClientRound& r) {
    const LocalTraining plan = plan_of(r.reply.plan());
    s_.last_plan = plan;
    bool late = false;
    const auto started = Steady::now();
    at::Tensor memory = s_.memory;  // kept only when the round completes
    CorrectedUpdate corrected =
        train_client(s_.model, r.global, s_.train, s_.indices, plan, r.reply.seed(), &memory,
                     r.control, parallel::cross_entropy, [&] {
                       if (o_.available && !o_.available()) return false;
                       late = Steady::now() >= r.deadline;
                       return !late;
                     });
    r.update = std::move(corrected.update);
    r.control_delta = corrected.control_delta;
    if (r.update.completed) s_.memory = memory;
    if (r.reply.plan().clip_norm() > 0 && r.update.completed) {
      r.within_clip =
          r.update.delta.to(at::kDouble).norm().item<double>() <= r.reply.plan().clip_norm() ? 1
                                                                                             : 2;
      r.update.delta = clip_update(r.update.delta, r.reply.plan().clip_norm());
    }
    if (late) {
      // Out of time: stop, say how long the plan needs here, tell the server at check-in.
      const auto trained_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(Steady::now() - started).count();
      const int64_t planned = local_steps(plan, static_cast<int64_t>(s_.indices.size()));
      s_.late.set_round(r.round);
      s_.late.set_steps_done(r.update.steps);
      s_.late.set_steps_planned(planned);
      s_.late.set_trained_ms(trained_ms);
      ++report_.rounds_missed;
      s_.say(concat(
          "round ", r.round, ": the round's deadline passed during local training, after ",
          r.update.steps, " of ", planned, " steps in ", trained_ms / 1000.0,
          " s; stopped (the plan needs ", wire::needed_seconds(r.update.steps, planned, trained_ms),
          " s here); checking in again"));
      return false;
    }
    if (!r.update.completed) {
      ++report_.rounds_abandoned;
      s_.say(concat("round ", r.round, ": left (no longer available)"));
      return false;
    }
    // A diverged local training has nothing to send (the server would refuse it; under secure
    // aggregation it could not even tell, so the client must not send it).
    if (!std::isfinite(r.update.loss) || !comm::all_finite(r.update.delta)) {
      std::fprintf(stderr,
                   "federated client '%s': round %lld: local training diverged (loss %g); "
                   "leaving the round\n",
                   o_.client_id.c_str(), static_cast<long long>(r.round), r.update.loss);
      ++report_.rounds_abandoned;
      return false;
    }
    return true;
  }

  // Encodes (compressed, or masked under secure aggregation) and uploads the update.
  bool upload(ClientRound& r) {
    comm::EncodedUpdate encoded;
    if (r.secure) {
      const auto& setup = r.reply.secagg();
      // With differential privacy (a clip in the plan) every client weighs 1.
      const int64_t weight = r.reply.plan().clip_norm() > 0 ? 1 : r.update.examples;
      const at::Tensor input =
          secure_input(r.update, weight, setup.ref(), setup.frac_bits(),
                       secagg::fixed_bound(setup.frac_bits(), static_cast<int64_t>(r.u2.size())));
      encoded.encoding = "secagg";
      encoded.parts.emplace_back("masked", r.session->masked_input(input, r.u2));
    } else {
      comm::CompressionSpec compression = comm::parse_compression(r.reply.plan().compression());
      compression.error_feedback = o_.error_feedback;
      encoded = comm::encode_update(r.update.delta, compression, &s_.residual, r.reply.seed());
      if (r.reply.plan().clip_norm() > 0) {
        // The clip bounds what the server decodes (q8's rounding, top-k's residual exceed it).
        fit_within_norm(&encoded, r.update.delta.numel(), r.update.delta.scalar_type(),
                        r.reply.plan().clip_norm(), &s_.residual);
      }
      if (r.control_delta.defined()) {
        // SCAFFOLD's control change, in the same upload, compressed like the update.
        wire::append_control(&encoded, comm::encode_update(r.control_delta, compression, nullptr,
                                                           r.reply.seed() ^ 0xC047201ULL));
      }
    }
    auto messages = wire::update_messages(encoded, o_.client_id, r.round, r.update.examples,
                                          r.update.loss, comm::rpc::kDefaultChunkBytes);
    if (!messages.empty()) messages.front().set_within_clip(r.within_clip);
    dtrain::fl::UploadReply uploaded;
    const grpc::Status status = s_.with_retry(
        "Upload", o_.rpc_timeout,
        [&](grpc::ClientContext& c) {
          auto writer = s_.stub->Upload(&c, &uploaded);
          for (const auto& m : messages) {
            if (!writer->Write(m)) break;
          }
          writer->WritesDone();
          return writer->Finish();
        },
        r.deadline);
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return missed(r, "its update was sent", status);
    }
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      // Too late, or refused (the server logs why); the next round is another chance.
      ++report_.uploads_refused;
      s_.say(concat("round ", r.round, ": update not taken: ", status.error_message()));
      return false;
    }
    if (!status.ok()) refused("Upload", status);
    r.uploaded_bytes = uploaded.bytes();
    return true;
  }

  // Secure aggregation after the upload: learn who survived, reveal their shares.
  bool reveal(ClientRound& r) {
    dtrain::fl::SecAggRequest survivors;
    survivors.set_step(dtrain::fl::SecAggRequest::SURVIVORS);
    dtrain::fl::SecAggReply answer;
    // The reveals come after the round's deadline, by the server's step timeout.
    const auto reveal_until = r.deadline + o_.rpc_timeout;
    if (!secagg_step(r, survivors, &answer, reveal_until, "the survivors were named")) {
      return false;
    }
    const secagg::Reveal reveal =
        r.session->reveal(std::vector<uint32_t>(answer.masked().begin(), answer.masked().end()));
    dtrain::fl::SecAggRequest shares;
    shares.set_step(dtrain::fl::SecAggRequest::REVEAL);
    for (const auto& [owner, words] : reveal.b_shares) {
      auto* item = shares.add_reveal();
      item->set_owner(owner);
      item->set_self_mask(true);
      for (uint64_t w : words) item->add_words(w);
    }
    for (const auto& [owner, words] : reveal.sk_shares) {
      auto* item = shares.add_reveal();
      item->set_owner(owner);
      item->set_self_mask(false);
      for (uint64_t w : words) item->add_words(w);
    }
    answer.Clear();
    return secagg_step(r, shares, &answer, reveal_until, "its reveals were taken");
  }

  void finish(const ClientRound& r) {
    if (r.secure) report_.uplink_bytes += r.secure_bytes;
    report_.uplink_bytes += r.uploaded_bytes;
    ++report_.rounds_trained;
    s_.say(concat("round ", r.round, ": update sent (", r.uploaded_bytes, " bytes",
                  r.secure ? ", masked" : "", ")"));
  }

  // After the last round: fine-tune the final model on this client's data (personalization).
  void personalize() {
    if (o_.personalize_epochs <= 0) return;
    if (!s_.built) {
      std::fprintf(stderr,
                   "federated client '%s': never selected, so it does not know the model: no "
                   "personalization\n",
                   o_.client_id.c_str());
      return;
    }
    at::Tensor final_model = flatten_parameters(s_.model);
    const grpc::Status status = download(0, &final_model);
    if (!status.ok()) refused("Download of the final model", status);
    LocalTraining plan = s_.last_plan;
    plan.epochs = o_.personalize_epochs;
    if (!o_.test_indices.empty()) {
      load_flat_parameters(s_.model, final_model);
      report_.global_accuracy = accuracy_on(s_.model, s_.train, o_.test_indices);
    }
    fine_tune(s_.model, final_model, s_.train, s_.indices, plan, o_.personalize_layers, 1);
    if (!o_.test_indices.empty()) {
      report_.personalized_accuracy = accuracy_on(s_.model, s_.train, o_.test_indices);
    }
    if (!o_.save_model.empty()) torch::save(s_.model.module, o_.save_model);
  }

 private:
  [[noreturn]] void refused(const char* call, const grpc::Status& status) const {
    const bool input = status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                       status.error_code() == grpc::StatusCode::INVALID_ARGUMENT;
    const std::string text = concat("federated client '", o_.client_id, "': the server ", o_.server,
                                    " refused ", call, ": ", status.error_message());
    if (input) DTRAIN_THROW(InputError, text);
    DTRAIN_THROW(CommError, text);
  }

  // Counts a round this client left before `what` (false, for the step to return).
  bool missed(const ClientRound& r, const char* what, const grpc::Status& status) {
    ++report_.rounds_missed;
    s_.say(concat("round ", r.round, ": left before ", what, ": ", status.error_message()));
    return false;
  }

  static LocalTraining plan_of(const dtrain::fl::TrainingPlan& wire) {
    LocalTraining plan;
    plan.epochs = wire.epochs();
    plan.batch = wire.batch();
    plan.lr = wire.lr();
    plan.momentum = wire.momentum();
    plan.weight_decay = wire.weight_decay();
    plan.prox_mu = wire.prox_mu();
    if (!wire.correction().empty()) plan.correction = wire.correction();
    if (wire.scaffold_option() != 0) plan.scaffold_option = wire.scaffold_option();
    validate(plan);
    return plan;
  }

  // Downloads round `round`'s model (0: the final one, once training is over) into *global,
  // by the round's deadline `until`.
  // With SCAFFOLD the model comes with the server's control variate (into *control).
  grpc::Status download(int64_t round, at::Tensor* global,
                        Steady::time_point until = Steady::time_point::max(),
                        at::Tensor* control = nullptr) {
    const std::map<std::string, int64_t> limits{{"", global->numel()},
                                                {"control", global->numel()}};
    wire::PartsReader parts(limits);
    std::string problem;
    int64_t down_bytes = 0;
    const grpc::Status status = s_.with_retry(
        "Download", o_.rpc_timeout,
        [&](grpc::ClientContext& c) {
          dtrain::fl::DownloadRequest request;
          request.set_client_id(o_.client_id);
          request.set_round(round);
          parts = wire::PartsReader(limits);
          problem.clear();
          down_bytes = 0;
          auto reader = s_.stub->Download(&c, request);
          dtrain::fl::ModelChunk chunk;
          for (int64_t i = 0; reader->Read(&chunk); ++i) {
            down_bytes += wire::message_bytes(chunk);
            if (problem.empty()) problem = parts.add(chunk.chunk(), concat("model chunk ", i));
          }
          return reader->Finish();
        },
        until);
    if (!status.ok()) return status;
    wire::Parts model_parts;
    if (problem.empty()) problem = parts.finish(&model_parts);
    at::Tensor model;
    if (control != nullptr) *control = at::Tensor();
    for (const auto& [name, tensor] : model_parts) {
      if (name.empty()) model = tensor;
      if (name == "control" && control != nullptr) *control = tensor.to(global->scalar_type());
    }
    DTRAIN_CHECK_T(CommError, problem.empty() && model.defined(), "federated client '",
                   o_.client_id, "': the server ", o_.server,
                   " sent a malformed model: ", problem.empty() ? "no model part" : problem);
    report_.downlink_bytes += down_bytes;
    *global = model.to(global->scalar_type());
    return status;
  }

  // One protocol step: send (once), then ask until the reply is ready or `until`. False (the
  // round missed) when the round is over before `what`.
  bool secagg_step(ClientRound& r, dtrain::fl::SecAggRequest request,
                   dtrain::fl::SecAggReply* answer, Steady::time_point until, const char* what) {
    request.set_client_id(o_.client_id);
    request.set_round(r.round);
    request.set_wait_ms(std::min<int64_t>(o_.wait.count(), 5000));
    grpc::Status status;
    for (bool first = true;; first = false) {
      request.set_send(first);
      if (first) r.secure_bytes += wire::message_bytes(request);
      status = s_.with_retry(
          "SecAgg", o_.rpc_timeout + o_.wait,
          [&](grpc::ClientContext& c) { return s_.stub->SecAgg(&c, request, answer); }, until);
      if (!status.ok() || answer->ready()) break;
      if (Steady::now() > until) {
        status =
            grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "SecAgg: the step's deadline passed");
        break;
      }
      if (first) {  // the payload is in: ask again without it
        request.clear_keys();
        request.clear_shares();
        request.clear_reveal();
      }
    }
    if (round_over(status)) return missed(r, what, status);
    if (!status.ok()) refused("SecAgg", status);
    return true;
  }

  State& s_;
  const ClientOptions& o_;
  ClientReport& report_;
};

ClientReport Client::run() {
  const ClientOptions& o = state_->options;
  ClientReport report;
  if (o.threads > 0) at::set_num_threads(o.threads);
  Steps steps(*state_, report);
  for (;;) {
    if (o.available && !o.available()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      continue;
    }
    dtrain::fl::CheckInReply reply = steps.check_in();
    if (reply.action() == dtrain::fl::CheckInReply::DONE) {
      report.done_reason = reply.reason();
      state_->say(concat("the server says ", reply.reason()));
      steps.personalize();
      return report;
    }
    if (reply.action() != dtrain::fl::CheckInReply::TRAIN) continue;
    ClientRound round = steps.begin(std::move(reply));
    if (round.secure && !steps.exchange_keys(round)) continue;
    if (!steps.fetch_model(round) || !steps.train(round) || !steps.upload(round)) continue;
    if (round.secure && !steps.reveal(round)) continue;
    steps.finish(round);
    if (o.max_rounds > 0 && report.rounds_trained >= o.max_rounds) {
      report.done_reason = concat("trained ", report.rounds_trained, " rounds (--max-rounds)");
      return report;
    }
  }
}

}  // namespace dtrain::services::federated
