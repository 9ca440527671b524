#include "dtrain/services/ps/ShardServer.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <filesystem>
#include <random>

#include "comm/rpc/Security.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/ps.grpc.pb.h"
#include "parallel/ps/PsWire.h"

namespace dtrain::services::ps {

namespace {

grpc::Status invalid(const std::string& why) { return {grpc::StatusCode::INVALID_ARGUMENT, why}; }

// Buffers kept for reuse: a shard streams megabytes per call, and fresh buffers would
// cost a page fault per 4 KB on every call.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  class Lease {
   public:
    Lease(std::shared_ptr<BufferPool> pool, at::Tensor buffer)
        : pool_(std::move(pool)), buffer_(std::move(buffer)) {}
    Lease(Lease&& other) noexcept
        : pool_(std::move(other.pool_)), buffer_(std::move(other.buffer_)) {
      other.pool_ = nullptr;
    }
    Lease(const Lease&) = delete;
    ~Lease() {
      if (pool_) pool_->give_back(std::move(buffer_));
    }
    const at::Tensor& tensor() const { return buffer_; }

   private:
    std::shared_ptr<BufferPool> pool_;  // a lease held by gRPC may outlive the service
    at::Tensor buffer_;
  };

  /// A buffer of at least n elements of `dtype` (its first n are the caller's to use).
  Lease take(int64_t n, at::ScalarType dtype) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].numel() >= n && free_[i].scalar_type() == dtype) {
          at::Tensor buffer = std::move(free_[i]);
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return Lease(shared_from_this(), buffer);
        }
      }
    }
    return Lease(shared_from_this(), at::empty({n}, dtype));
  }

 private:
  void give_back(at::Tensor buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < 8) free_.push_back(std::move(buffer));
  }
  std::mutex mutex_;
  std::vector<at::Tensor> free_;
};

// "" when `meta`'s fields other than the tensor's place agree with the stream's first chunk
// (`head`), else why not (prefixed by `where`).
std::string check_same_header(const dtrain::ps::PushChunk& meta, const dtrain::ps::PushChunk& head,
                              const std::string& where) {
  auto differs = [&](const char* field, auto mine, auto first) {
    return concat(where, ": field '", field, "' is ", mine, ", the first chunk's ", first);
  };
  if (meta.computed_version() != head.computed_version()) {
    return differs("computed_version", meta.computed_version(), head.computed_version());
  }
  if (meta.worker() != head.worker()) return differs("worker", meta.worker(), head.worker());
  if (meta.total() != head.total()) return differs("total", meta.total(), head.total());
  if (meta.last() != head.last()) return differs("last", meta.last(), head.last());
  if (meta.round() != head.round()) return differs("round", meta.round(), head.round());
  if (meta.unit() != head.unit()) return differs("unit", meta.unit(), head.unit());
  if (meta.accumulate() != head.accumulate()) {
    return concat(where, ": field 'accumulate' differs from the first chunk's");
  }
  const auto& shape = meta.chunk().shape();
  const auto& first = head.chunk().shape();
  if (!shape.empty() && (shape.size() != 1 || first.size() != 1 || shape[0] != first[0])) {
    return concat(where,
                  ": field 'shape' differs from the first chunk's (later chunks may leave "
                  "it empty)");
  }
  return "";
}

