#include "dtrain/parallel/ps/PsClient.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <functional>
#include <thread>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/ps/ShardProtocol.h"
#include "dtrain/ps.grpc.pb.h"
#include "parallel/ps/PsWire.h"

namespace dtrain::parallel::ps {

struct PsClient::Shard {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<dtrain::ps::ParameterServer::Stub> stub;
  // The streaming methods, whose payloads travel beside protobuf (comm::rpc::Bulk).
  std::unique_ptr<grpc::internal::RpcMethod> initialize, pull, push;

  using Writer = grpc::ClientWriter<comm::rpc::Bulk<dtrain::ps::PushChunk>>;
  std::unique_ptr<Writer> writer(const grpc::internal::RpcMethod& method,
                                 grpc::ClientContext& context, dtrain::ps::PushReply* reply) {
    return std::unique_ptr<Writer>(
        grpc::internal::ClientWriterFactory<comm::rpc::Bulk<dtrain::ps::PushChunk>>::Create(
            channel.get(), method, &context, reply));
  }
  dtrain::ps::ShardInfo info;
  uint64_t incarnation = 0;  // of the shard as first described
  // Newest version seen from this incarnation of the shard: every version this worker computed
  // on since the restart was seen, so a newer one is from before it (lost).
  int64_t seen_version = 0;
};

namespace {

void set_deadline(grpc::ClientContext& context, std::chrono::milliseconds timeout) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
}

// The shard cannot be reached or went away: it may be restarting.
bool retryable(const grpc::Status& status) { return comm::rpc::server_went_away(status); }

[[noreturn]] void fail(const std::string& rpc_name, const std::string& address,
                       const grpc::Status& status, std::chrono::milliseconds timeout) {
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    DTRAIN_THROW(TimeoutError, "parameter server ", address, ": ", rpc_name,
                 " got no answer within ", timeout.count(), " ms");
  }
  if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
    DTRAIN_THROW(InputError, "parameter server ", address, " refused ", rpc_name, ": ",
                 status.error_message());
  }
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    DTRAIN_THROW(InputError, "parameter server ", address, " refused ", rpc_name,
                 " as unauthenticated: ", status.error_message(),
                 " (give the shards' token with --ps-auth-token-file)");
  }
  DTRAIN_THROW(CommError, "parameter server ", address, ": ", rpc_name, " failed (",
               status.error_code(), "): ", status.error_message());
}

// Streams `values` (elements from `begin` of the flat vector, kept alive by `owner`) as
// PushChunks whose payloads point into it, `fill` setting each message's other fields;
// returns the call's status.
template <typename Fill>
grpc::Status send_chunks(grpc::ClientWriter<comm::rpc::Bulk<dtrain::ps::PushChunk>>& writer,
                         const at::Tensor& values, int64_t begin, int64_t chunk_bytes,
                         const std::shared_ptr<const void>& owner, const Fill& fill) {
  comm::rpc::for_each_bulk<dtrain::ps::PushChunk>(
      values, begin, chunk_bytes, owner, fill,
      [&](const comm::rpc::Bulk<dtrain::ps::PushChunk>& message) { return writer.Write(message); });
  writer.WritesDone();
  return writer.Finish();
}

