#include "dtrain/parallel/ps/ShardServer.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/ps.grpc.pb.h"

namespace dtrain::parallel::ps {

namespace {

grpc::Status invalid(const std::string& why) {
  return {grpc::StatusCode::INVALID_ARGUMENT, why};
}

// Reads a stream of chunks that must follow each other from the first one's offset, within
// `rule`; fills `values` (float32) and returns "" or why the stream was refused.
std::string read_stream(grpc::ServerReader<dtrain::ps::PushChunk>* reader, rpc::ChunkRule rule,
                        const char* rpc_name, int64_t* first_offset, at::Tensor* values,
                        dtrain::ps::PushChunk* head) {
  dtrain::ps::PushChunk chunk;
  std::vector<at::Tensor> parts;
  int64_t next = -1;
  int64_t index = 0;
  std::string problem;
  while (reader->Read(&chunk)) {
    if (!problem.empty()) continue;  // drain the stream, apply nothing
    const std::string where = concat(rpc_name, " chunk ", index++);
    problem = rpc::check_chunk(chunk.chunk(), rule, where);
    if (!problem.empty()) continue;
    if (next < 0) {
      *head = chunk;
      *first_offset = chunk.chunk().offset();
    } else if (chunk.chunk().offset() != next) {
      problem = concat(where, ": field 'offset' is ", chunk.chunk().offset(), ", expected ", next,
                       " (chunks must follow each other)");
      continue;
    } else if (chunk.computed_version() != head->computed_version()) {
      problem = concat(where, ": field 'computed_version' is ", chunk.computed_version(),
                       ", the first chunk's ", head->computed_version());
      continue;
    }
    const int64_t n = rpc::chunk_elements(chunk.chunk());
    at::Tensor part = at::empty({n}, at::kFloat);
    rpc::copy_chunk(chunk.chunk(), part, chunk.chunk().offset());
    parts.push_back(part);
    next = chunk.chunk().offset() + n;
  }
  if (!problem.empty()) return problem;
  if (parts.empty()) return concat(rpc_name, ": the stream held no chunks");
  *values = parts.size() == 1 ? parts[0] : at::cat(parts);
  if (values->numel() == 0) return concat(rpc_name, ": the chunks hold no elements");
  return "";
}

}  // namespace

class ShardService final : public dtrain::ps::ParameterServer::Service {
 public:
  explicit ShardService(const ShardServerOptions& options)
      : shard_(options.shard, options.shards, options.optimizer) {}

  ParameterShard& shard() { return shard_; }

  grpc::Status Describe(grpc::ServerContext*, const dtrain::ps::DescribeRequest*,
                        dtrain::ps::ShardInfo* info) override {
    info->set_shard(shard_.shard());
    info->set_shards(shard_.shards());
    info->set_initialized(shard_.initialized());
    info->set_begin(shard_.begin());
    info->set_end(shard_.end());
    info->set_total(shard_.total());
    info->set_version(shard_.version());
    info->set_optimizer(shard_.optimizer().name);
    return grpc::Status::OK;
  }

  grpc::Status Initialize(grpc::ServerContext*, grpc::ServerReader<dtrain::ps::PushChunk>* reader,
                          dtrain::ps::PushReply* reply) override {
    // The range is known only from `total`, so read the first chunk's total before checking.
    rpc::ChunkRule rule;
    rule.end = INT64_MAX;
    int64_t first = 0;
    at::Tensor values;
    dtrain::ps::PushChunk head;
    const std::string problem = read_stream(reader, rule, "Initialize", &first, &values, &head);
    if (!problem.empty()) return invalid(problem);
    const int64_t total = head.total();
    const auto [begin, end] = shard_range(total, shard_.shard(), shard_.shards());
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
                    grpc::ServerWriter<dtrain::ps::PullChunk>* writer) override {
    if (!shard_.initialized()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "the shard has no parameters yet"};
    }
    const int64_t begin = request->begin(), end = request->end();
    if (begin < shard_.begin() || end > shard_.end() || begin > end) {
      return invalid(concat("Pull: fields 'begin', 'end' ask for [", begin, ", ", end,
                            "), outside the shard's range [", shard_.begin(), ", ", shard_.end(), ")"));
    }
    if (request->chunk_bytes() < 0 || request->chunk_bytes() > rpc::kMaxChunkBytes) {
      return invalid(concat("Pull: field 'chunk_bytes' is ", request->chunk_bytes(),
                            " (0 to ", rpc::kMaxChunkBytes, ")"));
    }
    int64_t version = 0;
    const at::Tensor values = shard_.read(begin, end, &version);
    bool open = true;
    rpc::for_each_chunk(values, begin, "", request->chunk_bytes() > 0 ? request->chunk_bytes()
                                                                      : rpc::kDefaultChunkBytes,
                        [&](rpc::TensorChunk& chunk) {
                          dtrain::ps::PullChunk message;
                          message.set_version(version);
                          message.mutable_chunk()->Swap(&chunk);
                          open = !context->IsCancelled() && writer->Write(message);
                          return open;
                        });
    return open ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
  }

  grpc::Status Push(grpc::ServerContext*, grpc::ServerReader<dtrain::ps::PushChunk>* reader,
                    dtrain::ps::PushReply* reply) override {
    if (!shard_.initialized()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "the shard has no parameters yet"};
    }
    rpc::ChunkRule rule;
    rule.begin = shard_.begin();
    rule.end = shard_.end();
    int64_t first = 0;
    at::Tensor gradient;
    dtrain::ps::PushChunk head;
    const std::string problem = read_stream(reader, rule, "Push", &first, &gradient, &head);
    if (!problem.empty()) return invalid(problem);
    int64_t version = 0, staleness = 0;
    const std::string why = shard_.apply(first, gradient, head.computed_version(), &version, &staleness);
    if (!why.empty()) return invalid("Push: " + why);
    reply->set_version(version);
    reply->set_staleness(staleness);
    return grpc::Status::OK;
  }

 private:
  ParameterShard shard_;
};

ShardServer::ShardServer(const ShardServerOptions& options)
    : options_(options), service_(std::make_unique<ShardService>(options)) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(rpc::kMaxChunkBytes + (1 << 20)));
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  DTRAIN_CHECK_INPUT(server_ && port_ > 0, "parameter-server shard ", options.shard, "/",
                     options.shards, " cannot listen on ", options.listen,
                     " (address in use or not this machine's?)");
}

ShardServer::~ShardServer() { shutdown(); }

std::string ShardServer::address() const {
  const auto colon = options_.listen.rfind(':');
  std::string host = options_.listen.substr(0, colon);
  if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = "127.0.0.1";
  return concat(host, ":", port_);
}

const ParameterShard& ShardServer::shard() const { return service_->shard(); }

void ShardServer::shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void ShardServer::wait() {
  if (server_) server_->Wait();
}

}  // namespace dtrain::parallel::ps