// Reads a stream of chunks that must follow each other from the first one's offset, within
// `rule`, into `buffer` (elements [rule.begin, rule.end) of the index space, of rule.dtype;
// empty: parts are gathered and joined); each payload is copied once, from gRPC's slices to its
// place. `any_float`: the first chunk's dtype, float32 or float64, sets rule.dtype. Every chunk
// names no tensor, the first one's shape is empty or the stream's length, and the other fields
// are the first chunk's. Sets `values` to the elements received, `*worker` to the first chunk's
// worker field (even when refused; -1 when none came), and returns "" or why the stream was
// refused.
std::string read_stream(grpc::ServerReader<comm::rpc::Bulk<dtrain::ps::PushChunk>>* reader,
                        comm::rpc::ChunkRule rule, const char* rpc_name, int64_t* first_offset,
                        at::Tensor* values, dtrain::ps::PushChunk* head, int* worker,
                        const at::Tensor& buffer = {}, bool any_float = false) {
  comm::rpc::Bulk<dtrain::ps::PushChunk> chunk;
  std::vector<at::Tensor> parts;
  int64_t next = -1;
  int64_t index = 0;
  std::string problem;
  // Checks a chunk's fields against the rule and the chunks before it ("" or why not).
  auto check = [&](const dtrain::ps::PushChunk& meta, int64_t bytes) {
    const std::string where = concat(rpc_name, " chunk ", index);
    if (any_float && next < 0 && meta.chunk().dtype() == comm::rpc::FLOAT64)
      rule.dtype = at::kDouble;
    std::string why = comm::rpc::check_chunk(meta.chunk(), bytes, rule, where);
    if (!why.empty()) return why;
    if (!meta.chunk().name().empty()) {
      return concat(where, ": field 'name' must be empty (a shard holds one tensor)");
    }
    if (next < 0) {
      const auto& shape = meta.chunk().shape();
      const int64_t room = rule.end - meta.chunk().offset();
      if (shape.size() > 1 || (shape.size() == 1 && (shape[0] < 1 || shape[0] > room))) {
        return concat(where, ": field 'shape' must be empty or the stream's length, 1 to ", room,
                      " elements from offset ", meta.chunk().offset(), " (got ",
                      shape.size() == 1 ? concat(shape[0]) : concat(shape.size(), " dimensions"),
                      ")");
      }
      return std::string();
    }
    if (meta.chunk().offset() != next) {
      return concat(where, ": field 'offset' is ", meta.chunk().offset(), ", expected ", next,
                    " (chunks must follow each other)");
    }
    return check_same_header(meta, *head, where);
  };
  chunk.place = [&](const dtrain::ps::PushChunk& meta, int64_t bytes, std::string* why) -> char* {
    if (!problem.empty()) {  // draining the stream: nothing is kept
      *why = problem;
      return nullptr;
    }
    *why = check(meta, bytes);
    if (!why->empty()) return nullptr;
    if (buffer.defined()) {
      return static_cast<char*>(buffer.data_ptr()) +
             (meta.chunk().offset() - rule.begin) * buffer.element_size();
    }
    parts.push_back(
        at::empty({bytes / static_cast<int64_t>(c10::elementSize(rule.dtype))}, rule.dtype));
    return static_cast<char*>(parts.back().data_ptr());
  };
  *worker = -1;
  while (reader->Read(&chunk)) {
    if (index == 0) *worker = chunk.meta.worker();
    if (!problem.empty()) continue;  // drain the stream, apply nothing
    problem = chunk.refused.empty() && chunk.received == 0 ? check(chunk.meta, 0) : chunk.refused;
    ++index;
    if (!problem.empty()) continue;
    if (next < 0) {
      *head = chunk.meta;
      *first_offset = chunk.meta.chunk().offset();
      next = *first_offset;
    }
    next += chunk.received / static_cast<int64_t>(c10::elementSize(rule.dtype));
  }
  if (!problem.empty()) return problem;
  if (next < 0) return concat(rpc_name, ": the stream held no chunks");
  if (buffer.defined()) {
    *values = buffer.narrow(0, *first_offset - rule.begin, next - *first_offset);
  } else {
    *values = parts.empty()       ? at::empty({0}, rule.dtype)
              : parts.size() == 1 ? parts[0]
                                  : at::cat(parts);
  }
  if (values->numel() == 0) return concat(rpc_name, ": the chunks hold no elements");
  if (head->chunk().shape_size() == 1 && head->chunk().shape(0) != values->numel()) {
    return concat(rpc_name, ": field 'shape' says ", head->chunk().shape(0),
                  " elements, the chunks carry ", values->numel());
  }
  return "";
}

}  // namespace

std::string shard_checkpoint_file(const std::string& dir, int shard, int shards) {
  return concat(dir, "/shard-", shard, "-of-", shards, ".pt");
}