// Runs f(i) for every shard on its own thread; rethrows the first failure.
void for_each_shard(int n, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        f(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace

PsClient::PsClient(std::vector<std::string> addresses, PsClientOptions options)
    : addresses_(std::move(addresses)), options_(options) {
  DTRAIN_CHECK_INPUT(!addresses_.empty(), "no parameter-server shards given (--ps HOST:PORT,...)");
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(static_cast<int>(comm::rpc::kMaxChunkBytes + (1 << 20)));
  comm::rpc::reconnect_quickly(arguments);  // a restarted shard is found again within a second
  comm::rpc::tune_bulk_transfer(arguments);
  comm::rpc::RpcSecurity security;
  security.tls = options_.tls;
  security.tls_ca = options_.tls_ca;
  const auto credentials = comm::rpc::channel_credentials(security);
  for (const auto& address : addresses_) {
    auto shard = std::make_unique<Shard>();
    shard->address = address;
    shard->channel = grpc::CreateCustomChannel(address, credentials, arguments);
    shard->stub = dtrain::ps::ParameterServer::NewStub(shard->channel);
    using grpc::internal::RpcMethod;
    shard->initialize = std::make_unique<RpcMethod>(kPsMethodName[kInitialize],
                                                    RpcMethod::CLIENT_STREAMING, shard->channel);
    shard->pull = std::make_unique<RpcMethod>(kPsMethodName[kPull], RpcMethod::SERVER_STREAMING,
                                              shard->channel);
    shard->push = std::make_unique<RpcMethod>(kPsMethodName[kPush], RpcMethod::CLIENT_STREAMING,
                                              shard->channel);
    shards_.push_back(std::move(shard));
  }
  describe_all();
  for (auto& s : shards_) {
    s->incarnation = s->info.incarnation();
    s->seen_version = s->info.version();
  }
}

int64_t PsClient::lost_updates() const {
  std::lock_guard<std::mutex> lock(restart_mutex_);
  return lost_updates_;
}

void PsClient::with_retry(int i, const char* rpc_name, const Call& call) {
  Shard& s = *shards_[i];
  const auto give_up = std::chrono::steady_clock::now() + options_.retry_window;
  auto pause = std::chrono::milliseconds(50);
  grpc::Status status;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(2000));
      // Back: did it restart? (A failed look is another retry.)
      grpc::ClientContext context;
      set_deadline(context, options_.rpc_timeout);
      comm::rpc::add_token(context, options_.auth_token);
      dtrain::ps::ShardInfo info;
      const grpc::Status look = s.stub->Describe(&context, {}, &info);
      if (!look.ok()) {
        if (retryable(look) && std::chrono::steady_clock::now() < give_up) continue;
        status = look;
        rpc_name = "Describe";
        break;
      }
      s.info = info;
      check_restart(s);
    }
    grpc::ClientContext context;
    set_deadline(context, options_.rpc_timeout);
    comm::rpc::add_token(context, options_.auth_token);
    status = call(s, context);
    if (status.ok()) return;
    if (!retryable(status) || std::chrono::steady_clock::now() >= give_up) break;
  }
  if (retryable(status)) {
    DTRAIN_THROW(CommError, "parameter server ", s.address, ": ", rpc_name,
                 " failed: unreachable for ", options_.retry_window.count(), " ms (",
                 status.error_message(), ")");
  }
  fail(rpc_name, s.address, status, options_.rpc_timeout);
}

void PsClient::check_restart(Shard& s) {
  if (s.info.incarnation() == s.incarnation) return;
  s.incarnation = s.info.incarnation();
  DTRAIN_CHECK_T(CommError, s.info.initialized(), "parameter server ", s.address,
                 " restarted without a checkpoint: its parameters are gone (start the shards "
                 "with --checkpoint-dir to survive restarts)");
  ShardRestart restart;
  restart.address = s.address;
  restart.shard = s.info.shard();
  restart.resumed_version = s.info.resumed_version();
  restart.seen_version = s.seen_version;
  restart.lost = std::max<int64_t>(0, s.seen_version - s.info.resumed_version());
  s.seen_version = s.info.version();
  {
    std::lock_guard<std::mutex> lock(restart_mutex_);
    lost_updates_ += restart.lost;
  }
  if (on_restart_) on_restart_(restart);
}

PsClient::~PsClient() = default;

bool PushResult::any_refused() const {
  return std::any_of(refused.begin(), refused.end(),
                     [](const std::string& r) { return !r.empty(); });
}

void PsClient::describe_all() {
  for_each_shard(shards(), [&](int i) {
    with_retry(i, "Describe", [&](Shard& s, grpc::ClientContext& context) {
      context.set_wait_for_ready(true);  // a shard still starting up: wait for it (bounded)
      return s.stub->Describe(&context, {}, &s.info);
    });
    const Shard& s = *shards_[i];
    DTRAIN_CHECK_INPUT(s.info.shard() == i && s.info.shards() == shards(), "parameter server ",
                       s.address, " is shard ", s.info.shard(), "/", s.info.shards(),
                       ", but it was given as shard ", i, " of ", shards(),
                       " (list the shards in order, all of them)");
  });
  // Shards already initialized (by another worker) tell the model's size.
  if (total_ < 0 && shards_[0]->info.initialized()) total_ = shards_[0]->info.total();
}

void PsClient::done() {
  for_each_shard(shards(), [&](int i) {
    with_retry(i, "Done", [&](Shard& s, grpc::ClientContext& context) {
      dtrain::ps::DoneRequest request;
      request.set_worker(options_.worker);
      dtrain::ps::PushReply reply;
      return s.stub->Done(&context, request, &reply);
    });
  });
}

