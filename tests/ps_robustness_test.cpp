// The parameter server against a client written from proto/ alone (the generated stub and plain
// protobuf messages, not PsClient): gradients holding NaN or Inf, headers that do not match
// their data, worker ids out of range and malformed vector commands are refused with the field
// (or the worker and first bad element) named, change neither the parameters nor the version,
// and are counted per worker; valid pushes after them all apply. PsClient reports a non-finite
// refusal as a lost update instead of an error.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/ps.grpc.pb.h"
#include "dtrain/services/ps/ShardServer.h"

using namespace dtrain;
using namespace dtrain::parallel::ps;
using namespace dtrain::services::ps;
using namespace std::chrono_literals;

namespace {

constexpr int64_t kN = 64;
constexpr double kLr = 0.1;

// One chunk of float64 values at `offset` from `worker`, computed on `version`, carrying the
// stream's length as its shape when `shape` is set.
dtrain::ps::PushChunk chunk(int64_t offset, const std::vector<double>& values, int worker = 1,
                            int64_t version = 0, std::vector<int64_t> shape = {}) {
  dtrain::ps::PushChunk c;
  c.set_worker(worker);
  c.set_computed_version(version);
  c.mutable_chunk()->set_dtype(dtrain::comm::rpc::FLOAT64);
  c.mutable_chunk()->set_offset(offset);
  for (const int64_t d : shape) c.mutable_chunk()->add_shape(d);
  c.mutable_chunk()->set_data(values.data(), values.size() * sizeof(double));
  return c;
}

class Raw {
 public:
  explicit Raw(const std::string& address)
      : stub_(dtrain::ps::ParameterServer::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

  grpc::Status stream(bool initialize, const std::vector<dtrain::ps::PushChunk>& chunks) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 5s);
    dtrain::ps::PushReply reply;
    auto writer = initialize ? stub_->Initialize(&context, &reply) : stub_->Push(&context, &reply);
    for (const auto& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status push(const std::vector<dtrain::ps::PushChunk>& chunks) {
    return stream(false, chunks);
  }

  // The shard's parameters and the version they belong to.
  at::Tensor pull(int64_t* version) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + 5s);
    dtrain::ps::PullRequest request;
    request.set_begin(0);
    request.set_end(kN);
    auto reader = stub_->Pull(&context, request);
    at::Tensor values = at::full({kN}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
    dtrain::ps::PullChunk message;
    while (reader->Read(&message)) {
      const std::string& data = message.chunk().data();
      std::memcpy(values.data_ptr<double>() + message.chunk().offset(), data.data(), data.size());
      *version = message.version();
    }
    EXPECT_TRUE(reader->Finish().ok());
    return values;
  }

  dtrain::ps::ShardInfo describe() {
    grpc::ClientContext context;
    dtrain::ps::ShardInfo info;
    EXPECT_TRUE(stub_->Describe(&context, {}, &info).ok());
    return info;
  }

  grpc::Status vector(const std::vector<dtrain::ps::VectorOp>& ops) {
    grpc::ClientContext context;
    dtrain::ps::VectorRequest request;
    for (const auto& op : ops) *request.add_ops() = op;
    dtrain::ps::VectorReply reply;
    return stub_->Vector(&context, request, &reply);
  }

  grpc::Status done(int worker) {
    grpc::ClientContext context;
    dtrain::ps::DoneRequest request;
    request.set_worker(worker);
    dtrain::ps::PushReply reply;
    return stub_->Done(&context, request, &reply);
  }

 private:
  std::unique_ptr<dtrain::ps::ParameterServer::Stub> stub_;
};

dtrain::ps::VectorOp op(dtrain::ps::VectorOp::Kind kind, const std::string& dst,
                        const std::string& src = "", double alpha = 0.0) {
  dtrain::ps::VectorOp o;
  o.set_kind(kind);
  o.set_dst(dst);
  o.set_src(src);
  o.set_alpha(alpha);
  return o;
}

std::vector<double> ones(int64_t n) { return std::vector<double>(static_cast<size_t>(n), 1.0); }

}  // namespace