class ShardService final : public grpc::Service {
 public:
  explicit ShardService(const ShardServerOptions& options)
      : shard_(options.shard, options.shards, options.optimizer),
        token_(options.auth_token),
        max_workers_(options.max_workers),
        incarnation_(std::random_device{}() * 0x100000001ULL ^ std::random_device{}()),
        started_(std::chrono::steady_clock::now()) {
    // Registered by hand rather than through the generated ParameterServer::Service:
    // Initialize, Pull and Push carry their tensor payloads beside protobuf (comm::rpc::Bulk).
    add_unary(parallel::ps::kDescribe, &ShardService::Describe);
    add_chunks(parallel::ps::kInitialize, &ShardService::Initialize);
    AddMethod(new grpc::internal::RpcServiceMethod(
        parallel::ps::kPsMethodName[parallel::ps::kPull],
        grpc::internal::RpcMethod::SERVER_STREAMING,
        new grpc::internal::ServerStreamingHandler<ShardService, dtrain::ps::PullRequest,
                                                   comm::rpc::Bulk<dtrain::ps::PullChunk>>(
            [](ShardService* s, grpc::ServerContext* c, const dtrain::ps::PullRequest* q,
               grpc::ServerWriter<comm::rpc::Bulk<dtrain::ps::PullChunk>>* w) {
              return s->Pull(c, q, w);
            },
            this)));
    add_chunks(parallel::ps::kPush, &ShardService::Push);
    add_unary(parallel::ps::kDone, &ShardService::Done);
    add_unary(parallel::ps::kVector, &ShardService::Vector);
  }

  ParameterShard& shard() { return shard_; }
  void set_resumed(int64_t version) { resumed_version_ = version; }
  void set_saved(int64_t version) { saved_version_ = version; }