std::vector<dtrain::ps::ShardInfo> PsClient::describe() {
  describe_all();
  std::vector<dtrain::ps::ShardInfo> infos;
  for (const auto& s : shards_) infos.push_back(s->info);
  return infos;
}

bool PsClient::initialize(const at::Tensor& flat) {
  DTRAIN_CHECK(
      (flat.scalar_type() == at::kFloat || flat.scalar_type() == at::kDouble) && flat.dim() == 1,
      "initialize takes flat float32 or float64");
  total_ = flat.numel();
  const auto owner = std::make_shared<const at::Tensor>(flat.contiguous());
  std::vector<char> created(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    const auto [begin, end] = shard_range(total_, i, shards());
    with_retry(i, "Initialize", [&](Shard& s, grpc::ClientContext& context) {
      dtrain::ps::PushReply reply;
      auto writer = s.writer(*s.initialize, context, &reply);
      grpc::Status status =
          send_chunks(*writer, owner->narrow(0, begin, end - begin), begin, options_.chunk_bytes,
                      owner, [&](dtrain::ps::PushChunk& message) {
                        message.set_worker(options_.worker);
                        message.set_total(total_);
                      });
      if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS) return grpc::Status::OK;
      if (status.ok()) created[i] = 1;
      return status;
    });
  });
  describe_all();
  for (const auto& s : shards_) {
    DTRAIN_CHECK_INPUT(s->info.total() == total_, "parameter server ", s->address,
                       " holds a model of ", s->info.total(), " parameters, this worker's has ",
                       total_);
    DTRAIN_CHECK_INPUT(s->info.dtype() == comm::rpc::to_wire(flat.scalar_type()),
                       "parameter server ", s->address, " holds ",
                       comm::rpc::dtype_name(s->info.dtype()), " parameters, this worker's are ",
                       flat.scalar_type());
  }
  return std::all_of(created.begin(), created.end(), [](char c) { return c != 0; });
}

std::vector<int64_t> PsClient::pull(const at::Tensor& flat) {
  if (total_ < 0) describe_all();
  DTRAIN_CHECK(total_ == flat.numel() && flat.is_contiguous(), "pull into ", flat.numel(),
               " elements; the model has ", total_, " (initialize first)");
  const auto item = static_cast<int64_t>(flat.element_size());
  std::vector<int64_t> versions(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    const auto [begin, end] = shard_range(total_, i, shards());
    std::string problem;
    int64_t received = 0;
    int64_t version = -1;
    with_retry(i, "Pull", [&](Shard& s, grpc::ClientContext& context) {
      dtrain::ps::PullRequest request;
      request.set_begin(begin);
      request.set_end(end);
      request.set_chunk_bytes(options_.chunk_bytes);
      std::unique_ptr<grpc::ClientReader<comm::rpc::Bulk<dtrain::ps::PullChunk>>> reader(
          grpc::internal::ClientReaderFactory<comm::rpc::Bulk<dtrain::ps::PullChunk>>::Create(
              s.channel.get(), *s.pull, &context, request));
      comm::rpc::ChunkRule rule;
      rule.begin = begin;
      rule.end = end;
      rule.dtype = flat.scalar_type();
      problem.clear();
      received = 0;
      version = -1;
      const std::string where = concat("Pull reply from ", s.address);
      // Each payload is checked, then copied once, from gRPC's slices into `flat`.
      comm::rpc::Bulk<dtrain::ps::PullChunk> message;
      message.place = [&](const dtrain::ps::PullChunk& meta, int64_t bytes,
                          std::string* why) -> char* {
        *why = comm::rpc::check_chunk(meta.chunk(), bytes, rule, where);
        if (why->empty() && version >= 0 && meta.version() != version) {
          *why = concat(where, " mixes versions ", version, " and ", meta.version());
        }
        return why->empty() ? static_cast<char*>(flat.data_ptr()) + meta.chunk().offset() * item
                            : nullptr;
      };
      while (reader->Read(&message)) {
        if (!problem.empty()) continue;
        problem = message.refused;
        if (!problem.empty()) continue;
        version = message.meta.version();
        received += message.received / item;
      }
      return reader->Finish();
    });
    Shard& s = *shards_[i];
    DTRAIN_CHECK_T(CommError, problem.empty(), problem);
    DTRAIN_CHECK_T(CommError, received == end - begin, "Pull from parameter server ", s.address,
                   " returned ", received, " of ", end - begin, " parameters");
    versions[i] = version;
    s.seen_version = std::max(s.seen_version, version);
  });
  return versions;
}

