#include "dtrain/parallel/ps/PsClient.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <functional>
#include <thread>

#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/ps.grpc.pb.h"
#include "dtrain/parallel/ps/ParameterShard.h"

namespace dtrain::parallel::ps {

struct PsClient::Shard {
  std::string address;
  std::unique_ptr<dtrain::ps::ParameterServer::Stub> stub;
  dtrain::ps::ShardInfo info;
};

namespace {

void set_deadline(grpc::ClientContext& context, std::chrono::milliseconds timeout) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
}

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
  DTRAIN_THROW(CommError, "parameter server ", address, ": ", rpc_name, " failed (",
               status.error_code(), "): ", status.error_message());
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
  arguments.SetMaxReceiveMessageSize(static_cast<int>(rpc::kMaxChunkBytes + (1 << 20)));
  for (const auto& address : addresses_) {
    auto shard = std::make_unique<Shard>();
    shard->address = address;
    shard->stub = dtrain::ps::ParameterServer::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), arguments));
    shards_.push_back(std::move(shard));
  }
  describe_all();
}

PsClient::~PsClient() = default;

void PsClient::describe_all() {
  for_each_shard(shards(), [&](int i) {
    Shard& s = *shards_[i];
    grpc::ClientContext context;
    set_deadline(context, options_.rpc_timeout);
    context.set_wait_for_ready(true);  // a shard still starting up: wait for it (bounded)
    const grpc::Status status = s.stub->Describe(&context, {}, &s.info);
    if (!status.ok()) fail("Describe", s.address, status, options_.rpc_timeout);
    DTRAIN_CHECK_INPUT(s.info.shard() == i && s.info.shards() == shards(), "parameter server ",
                       s.address, " is shard ", s.info.shard(), "/", s.info.shards(),
                       ", but it was given as shard ", i, " of ", shards(),
                       " (list the shards in order, all of them)");
  });
  // Shards already initialized (by another worker) tell the model's size.
  if (total_ < 0 && shards_[0]->info.initialized()) total_ = shards_[0]->info.total();
}

bool PsClient::initialize(const at::Tensor& flat) {
  DTRAIN_CHECK(flat.scalar_type() == at::kFloat && flat.dim() == 1, "initialize takes flat float32");
  total_ = flat.numel();
  std::vector<char> created(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    Shard& s = *shards_[i];
    const auto [begin, end] = shard_range(total_, i, shards());
    grpc::ClientContext context;
    set_deadline(context, options_.rpc_timeout);
    dtrain::ps::PushReply reply;
    auto writer = s.stub->Initialize(&context, &reply);
    rpc::for_each_chunk(flat.narrow(0, begin, end - begin), begin, "", options_.chunk_bytes,
                        [&](rpc::TensorChunk& chunk) {
                          dtrain::ps::PushChunk message;
                          message.set_worker(options_.worker);
                          message.set_total(total_);
                          message.mutable_chunk()->Swap(&chunk);
                          return writer->Write(message);
                        });
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS) return;
    if (!status.ok()) fail("Initialize", s.address, status, options_.rpc_timeout);
    created[i] = 1;
  });
  describe_all();
  for (const auto& s : shards_) {
    DTRAIN_CHECK_INPUT(s->info.total() == total_, "parameter server ", s->address, " holds a model of ",
                       s->info.total(), " parameters, this worker's has ", total_);
  }
  return std::all_of(created.begin(), created.end(), [](char c) { return c != 0; });
}

std::vector<int64_t> PsClient::pull(const at::Tensor& flat) {
  if (total_ < 0) describe_all();
  DTRAIN_CHECK(total_ == flat.numel() && flat.scalar_type() == at::kFloat && flat.is_contiguous(),
               "pull into ", flat.numel(), " elements; the model has ", total_, " (initialize first)");
  std::vector<int64_t> versions(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    Shard& s = *shards_[i];
    const auto [begin, end] = shard_range(total_, i, shards());
    grpc::ClientContext context;
    set_deadline(context, options_.rpc_timeout);
    dtrain::ps::PullRequest request;
    request.set_begin(begin);
    request.set_end(end);
    request.set_chunk_bytes(options_.chunk_bytes);
    auto reader = s.stub->Pull(&context, request);
    dtrain::ps::PullChunk message;
    rpc::ChunkRule rule;
    rule.begin = begin;
    rule.end = end;
    int64_t received = 0;
    int64_t version = -1;
    std::string problem;
    while (reader->Read(&message)) {
      if (!problem.empty()) continue;
      problem = rpc::check_chunk(message.chunk(), rule, concat("Pull reply from ", s.address));
      if (problem.empty() && version >= 0 && message.version() != version) {
        problem = concat("Pull reply from ", s.address, " mixes versions ", version, " and ", message.version());
      }
      if (!problem.empty()) continue;
      version = message.version();
      rpc::copy_chunk(message.chunk(), flat, 0);
      received += rpc::chunk_elements(message.chunk());
    }
    const grpc::Status status = reader->Finish();
    if (!status.ok()) fail("Pull", s.address, status, options_.rpc_timeout);
    DTRAIN_CHECK_T(CommError, problem.empty(), problem);
    DTRAIN_CHECK_T(CommError, received == end - begin, "Pull from parameter server ", s.address,
                   " returned ", received, " of ", end - begin, " parameters");
    versions[i] = version;
  });
  return versions;
}

PushResult PsClient::push(const at::Tensor& gradient, const std::vector<int64_t>& versions) {
  DTRAIN_CHECK(total_ == gradient.numel() && gradient.scalar_type() == at::kFloat &&
                   gradient.is_contiguous() && static_cast<int>(versions.size()) == shards(),
               "push of ", gradient.numel(), " elements; the model has ", total_);
  PushResult result;
  result.versions.assign(shards(), 0);
  result.staleness.assign(shards(), 0);
  for_each_shard(shards(), [&](int i) {
    Shard& s = *shards_[i];
    const auto [begin, end] = shard_range(total_, i, shards());
    grpc::ClientContext context;
    set_deadline(context, options_.rpc_timeout);
    dtrain::ps::PushReply reply;
    auto writer = s.stub->Push(&context, &reply);
    rpc::for_each_chunk(gradient.narrow(0, begin, end - begin), begin, "", options_.chunk_bytes,
                        [&](rpc::TensorChunk& chunk) {
                          dtrain::ps::PushChunk message;
                          message.set_worker(options_.worker);
                          message.set_computed_version(versions[i]);
                          message.mutable_chunk()->Swap(&chunk);
                          return writer->Write(message);
                        });
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    if (!status.ok()) fail("Push", s.address, status, options_.rpc_timeout);
    result.versions[i] = reply.version();
    result.staleness[i] = reply.staleness();
  });
  return result;
}

}  // namespace dtrain::parallel::ps
