#include "dtrain/services/federated/Client.h"

#include <ATen/Parallel.h>
#include <torch/serialize.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <ctime>
#include <sstream>
#include <thread>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/Compression.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/SecureAggregation.h"
#include "dtrain/services/federated/RoundServer.h"
#include "services/federated/FlWire.h"
#include "services/federated/SecureRound.h"

namespace dtrain::federated {

namespace {

// [start, end) minutes after midnight; end <= start crosses midnight.
struct Window {
  int start = 0, end = 0;
  bool contains(int minute) const {
    return start < end ? minute >= start && minute < end : minute >= start || minute < end;
  }
};

int parse_time(const std::string& text, const std::string& whole) {
  int hours = -1, minutes = -1;
  char extra = 0;
  const int got = std::sscanf(text.c_str(), "%d:%d%c", &hours, &minutes, &extra);
  DTRAIN_CHECK_INPUT(got == 2 && text.size() == 5 && hours >= 0 && hours < 24 && minutes >= 0 &&
                         minutes < 60,
                     "--available '", whole, "': '", text, "' is not a time HH:MM (00:00 to 23:59)");
  return hours * 60 + minutes;
}

std::vector<Window> parse_windows(const std::string& text) {
  std::vector<Window> windows;
  if (text == "always") return windows;
  std::stringstream parts(text);
  std::string part;
  while (std::getline(parts, part, ',')) {
    const auto dash = part.find('-');
    DTRAIN_CHECK_INPUT(dash != std::string::npos, "--available '", text, "': '", part,
                       "' is not a window HH:MM-HH:MM");
    Window w{parse_time(part.substr(0, dash), text), parse_time(part.substr(dash + 1), text)};
    DTRAIN_CHECK_INPUT(w.start != w.end, "--available '", text, "': '", part, "' is empty");
    windows.push_back(w);
  }
  DTRAIN_CHECK_INPUT(!windows.empty(), "--available '", text,
                     "': expected always or windows like 22:00-06:00");
  return windows;
}

bool in_windows(const std::vector<Window>& windows, int minute) {
  if (windows.empty()) return true;
  return std::any_of(windows.begin(), windows.end(),
                     [&](const Window& w) { return w.contains(minute); });
}

// Unreachable, gone (restarting?) or silent past the call's deadline: worth another try
// within the retry window.
bool retryable(const grpc::Status& status) {
  return rpc::server_went_away(status) ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

std::function<bool()> parse_availability(const std::string& text) {
  const std::vector<Window> windows = parse_windows(text);
  if (windows.empty()) return nullptr;
  return [windows] {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    return in_windows(windows, local.tm_hour * 60 + local.tm_min);
  };
}

bool available_at(const std::string& text, int minute_of_day) {
  return in_windows(parse_windows(text), minute_of_day);
}

using Steady = std::chrono::steady_clock;

struct Client::State {
  ModelFactory make_model;
  data::TensorDataset train;
  std::vector<int64_t> indices;
  ClientOptions options;
  std::unique_ptr<dtrain::fl::Federated::Stub> stub;
  Model model;
  bool built = false;
  at::Tensor residual;  // top-k's error feedback

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
      rpc::add_token(context, options.token);
      const grpc::Status status = call(context);
      if (!retryable(status)) {
        if (retrying) say(concat("reached the server ", options.server, " again"));
        return status;
      }
      if (Steady::now() >= until) {
        return {grpc::StatusCode::DEADLINE_EXCEEDED,
                concat(name, ": the round's deadline passed (", status.error_message(), ")")};
      }
      DTRAIN_CHECK_T(CommError, Steady::now() < give_up,
                     "federated client '", options.client_id, "': ", name, " to the server ",
                     options.server, " failed for ", options.retry_window.count(),
                     " ms (unreachable?): ", status.error_message());
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
  rpc::RpcSecurity security;
  security.tls = state_->options.tls;
  security.tls_ca = state_->options.tls_ca;
  grpc::ChannelArguments arguments;
  rpc::tune_bulk_transfer(arguments);
  rpc::reconnect_quickly(arguments);
  arguments.SetMaxReceiveMessageSize(static_cast<int>(rpc::kMaxChunkBytes + (1 << 20)));
  state_->stub = dtrain::fl::Federated::NewStub(grpc::CreateCustomChannel(
      state_->options.server, rpc::channel_credentials(security), arguments));
}

Client::~Client() = default;

ClientReport Client::run() {
  State& s = *state_;
  const ClientOptions& o = s.options;
  ClientReport report;
  if (o.threads > 0) at::set_num_threads(o.threads);
  const auto examples = static_cast<int64_t>(s.indices.size());
  auto refused = [&](const char* call, const grpc::Status& status) {
    const bool input = status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                       status.error_code() == grpc::StatusCode::INVALID_ARGUMENT;
    const std::string text = concat("federated client '", o.client_id, "': the server ", o.server,
                                    " refused ", call, ": ", status.error_message());
    if (input) DTRAIN_THROW(InputError, text);
    DTRAIN_THROW(CommError, text);
  };
  // Downloads round `round`'s model (0: the final one, once training is over) into *global,
  // by the round's deadline `until`.
  auto download = [&](int64_t round, at::Tensor* global,
                      Steady::time_point until = Steady::time_point::max()) {
    wire::PartsReader parts({{"", global->numel()}});
    std::string problem;
    int64_t down_bytes = 0;
    const grpc::Status status = s.with_retry("Download", o.rpc_timeout, [&](grpc::ClientContext& c) {
      dtrain::fl::DownloadRequest request;
      request.set_client_id(o.client_id);
      request.set_round(round);
      parts = wire::PartsReader({{"", global->numel()}});
      problem.clear();
      down_bytes = 0;
      auto reader = s.stub->Download(&c, request);
      dtrain::fl::ModelChunk chunk;
      for (int64_t i = 0; reader->Read(&chunk); ++i) {
        down_bytes += wire::message_bytes(chunk);
        if (problem.empty()) problem = parts.add(chunk.chunk(), concat("model chunk ", i));
      }
      return reader->Finish();
    }, until);
    if (!status.ok()) return status;
    wire::Parts model_parts;
    if (problem.empty()) problem = parts.finish(&model_parts);
    DTRAIN_CHECK_T(CommError, problem.empty() && model_parts.size() == 1, "federated client '",
                   o.client_id, "': the server ", o.server, " sent a malformed model: ", problem);
    report.downlink_bytes += down_bytes;
    *global = model_parts[0].second.to(global->scalar_type());
    return status;
  };
  LocalTraining last_plan;
  // After the last round: fine-tune the final model on this client's data (personalization).
  auto personalize = [&] {
    if (o.personalize_epochs <= 0) return;
    if (!s.built) {
      std::fprintf(stderr, "federated client '%s': never selected, so it does not know the "
                   "model: no personalization\n", o.client_id.c_str());
      return;
    }
    at::Tensor final_model = flatten_parameters(s.model);
    const grpc::Status status = download(0, &final_model);
    if (!status.ok()) refused("Download of the final model", status);
    LocalTraining plan = last_plan;
    plan.epochs = o.personalize_epochs;
    if (!o.test_indices.empty()) {
      load_flat_parameters(s.model, final_model);
      report.global_accuracy = accuracy_on(s.model, s.train, o.test_indices);
    }
    fine_tune(s.model, final_model, s.train, s.indices, plan, o.personalize_layers, 1);
    if (!o.test_indices.empty()) {
      report.personalized_accuracy = accuracy_on(s.model, s.train, o.test_indices);
    }
    if (!o.save_model.empty()) torch::save(s.model.module, o.save_model);
  };
  for (;;) {
    if (o.available && !o.available()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      continue;
    }
    dtrain::fl::CheckInRequest request;
    request.set_client_id(o.client_id);
    request.set_examples(examples);
    request.set_wait_ms(o.wait.count());
    request.set_final_model(o.personalize_epochs > 0 && s.built);
    dtrain::fl::CheckInReply reply;
    grpc::Status status = s.with_retry("CheckIn", o.wait + o.rpc_timeout, [&](grpc::ClientContext& c) {
      return s.stub->CheckIn(&c, request, &reply);
    });
    if (!status.ok()) refused("CheckIn", status);
    if (reply.action() == dtrain::fl::CheckInReply::DONE) {
      report.done_reason = reply.reason();
      s.say(concat("the server says ", reply.reason()));
      personalize();
      return report;
    }
    if (reply.action() != dtrain::fl::CheckInReply::TRAIN) continue;

    // Selected: the model the server names, once.
    const int64_t round = reply.round();
    if (!s.built) {
      std::vector<int64_t> hidden(reply.hidden().begin(), reply.hidden().end());
      s.model = s.make_model(reply.model(), hidden);
      s.built = true;
    }
    at::Tensor global = flatten_parameters(s.model);
    DTRAIN_CHECK_INPUT(global.numel() == reply.parameters(), "federated client '", o.client_id,
                       "': the server's model has ", reply.parameters(),
                       " parameters, this client's ", global.numel());
    // Secure aggregation: keys and shares before training.
    const bool secure = reply.has_secagg() && reply.secagg().id() != 0;
    std::unique_ptr<secagg::ClientSession> session;
    std::vector<uint32_t> u2;
    int64_t secure_bytes = 0;
    const auto round_deadline = Steady::now() + std::chrono::milliseconds(reply.deadline_ms());
    s.say(concat("round ", round, ": selected (", reply.plan().epochs(), " epochs, batch ",
                 reply.plan().batch(), ", ", examples, " examples", secure ? ", secure" : "",
                 "; deadline in ", reply.deadline_ms() / 1000.0, " s)"));
    // The round is over for this client (it closed, was aborted, or its deadline passed before
    // `what`): back to checking in.
    auto missed = [&](const char* what, const grpc::Status& st) {
      ++report.rounds_missed;
      s.say(concat("round ", round, ": left before ", what, ": ", st.error_message()));
    };
    auto round_over = [](const grpc::Status& st) {
      return st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
             st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    };
    // One protocol step: send (once), then ask until the reply is ready or `until` (the round's
    // deadline for the steps before the upload; the reveals come after it, by the server's
    // step timeout, so those get --rpc-timeout more).
    auto step = [&](dtrain::fl::SecAggRequest request, dtrain::fl::SecAggReply* answer,
                    Steady::time_point until) {
      request.set_client_id(o.client_id);
      request.set_round(round);
      request.set_wait_ms(std::min<int64_t>(o.wait.count(), 5000));
      for (bool first = true;; first = false) {
        request.set_send(first);
        if (first) secure_bytes += wire::message_bytes(request);
        grpc::Status st = s.with_retry("SecAgg", o.rpc_timeout + o.wait, [&](grpc::ClientContext& c) {
          return s.stub->SecAgg(&c, request, answer);
        }, until);
        if (!st.ok()) return st;
        if (answer->ready()) return st;
        if (Steady::now() > until) {
          return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "SecAgg: the step's deadline passed");
        }
        if (first) {  // the payload is in: ask again without it
          request.clear_keys();
          request.clear_shares();
          request.clear_reveal();
        }
      }
    };
    if (secure) {
      const auto& setup = reply.secagg();
      session = std::make_unique<secagg::ClientSession>(setup.id(), global.numel() + 2,
                                                        setup.threshold());
      const secagg::PublicKeys mine = session->advertise();
      dtrain::fl::SecAggRequest keys;
      keys.set_step(dtrain::fl::SecAggRequest::KEYS);
      keys.mutable_keys()->set_id(mine.id);
      keys.mutable_keys()->set_c_public(mine.c_public.data(), 32);
      keys.mutable_keys()->set_s_public(mine.s_public.data(), 32);
      dtrain::fl::SecAggReply answer;
      status = step(keys, &answer, round_deadline);
      if (round_over(status)) {
        missed("its keys were taken", status);
        continue;
      }
      if (!status.ok()) refused("SecAgg", status);
      std::vector<secagg::PublicKeys> u1;
      for (const auto& k : answer.keys()) {
        DTRAIN_CHECK_T(CommError, k.c_public().size() == 32 && k.s_public().size() == 32,
                       "federated client '", o.client_id, "': malformed keys from the server");
        secagg::PublicKeys p;
        p.id = k.id();
        std::memcpy(p.c_public.data(), k.c_public().data(), 32);
        std::memcpy(p.s_public.data(), k.s_public().data(), 32);
        u1.push_back(p);
      }
      dtrain::fl::SecAggRequest shares;
      shares.set_step(dtrain::fl::SecAggRequest::SHARES);
      for (const auto& sealed : session->share_keys(u1)) {
        auto* share = shares.add_shares();
        share->set_from(sealed.from);
        share->set_to(sealed.to);
        share->set_ciphertext(sealed.ciphertext.data(), sealed.ciphertext.size());
      }
      answer.Clear();
      status = step(shares, &answer, round_deadline);
      if (round_over(status)) {
        missed("its key shares were taken", status);
        continue;
      }
      if (!status.ok()) refused("SecAgg", status);
      u2.assign(answer.shared().begin(), answer.shared().end());
      std::vector<secagg::SealedShares> inbox;
      for (const auto& share : answer.inbox()) {
        inbox.push_back({share.from(), share.to(),
                         std::vector<uint8_t>(share.ciphertext().begin(), share.ciphertext().end())});
      }
      session->receive(inbox);
    }

    // Download the round's model.
    status = download(round, &global, round_deadline);
    if (round_over(status)) {
      missed("the model was downloaded", status);
      continue;
    }
    if (!status.ok()) refused("Download", status);

    // Train as the plan says, while available.
    LocalTraining plan;
    plan.epochs = reply.plan().epochs();
    plan.batch = reply.plan().batch();
    plan.lr = reply.plan().lr();
    plan.momentum = reply.plan().momentum();
    plan.weight_decay = reply.plan().weight_decay();
    plan.prox_mu = reply.plan().prox_mu();
    validate(plan);
    last_plan = plan;
    CompressionSpec compression = parse_compression(reply.plan().compression());
    compression.error_feedback = o.error_feedback;
    ClientUpdate update = train_locally(s.model, global, s.train, s.indices, plan, reply.seed(),
                                        parallel::cross_entropy, o.available);
    if (reply.plan().clip_norm() > 0) update.delta = clip_update(update.delta, reply.plan().clip_norm());
    if (!update.completed) {
      ++report.rounds_abandoned;
      s.say(concat("round ", round, ": left (no longer available)"));
      continue;
    }
    // A diverged local training has nothing to send (the server would refuse it; under secure
    // aggregation it could not even tell, so the client must not send it).
    if (!std::isfinite(update.loss) || !all_finite(update.delta)) {
      std::fprintf(stderr, "federated client '%s': round %lld: local training diverged (loss %g); "
                   "leaving the round\n", o.client_id.c_str(), static_cast<long long>(round),
                   update.loss);
      ++report.rounds_abandoned;
      continue;
    }
    EncodedUpdate encoded;
    if (secure) {
      const auto& setup = reply.secagg();
      // With differential privacy (a clip in the plan) every client weighs 1.
      const int64_t weight = reply.plan().clip_norm() > 0 ? 1 : update.examples;
      const at::Tensor input =
          secure_input(update, weight, setup.ref(), setup.frac_bits(),
                       secagg::fixed_bound(setup.frac_bits(), static_cast<int64_t>(u2.size())));
      encoded.encoding = "secagg";
      encoded.parts.emplace_back("masked", session->masked_input(input, u2));
    } else {
      encoded = encode_update(update.delta, compression, &s.residual, reply.seed());
    }
    const auto messages = wire::update_messages(encoded, o.client_id, round, update.examples,
                                                update.loss, rpc::kDefaultChunkBytes);
    dtrain::fl::UploadReply uploaded;
    status = s.with_retry("Upload", o.rpc_timeout, [&](grpc::ClientContext& c) {
      auto writer = s.stub->Upload(&c, &uploaded);
      for (const auto& m : messages) {
        if (!writer->Write(m)) break;
      }
      writer->WritesDone();
      return writer->Finish();
    }, round_deadline);
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      missed("its update was sent", status);
      continue;
    }
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      // Too late, or refused (the server logs why); the next round is another chance.
      ++report.uploads_refused;
      s.say(concat("round ", round, ": update not taken: ", status.error_message()));
      continue;
    }
    if (!status.ok()) refused("Upload", status);
    if (secure) {
      dtrain::fl::SecAggRequest survivors;
      survivors.set_step(dtrain::fl::SecAggRequest::SURVIVORS);
      dtrain::fl::SecAggReply answer;
      const auto reveal_until = round_deadline + o.rpc_timeout;
      status = step(survivors, &answer, reveal_until);
      if (round_over(status)) {
        missed("the survivors were named", status);
        continue;
      }
      if (!status.ok()) refused("SecAgg", status);
      const secagg::Reveal reveal =
          session->reveal(std::vector<uint32_t>(answer.masked().begin(), answer.masked().end()));
      dtrain::fl::SecAggRequest shares;
      shares.set_step(dtrain::fl::SecAggRequest::REVEAL);
      for (const auto& [owner, words] : reveal.b_shares) {
        auto* r = shares.add_reveal();
        r->set_owner(owner);
        r->set_self_mask(true);
        for (uint64_t w : words) r->add_words(w);
      }
      for (const auto& [owner, words] : reveal.sk_shares) {
        auto* r = shares.add_reveal();
        r->set_owner(owner);
        r->set_self_mask(false);
        for (uint64_t w : words) r->add_words(w);
      }
      answer.Clear();
      status = step(shares, &answer, reveal_until);
      if (round_over(status)) {
        missed("its reveals were taken", status);
        continue;
      }
      if (!status.ok()) refused("SecAgg", status);
      report.uplink_bytes += secure_bytes;
    }
    report.uplink_bytes += uploaded.bytes();
    ++report.rounds_trained;
    s.say(concat("round ", round, ": update sent (", uploaded.bytes(), " bytes", secure ? ", masked" : "",
                 ")"));
    if (o.max_rounds > 0 && report.rounds_trained >= o.max_rounds) {
      report.done_reason = concat("trained ", report.rounds_trained, " rounds (--max-rounds)");
      return report;
    }
  }
}

}  // namespace dtrain::federated