TEST(ParameterServerRobustness,
     AnIndependentClientsBadRequestsChangeNothingAndValidPushesAllApply) {
  ShardServerOptions options;
  options.optimizer.name = "sgd";
  options.optimizer.lr = kLr;
  options.max_workers = 8;
  ShardServer server(options);
  Raw raw(server.address());
  std::vector<double> start(kN);
  for (int64_t i = 0; i < kN; ++i) start[i] = 0.25 * static_cast<double>(i) - 3.0;
  auto init = chunk(0, start, 0);
  init.set_total(kN);
  ASSERT_TRUE(raw.stream(true, {init}).ok());
  int64_t version = -1;
  const at::Tensor initial = raw.pull(&version);
  ASSERT_EQ(version, 0);

  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  int refusals = 0, of_worker_1 = 0;
  auto refused = [&](const grpc::Status& status, const std::string& named, bool nonfinite = false) {
    ++refusals;
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << named;
    EXPECT_NE(status.error_message().find(named), std::string::npos) << status.error_message();
    EXPECT_EQ(status.error_details(), nonfinite ? "non-finite" : "") << status.error_message();
  };
  // Non-finite gradients: the worker and the first bad element are named, whatever chunk holds it.
  std::vector<double> g = ones(kN);
  g[5] = nan;
  g[9] = inf;
  refused(raw.push({chunk(0, g)}),
          "Push from worker 1: non-finite gradient: element 5 of the "
          "model's parameters is nan",
          true);
  g = ones(32);
  g[31] = inf;
  refused(raw.push({chunk(0, ones(32)), chunk(32, g)}),
          "element 63 of the model's parameters is inf", true);
  g = ones(8);
  g[0] = -inf;
  refused(raw.push({chunk(40, g)}), "element 40 of the model's parameters is -inf", true);
  of_worker_1 += 3;
  // Headers that do not match their data.
  refused(raw.push({chunk(0, ones(10), 1, 0, {int64_t{1} << 40, int64_t{1} << 40})}),
          "field 'shape' must be empty or the stream's length, 1 to 64 elements from offset 0 "
          "(got 2 dimensions)");
  refused(raw.push({chunk(0, ones(10), 1, 0, {-10})}), "(got -10)");
  refused(raw.push({chunk(0, ones(10), 1, 0, {int64_t{1} << 40})}), "(got 1099511627776)");
  refused(raw.push({chunk(0, ones(10), 1, 0, {20})}),
          "Push: field 'shape' says 20 elements, the chunks carry 10");
  refused(raw.push({chunk(0, ones(8), 1, 0, {16}), chunk(8, ones(8), 1, 0, {17})}),
          "field 'shape' differs from the first chunk's");
  of_worker_1 += 5;
  auto named = chunk(0, ones(4));
  named.mutable_chunk()->set_name("weights");
  refused(raw.push({named}), "field 'name' must be empty");
  auto with_total = chunk(0, ones(4));
  with_total.set_total(int64_t{1} << 40);
  refused(raw.push({with_total}), "field 'total' is 1099511627776, the model has 64 parameters");
  auto keyed = chunk(0, ones(4));
  keyed.set_round(3);
  refused(raw.push({keyed}), "fields 'round' and 'unit' belong to an accumulate push");
  auto long_name = chunk(0, ones(4), 1, 0);
  long_name.set_accumulate(std::string(100, 'v'));
  refused(raw.push({long_name}), "field 'accumulate' is 100 characters long (at most 64)");
  of_worker_1 += 4;
  // Worker ids: out of range, or changing within a stream.
  refused(raw.push({chunk(0, ones(4), -1)}), "Push: field 'worker' is -1 (0 to 7, --max-workers)");
  refused(raw.push({chunk(0, ones(4), 8)}), "field 'worker' is 8 (0 to 7");
  refused(raw.push({chunk(0, ones(4), 1), chunk(4, ones(4), 2)}),
          "field 'worker' is 2, the first chunk's 1");
  of_worker_1 += 1;
  {
    const grpc::Status status = raw.done(-5);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("Done: field 'worker' is -5"), std::string::npos)
        << status.error_message();
  }
  // Malformed vector commands (Sandblaster's): checked whole, and a batch that would leave the
  // parameters non-finite is refused whole too (its Copy into "w" did not happen).
  using Kind = dtrain::ps::VectorOp;
  auto vector_refused = [&](const std::vector<dtrain::ps::VectorOp>& ops,
                            const std::string& named) {
    const grpc::Status status = raw.vector(ops);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << named;
    EXPECT_NE(status.error_message().find(named), std::string::npos) << status.error_message();
  };
  vector_refused({op(Kind::SCALE, "x", "", nan)}, "vector op 0: field 'alpha' is not finite");
  vector_refused(
      {op(Kind::COPY, "w", "x"), op(Kind::SCALE, "x", "", 1e300), op(Kind::SCALE, "x", "", 1e300)},
      "the ops would leave the parameters non-finite (element 0 of the model's "
      "parameters is -inf); nothing changed");
  vector_refused({op(Kind::DOT, "x", "w")},
                 "field 'src' names vector 'w', which the shard does not have");
  vector_refused({op(Kind::ZERO, "v", "x")}, "field 'src' must be empty for this kind");
  vector_refused({op(Kind::COPY, "v", "x", 2.0)}, "field 'alpha' must be 0 for this kind");
  vector_refused({op(Kind::ZERO, std::string(65, 'v'))},
                 "field 'dst' must name a vector (1 to 64 characters)");
  vector_refused(std::vector<dtrain::ps::VectorOp>(5000, op(Kind::ZERO, "v")),
                 "5000 ops in one request");

  // Nothing changed; every refused push is counted, and worker 1's as its own.
  EXPECT_TRUE(at::equal(raw.pull(&version), initial));
  EXPECT_EQ(version, 0);
  dtrain::ps::ShardInfo info = raw.describe();
  EXPECT_EQ(info.version(), 0);
  EXPECT_EQ(info.refused_pushes(), refusals);
  EXPECT_EQ(info.max_workers(), 8);
  ASSERT_EQ(info.workers_size(), 1);
  EXPECT_EQ(info.workers(0).worker(), 1);
  EXPECT_EQ(info.workers(0).refused(), of_worker_1);
  EXPECT_EQ(info.workers(0).pushes(), 0);

  // 50 valid pushes after them all apply: SGD's result, in float64.
  at::Tensor expected = initial.clone();
  at::Generator generator = at::detail::createCPUGenerator(5);
  for (int i = 0; i < 50; ++i) {
    const at::Tensor gradient = at::randn({kN}, generator, at::kDouble);
    const std::vector<double> values(gradient.data_ptr<double>(), gradient.data_ptr<double>() + kN);
    const int worker = 1 + i % 3;
    const grpc::Status status =
        i % 2 == 0 ? raw.push({chunk(0, values, worker, i, {kN})})
                   : raw.push({chunk(0, {values.begin(), values.begin() + 40}, worker, i, {kN}),
                               chunk(40, {values.begin() + 40, values.end()}, worker, i)});
    ASSERT_TRUE(status.ok()) << "push " << i << ": " << status.error_message();
    expected.add_(gradient, -kLr);
  }
  const at::Tensor after = raw.pull(&version);
  EXPECT_EQ(version, 50);
  EXPECT_LE((after - expected).abs().max().item<double>(), 1e-12);
  info = raw.describe();
  int64_t pushes = 0;
  for (const auto& w : info.workers()) pushes += w.pushes();
  EXPECT_EQ(pushes, 50);
  EXPECT_EQ(info.refused_pushes(), refusals);
}