int PsClient::accumulate(const at::Tensor& gradient, const std::string& vector, int64_t round,
                         int64_t unit) {
  DTRAIN_CHECK(total_ == gradient.numel() && gradient.is_contiguous(), "accumulate of ",
               gradient.numel(), " elements; the model has ", total_);
  const auto owner = std::make_shared<const at::Tensor>(gradient);
  std::vector<char> ignored(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    const auto [begin, end] = shard_range(total_, i, shards());
    with_retry(i, "Push", [&](Shard& s, grpc::ClientContext& context) {
      dtrain::ps::PushReply reply;
      auto writer = s.writer(*s.push, context, &reply);
      grpc::Status status =
          send_chunks(*writer, gradient.narrow(0, begin, end - begin), begin, options_.chunk_bytes,
                      owner, [&](dtrain::ps::PushChunk& message) {
                        message.set_worker(options_.worker);
                        message.set_accumulate(vector);
                        message.set_round(round);
                        message.set_unit(unit);
                      });
      ignored[i] = reply.ignored();
      return status;
    });
  });
  return static_cast<int>(std::count(ignored.begin(), ignored.end(), 1));
}

std::vector<double> PsClient::vector_ops(const std::vector<VectorOp>& ops) {
  dtrain::ps::VectorRequest request;
  for (const auto& op : ops) {
    auto* out = request.add_ops();
    out->set_kind(static_cast<dtrain::ps::VectorOp::Kind>(op.kind));
    out->set_dst(op.dst);
    out->set_src(op.src);
    out->set_alpha(op.alpha);
    out->set_round(op.round);
  }
  std::vector<std::vector<double>> partial(shards());
  for_each_shard(shards(), [&](int i) {
    with_retry(i, "Vector", [&](Shard& s, grpc::ClientContext& context) {
      dtrain::ps::VectorReply reply;
      grpc::Status status = s.stub->Vector(&context, request, &reply);
      partial[i].assign(reply.dots().begin(), reply.dots().end());
      return status;
    });
  });
  std::vector<double> dots(partial[0].size(), 0.0);
  for (const auto& p : partial) {
    DTRAIN_CHECK_T(CommError, p.size() == dots.size(),
                   "shards returned different numbers of dot products");
    for (size_t k = 0; k < dots.size(); ++k) dots[k] += p[k];
  }
  return dots;
}

PushResult PsClient::push(const at::Tensor& gradient, const std::vector<int64_t>& versions,
                          bool last) {
  DTRAIN_CHECK(total_ == gradient.numel() && gradient.is_contiguous() &&
                   static_cast<int>(versions.size()) == shards(),
               "push of ", gradient.numel(), " elements; the model has ", total_);
  PushResult result;
  result.versions.assign(shards(), 0);
  result.staleness.assign(shards(), 0);
  result.lr.assign(shards(), 0.0);
  result.refused.assign(shards(), "");
  const auto owner = std::make_shared<const at::Tensor>(gradient);
  for_each_shard(shards(), [&](int i) {
    const auto [begin, end] = shard_range(total_, i, shards());
    dtrain::ps::PushReply reply;
    with_retry(i, "Push", [&](Shard& s, grpc::ClientContext& context) {
      auto writer = s.writer(*s.push, context, &reply);
      // After a restart the gradient may have been computed on a version the shard lost: it
      // counts as computed on the newest the worker has seen since.
      const int64_t computed = std::min(versions[i], s.seen_version);
      const grpc::Status status =
          send_chunks(*writer, gradient.narrow(0, begin, end - begin), begin, options_.chunk_bytes,
                      owner, [&](dtrain::ps::PushChunk& message) {
                        message.set_worker(options_.worker);
                        message.set_computed_version(computed);
                        message.set_last(last);
                      });
      // A gradient with NaN or Inf costs this update, not the worker (the shard is unchanged).
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
          status.error_details() == kNonFiniteDetails) {
        result.refused[i] =
            concat("parameter server ", s.address, " refused the push: ", status.error_message());
        return grpc::Status::OK;
      }
      return status;
    });
    Shard& s = *shards_[i];
    if (!result.refused[i].empty()) return;
    s.seen_version = std::max(s.seen_version, reply.version());
    result.versions[i] = reply.version();
    result.staleness[i] = reply.staleness();
    result.lr[i] = reply.lr();
  });
  return result;
}

}  // namespace dtrain::parallel::ps