  grpc::Status Describe(grpc::ServerContext* context, const dtrain::ps::DescribeRequest*,
                        dtrain::ps::ShardInfo* info) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    const auto now = std::chrono::steady_clock::now();
    info->set_shard(shard_.shard());
    info->set_shards(shard_.shards());
    info->set_initialized(shard_.initialized());
    info->set_begin(shard_.begin());
    info->set_end(shard_.end());
    info->set_total(shard_.total());
    info->set_version(shard_.version());
    info->set_optimizer(shard_.optimizer().name);
    info->set_dtype(comm::rpc::to_wire(shard_.dtype()));
    const int64_t saved = saved_version_.load();
    info->set_unsaved_updates(shard_.initialized() && saved >= 0 ? shard_.version() - saved
                                                                 : shard_.version());
    info->set_resumed_version(resumed_version_);
    info->set_incarnation(incarnation_);
    info->set_lr(shard_.current_lr());
    info->set_pushes(pushes_.load());
    info->set_pulls(pulls_.load());
    info->set_bytes_in(bytes_in_.load());
    info->set_bytes_out(bytes_out_.load());
    info->set_uptime_s(std::chrono::duration<double>(now - started_).count());
    info->set_refused_pushes(refused_.load());
    info->set_max_workers(max_workers_);
    for (const int64_t count : shard_.staleness_histogram()) info->add_staleness_histogram(count);
    for (const auto& [id, record] : shard_.workers()) {
      auto* worker = info->add_workers();
      worker->set_worker(id);
      worker->set_pushes(record.pushes);
      worker->set_last_push_age_s(std::chrono::duration<double>(now - record.last_push).count());
      worker->set_finished(record.finished);
      worker->set_refused(record.refused);
    }
    return grpc::Status::OK;
  }

  grpc::Status Initialize(grpc::ServerContext* context,
                          grpc::ServerReader<comm::rpc::Bulk<dtrain::ps::PushChunk>>* reader,
                          dtrain::ps::PushReply* reply) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    // The range is known only from `total`, so read the first chunk's total before checking.
    comm::rpc::ChunkRule rule;
    rule.end = INT64_MAX;
    int64_t first = 0;
    at::Tensor values;
    dtrain::ps::PushChunk head;
    int worker = -1;
    const std::string problem = read_stream(reader, rule, "Initialize", &first, &values, &head,
                                            &worker, {}, /*any_float=*/true);
    if (!problem.empty()) return invalid(problem);
    if (std::string why = check_worker("Initialize", worker); !why.empty()) return invalid(why);
    const int64_t total = head.total();
    const auto [begin, end] = parallel::ps::shard_range(total, shard_.shard(), shard_.shards());
    if (total <= 0) return invalid(concat("Initialize: field 'total' is ", total));
    if (first != begin || first + values.numel() != end) {
      return invalid(concat("Initialize: the chunks cover [", first, ", ", first + values.numel(),
                            "), shard ", shard_.shard(), "/", shard_.shards(), " of ", total,
                            " parameters is [", begin, ", ", end, ")"));
    }
    const std::string why = shard_.initialize(total, values);
    if (why == "initialized") {
      return {grpc::StatusCode::ALREADY_EXISTS, "the shard is already initialized"};
    }
    if (!why.empty()) return invalid("Initialize: " + why);
    reply->set_version(shard_.version());
    return grpc::Status::OK;
  }

  grpc::Status Pull(grpc::ServerContext* context, const dtrain::ps::PullRequest* request,
                    grpc::ServerWriter<comm::rpc::Bulk<dtrain::ps::PullChunk>>* writer) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (!shard_.initialized()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "the shard has no parameters yet"};
    }
    const int64_t begin = request->begin(), end = request->end();
    if (begin < shard_.begin() || end > shard_.end() || begin > end) {
      return invalid(concat("Pull: fields 'begin', 'end' ask for [", begin, ", ", end,
                            "), outside the shard's range [", shard_.begin(), ", ", shard_.end(),
                            ")"));
    }
    if (request->chunk_bytes() < 0 || request->chunk_bytes() > comm::rpc::kMaxChunkBytes) {
      return invalid(concat("Pull: field 'chunk_bytes' is ", request->chunk_bytes(), " (0 to ",
                            comm::rpc::kMaxChunkBytes, ")"));
    }
    // The payloads point into the shard's values themselves (one version: an update arriving
    // while gRPC still holds them writes into a copy), held by their slices until sent.
    int64_t version = 0;
    const auto snapshot = std::make_shared<const at::Tensor>(shard_.share(begin, end, &version));
    bool open = true;
    comm::rpc::for_each_bulk<dtrain::ps::PullChunk>(
        *snapshot, begin,
        request->chunk_bytes() > 0 ? request->chunk_bytes() : comm::rpc::kDefaultChunkBytes,
        snapshot, [&](dtrain::ps::PullChunk& meta) { meta.set_version(version); },
        [&](const comm::rpc::Bulk<dtrain::ps::PullChunk>& message) {
          open = !context->IsCancelled() && writer->Write(message);
          return open;
        });
    ++pulls_;
    bytes_out_ += static_cast<int64_t>(snapshot->nbytes());
    return open ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }

  grpc::Status Push(grpc::ServerContext* context,
                    grpc::ServerReader<comm::rpc::Bulk<dtrain::ps::PushChunk>>* reader,
                    dtrain::ps::PushReply* reply) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (!shard_.initialized()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "the shard has no parameters yet"};
    }
    comm::rpc::ChunkRule rule;
    rule.begin = shard_.begin();
    rule.end = shard_.end();
    rule.dtype = shard_.dtype();
    int64_t first = 0;
    at::Tensor gradient;
    dtrain::ps::PushChunk head;
    int worker = -1;
    const BufferPool::Lease lease = pool_->take(rule.end - rule.begin, rule.dtype);
    std::string why =
        read_stream(reader, rule, "Push", &first, &gradient, &head, &worker, lease.tensor());
    if (why.empty()) why = check_worker("Push", worker);
    if (why.empty() && head.total() != 0 && head.total() != shard_.total()) {
      why = concat("Push: field 'total' is ", head.total(), ", the model has ", shard_.total(),
                   " parameters (0 leaves it out)");
    }
    if (why.empty() && head.accumulate().empty() && (head.round() != 0 || head.unit() != 0)) {
      why = "Push: fields 'round' and 'unit' belong to an accumulate push (0 otherwise)";
    }
    if (why.empty() && !head.accumulate().empty() &&
        (head.computed_version() != 0 || head.last())) {
      why = "Push: an accumulate push carries no 'computed_version' or 'last'";
    }
    if (!why.empty()) return refuse(worker, why);
    if (!head.accumulate().empty()) {
      bool ignored = false;
      why = shard_.accumulate(head.accumulate(), first, gradient, head.round(), head.unit(),
                              &ignored);
      if (!why.empty()) return refuse(worker, concat("Push from worker ", worker, ": ", why));
      ++pushes_;
      bytes_in_ += gradient.nbytes();
      reply->set_version(shard_.version());
      reply->set_ignored(ignored);
      return grpc::Status::OK;
    }
    int64_t version = 0, staleness = 0;
    double lr = 0;
    why = shard_.apply(first, gradient, head.computed_version(), head.worker(), head.last(),
                       &version, &staleness, &lr);
    if (!why.empty()) return refuse(worker, concat("Push from worker ", worker, ": ", why));
    ++pushes_;
    bytes_in_ += gradient.nbytes();
    reply->set_version(version);
    reply->set_staleness(staleness);
    reply->set_lr(lr);
    return grpc::Status::OK;
  }

  grpc::Status Vector(grpc::ServerContext* context, const dtrain::ps::VectorRequest* request,
                      dtrain::ps::VectorReply* reply) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (request->ops_size() > kMaxVectorOps) {
      return invalid(concat("Vector: ", request->ops_size(), " ops in one request (at most ",
                            kMaxVectorOps, ")"));
    }
    std::vector<parallel::ps::VectorOp> ops;
    for (int i = 0; i < request->ops_size(); ++i) {
      const auto& op = request->ops(i);
      if (!dtrain::ps::VectorOp::Kind_IsValid(op.kind())) {
        return invalid(concat("Vector: vector op ", i, ": field 'kind' is ", op.kind()));
      }
      ops.push_back({static_cast<parallel::ps::VectorOp::Kind>(op.kind()), op.dst(), op.src(),
                     op.alpha(), op.round()});
    }
    std::vector<double> dots;
    const std::string why = shard_.vector_ops(ops, &dots);
    if (!why.empty()) {
      return why.rfind("the shard has no", 0) == 0
                 ? grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why)
                 : invalid("Vector: " + why);
    }
    for (const double d : dots) reply->add_dots(d);
    return grpc::Status::OK;
  }

  grpc::Status Done(grpc::ServerContext* context, const dtrain::ps::DoneRequest* request,
                    dtrain::ps::PushReply* reply) {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (std::string why = check_worker("Done", request->worker()); !why.empty())
      return invalid(why);
    shard_.mark_done(request->worker());
    reply->set_version(shard_.version());
    return grpc::Status::OK;
  }

 private:
  std::string check_worker(const char* rpc_name, int worker) const {
    if (worker >= 0 && worker < max_workers_) return "";
    return concat(rpc_name, ": field 'worker' is ", worker, " (0 to ", max_workers_ - 1,
                  ", --max-workers)");
  }

  // A refused push: counted (per worker when the id is valid), logged for the first few of each
  // worker, answered INVALID_ARGUMENT; a non-finite gradient's answer carries the details
  // "non-finite" so a worker can skip that update and go on.
  grpc::Status refuse(int worker, const std::string& why) {
    ++refused_;
    const bool known = check_worker("", worker).empty();
    if (known) shard_.count_refusal(worker);
    const bool nonfinite = why.find(parallel::ps::kNonFiniteGradient) != std::string::npos;
    const int64_t logged = known ? shard_.workers()[worker].refused : refused_.load();
    if (logged <= kLoggedRefusals) {
      std::fprintf(stderr, "parameter-server shard %d/%d: refused a push: %s%s\n", shard_.shard(),
                   shard_.shards(), why.c_str(),
                   logged == kLoggedRefusals ? " (further refusals are counted in Describe)" : "");
    }
    return {grpc::StatusCode::INVALID_ARGUMENT, why,
            nonfinite ? parallel::ps::kNonFiniteDetails : ""};
  }
  static constexpr int64_t kLoggedRefusals = 5;
  static constexpr int kMaxVectorOps = 4096;

  using Chunks = grpc::ServerReader<comm::rpc::Bulk<dtrain::ps::PushChunk>>;
  template <class Request, class Reply>
  void add_unary(parallel::ps::PsMethod method,
                 grpc::Status (ShardService::*f)(grpc::ServerContext*, const Request*, Reply*)) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        parallel::ps::kPsMethodName[method], grpc::internal::RpcMethod::NORMAL_RPC,
        new grpc::internal::RpcMethodHandler<ShardService, Request, Reply>(
            [f](ShardService* s, grpc::ServerContext* c, const Request* q, Reply* r) {
              return (s->*f)(c, q, r);
            },
            this)));
  }
  void add_chunks(parallel::ps::PsMethod method,
                  grpc::Status (ShardService::*f)(grpc::ServerContext*, Chunks*,
                                                  dtrain::ps::PushReply*)) {
    AddMethod(new grpc::internal::RpcServiceMethod(
        parallel::ps::kPsMethodName[method], grpc::internal::RpcMethod::CLIENT_STREAMING,
        new grpc::internal::ClientStreamingHandler<
            ShardService, comm::rpc::Bulk<dtrain::ps::PushChunk>, dtrain::ps::PushReply>(
            [f](ShardService* s, grpc::ServerContext* c, Chunks* q, dtrain::ps::PushReply* r) {
              return (s->*f)(c, q, r);
            },
            this)));
  }
  ParameterShard shard_;
  const std::string token_;
  const int max_workers_;
  std::atomic<int64_t> refused_{0};
  const uint64_t incarnation_;
  const std::chrono::steady_clock::time_point started_;
  int64_t resumed_version_ = -1;
  std::atomic<int64_t> saved_version_{-1};
  std::atomic<int64_t> pushes_{0}, pulls_{0}, bytes_in_{0}, bytes_out_{0};
  std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
};