// PsClient (the Downpour worker's client) takes a refusal for a non-finite gradient as a lost
// update, not an error: the shard holding the bad element changes nothing, the other applies its
// finite range, and the worker goes on.
TEST(ParameterServerRobustness, PsClientReportsANonFiniteRefusalAsALostUpdate) {
  std::vector<std::unique_ptr<ShardServer>> servers;
  for (int i = 0; i < 2; ++i) {
    ShardServerOptions options;
    options.shard = i;
    options.shards = 2;
    options.optimizer.name = "sgd";
    options.optimizer.lr = kLr;
    servers.push_back(std::make_unique<ShardServer>(options));
  }
  PsClientOptions options;
  options.worker = 3;
  PsClient client({servers[0]->address(), servers[1]->address()}, options);
  client.initialize(at::zeros({kN}, at::kDouble));
  at::Tensor gradient = at::ones({kN}, at::kDouble);
  gradient[50] = std::numeric_limits<double>::quiet_NaN();
  PushResult result;
  ASSERT_NO_THROW(result = client.push(gradient, {0, 0}));
  EXPECT_TRUE(result.any_refused());
  EXPECT_EQ(result.refused[0], "");
  EXPECT_NE(result.refused[1].find("refused the push: Push from worker 3: non-finite gradient: "
                                   "element 50 of the model's parameters is nan"),
            std::string::npos)
      << result.refused[1];
  EXPECT_EQ(servers[0]->shard().version(), 1);
  EXPECT_EQ(servers[1]->shard().version(), 0);
  EXPECT_EQ(servers[1]->shard().workers().at(3).refused, 1);
  at::Tensor pulled = at::empty({kN}, at::kDouble);
  client.pull(pulled);
  EXPECT_TRUE(at::isfinite(pulled).all().item<bool>());
  // The next, finite push applies on both.
  gradient[50] = 1.0;
  result = client.push(gradient, {1, 0});
  EXPECT_FALSE(result.any_refused());
  EXPECT_EQ(servers[1]->shard().version(), 1);
}