ShardServer::ShardServer(const ShardServerOptions& options)
    : options_(options), service_(std::make_unique<ShardService>(options)) {
  DTRAIN_CHECK_INPUT(options.checkpoint_interval_s > 0,
                     "--checkpoint-interval must be > 0 seconds, got ",
                     options.checkpoint_interval_s);
  DTRAIN_CHECK_INPUT(options.max_workers >= 1, "--max-workers must be >= 1, got ",
                     options.max_workers);
  if (!options.checkpoint_dir.empty()) {
    const std::string file =
        shard_checkpoint_file(options.checkpoint_dir, options.shard, options.shards);
    if (std::filesystem::exists(file)) {
      resumed_version_ = service_->shard().load(file);
      service_->set_resumed(resumed_version_);
      service_->set_saved(resumed_version_);
    }
  }
  server_ = comm::rpc::start_server(
      concat("parameter-server shard ", options.shard, "/", options.shards), options.listen,
      options.tls_cert, options.tls_key, service_.get(), true, &port_);
  if (!options.checkpoint_dir.empty()) {
    saver_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(saver_mutex_);
      const auto interval = std::chrono::duration<double>(options_.checkpoint_interval_s);
      while (!saver_wake_.wait_for(lock, interval, [&] { return stopping_; })) {
        lock.unlock();
        try {
          save_checkpoint();
        } catch (const std::exception& e) {
          std::fprintf(stderr, "parameter-server shard %d/%d: checkpoint failed: %s\n",
                       options_.shard, options_.shards, e.what());
        }
        lock.lock();
      }
    });
  }
}

int64_t ShardServer::save_checkpoint() {
  if (options_.checkpoint_dir.empty()) return -1;
  std::lock_guard<std::mutex> lock(save_mutex_);
  const ParameterShard& shard = service_->shard();
  if (!shard.initialized() || shard.version() == saved_version_) return saved_version_;
  const int64_t version =
      shard.save(shard_checkpoint_file(options_.checkpoint_dir, options_.shard, options_.shards));
  saved_version_ = version;
  service_->set_saved(version);
  return version;
}

ShardServer::~ShardServer() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter-server shard %d/%d: %s\n", options_.shard, options_.shards,
                 e.what());
  }
}

std::string ShardServer::address() const {
  return comm::rpc::local_address(options_.listen, port_);
}

const ParameterShard& ShardServer::shard() const { return service_->shard(); }

void ShardServer::shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  {
    std::lock_guard<std::mutex> lock(saver_mutex_);
    stopping_ = true;
  }
  saver_wake_.notify_all();
  if (saver_.joinable()) saver_.join();
  save_checkpoint();
}

void ShardServer::wait() {
  if (server_) server_->Wait();
}

}  // namespace dtrain::services::ps
