// Parameter server: shard arithmetic against torch's optimizers and against one
// unsharded range, the gRPC shard service with a client (chunked streams, initialization by the
// first worker, Downpour with one worker equal to single-process SGD step for step), malformed
// and fuzzed messages refused with the field named and no state change, deadlines, the
// learning-rate schedule by version, shard checkpoints, tokens and TLS.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>

#include "TempDir.h"
#include "comm/rpc/TensorMessage.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/ps.grpc.pb.h"
#include "dtrain/services/ps/ParameterShard.h"
#include "dtrain/services/ps/ShardServer.h"

using namespace dtrain;
using namespace dtrain::parallel::ps;
using namespace dtrain::services::ps;
using namespace std::chrono_literals;

namespace {

at::Tensor random_vector(int64_t n, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randn({n}, g, dtype);
}

// Applies `steps` gradients with torch's optimizer to a copy of `start`.
at::Tensor torch_reference(const std::string& name, const at::Tensor& start,
                           const std::vector<at::Tensor>& grads, double lr) {
  at::Tensor p = start.clone().requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (name == "sgd")
    opt = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                              torch::optim::SGDOptions(lr));
  if (name == "adagrad") {
    opt = std::make_unique<torch::optim::Adagrad>(std::vector<at::Tensor>{p},
                                                  torch::optim::AdagradOptions(lr).eps(1e-10));
  }
  if (name == "adam")
    opt = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p},
                                               torch::optim::AdamOptions(lr));
  for (const auto& g : grads) {
    p.mutable_grad() = g.clone();
    opt->step();
  }
  return p.detach();
}

ShardOptimizer optimizer(const std::string& name, double lr) {
  ShardOptimizer o;
  o.name = name;
  o.lr = lr;
  return o;
}

}  // namespace

TEST(ParameterServer, ShardsSplitEvenlyAndApplyTorchsOptimizersOnTheirSlices) {
  // Balanced contiguous ranges, a large tensor spanning shards.
  EXPECT_EQ(shard_range(10, 0, 3), (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(shard_range(10, 1, 3), (std::pair<int64_t, int64_t>{3, 6}));
  EXPECT_EQ(shard_range(10, 2, 3), (std::pair<int64_t, int64_t>{6, 10}));
  const int64_t n = 101;
  // In float64, so the comparison with torch's optimizers is tight on any CPU.
  const at::Tensor start = random_vector(n, 1, at::kDouble);
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(random_vector(n, 10 + i, at::kDouble));
  for (const std::string name : {"sgd", "adagrad", "adam"}) {
    const at::Tensor expected = torch_reference(name, start, grads, 0.05);
    // Two shards, each updating its own slice, give what one unsharded update gives.
    at::Tensor joined = at::empty({n}, at::kDouble);
    for (int s = 0; s < 2; ++s) {
      ParameterShard shard(s, 2, optimizer(name, 0.05));
      const auto [begin, end] = shard_range(n, s, 2);
      ASSERT_EQ(shard.initialize(n, start.slice(0, begin, end).clone()), "");
      for (size_t i = 0; i < grads.size(); ++i) {
        int64_t version = -1, staleness = -1;
        ASSERT_EQ(shard.apply(begin, grads[i].slice(0, begin, end).contiguous(),
                              static_cast<int64_t>(i), 0, false, &version, &staleness, nullptr),
                  "");
        EXPECT_EQ(version, static_cast<int64_t>(i) + 1);
        EXPECT_EQ(staleness, 0);
      }
      int64_t version = 0;
      joined.slice(0, begin, end).copy_(shard.read(begin, end, &version));
      EXPECT_EQ(version, 4);
    }
    // One unsharded shard does the same arithmetic: bit for bit.
    ParameterShard whole(0, 1, optimizer(name, 0.05));
    ASSERT_EQ(whole.initialize(n, start.clone()), "");
    for (size_t i = 0; i < grads.size(); ++i) {
      int64_t version = -1, staleness = -1;
      ASSERT_EQ(whole.apply(0, grads[i], static_cast<int64_t>(i), 0, false, &version, &staleness,
                            nullptr),
                "");
    }
    EXPECT_TRUE(at::equal(joined, whole.read(0, n, nullptr))) << name;
    // Against torch's optimizer: a few ulps (Adam's bias corrections are ordered differently),
    // relative to the values' size.
    EXPECT_LT(((joined - expected).abs() / expected.abs().clamp_min(1.0)).max().item<double>(),
              1e-13)
        << name;
    EXPECT_GT((expected - start).abs().max().item<double>(), 1e-3) << name << " did not move";
  }
  // Refusals change nothing.
  ParameterShard shard(0, 1, optimizer("sgd", 0.1));
  ASSERT_EQ(shard.initialize(4, at::ones({4})), "");
  EXPECT_EQ(shard.initialize(4, at::ones({4})), "initialized");
  int64_t v = 0, st = 0;
  EXPECT_NE(shard.apply(0, at::ones({4}), 1, 0, false, &v, &st, nullptr)
                .find("a version from the future"),
            std::string::npos);
  EXPECT_NE(shard.apply(2, at::ones({4}), 0, 0, false, &v, &st, nullptr)
                .find("outside the shard's range [0, 4)"),
            std::string::npos);
  EXPECT_NE(shard.apply(0, at::ones({4}, at::kDouble), 0, 0, false, &v, &st, nullptr)
                .find("a gradient of Double for a shard of Float parameters"),
            std::string::npos);
  EXPECT_EQ(shard.version(), 0);
  EXPECT_TRUE(at::equal(shard.read(0, 4, nullptr), at::ones({4})));
  ParameterShard ints(0, 1, optimizer("sgd", 0.1));
  EXPECT_NE(ints.initialize(4, at::ones({4}, at::kLong)).find("float32 or float64"),
            std::string::npos);
  EXPECT_FALSE(ints.initialized());
  EXPECT_THROW(ParameterShard(2, 2, optimizer("sgd", 0.1)), InputError);
  EXPECT_THROW(ParameterShard(0, 1, optimizer("rmsprop", 0.1)), InputError);
}

namespace {

struct TwoShards {
  std::vector<std::unique_ptr<ShardServer>> servers;
  std::vector<std::string> addresses;
  explicit TwoShards(const std::string& opt, double lr = 0.1) {
    for (int s = 0; s < 2; ++s) {
      ShardServerOptions options;
      options.shard = s;
      options.shards = 2;
      options.optimizer = optimizer(opt, lr);
      servers.push_back(std::make_unique<ShardServer>(options));
      addresses.push_back(servers.back()->address());
    }
  }
};

torch::nn::Sequential small_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 5));
}

}  // namespace

// DistBelief's Downpour with one worker and n_fetch = n_push = 1 on a server running SGD is
// plain SGD: fetch, compute, push, repeat.
TEST(ParameterServer, OneDownpourWorkerTrainsLikeSingleProcessSgd) {
  TwoShards ps("sgd", 0.1);
  PsClientOptions options;
  options.chunk_bytes = 256;  // many chunks per tensor
  PsClient client(ps.addresses, options);
  // In float64 (the shards take the dtype of Initialize), so the bound is tight on any CPU.
  auto worker = small_mlp();
  auto reference = small_mlp();
  worker->to(at::kDouble);
  reference->to(at::kDouble);
  const at::Tensor initial = torch::nn::utils::parameters_to_vector(worker->parameters()).detach();
  EXPECT_TRUE(client.initialize(initial));
  // A second worker finds the shards initialized and keeps the first one's values.
  PsClient second(ps.addresses, options);
  EXPECT_FALSE(second.initialize(at::zeros_like(initial)));

  torch::optim::SGD sgd(reference->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor flat = at::empty_like(initial);
  for (int step = 0; step < 5; ++step) {
    const at::Tensor x = random_vector(8 * 12, 100 + step, at::kDouble).view({8, 12});
    const at::Tensor y = at::randint(5, {8}, at::detail::createCPUGenerator(200 + step), at::kLong);
    const auto versions = client.pull(flat);
    EXPECT_EQ(versions, std::vector<int64_t>(2, step));
    {
      torch::NoGradGuard no_grad;
      torch::nn::utils::vector_to_parameters(flat, worker->parameters());
    }
    worker->zero_grad();
    torch::nn::functional::cross_entropy(worker->forward(x), y).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : worker->parameters()) grads.push_back(p.grad().view({-1}));
    const auto pushed = client.push(at::cat(grads), versions);
    EXPECT_EQ(pushed.staleness, std::vector<int64_t>(2, 0));
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    sgd.step();
  }
  client.pull(flat);
  const at::Tensor expected =
      torch::nn::utils::parameters_to_vector(reference->parameters()).detach();
  EXPECT_LT((flat - expected).abs().max().item<double>(), 1e-12);
  EXPECT_GT((expected - initial).abs().max().item<double>(), 1e-3);
  // The shards hold float64 now: a float32 client is told so, and a float32 push is refused.
  PsClient single(ps.addresses, options);
  EXPECT_THROW(
      {
        try {
          single.initialize(initial.to(at::kFloat));
        } catch (const InputError& e) {
          EXPECT_NE(std::string(e.what()).find("holds FLOAT64 parameters, this worker's are Float"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      InputError);
  EXPECT_THROW(single.push(at::zeros_like(initial, at::kFloat), {5, 5}), InputError);
  client.pull(flat);
  EXPECT_LT((flat - expected).abs().max().item<double>(),
            1e-12);  // the refused push changed nothing
}

namespace {

grpc::Status push_raw(dtrain::ps::ParameterServer::Stub& stub,
                      const std::vector<dtrain::ps::PushChunk>& chunks) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 5s);
  dtrain::ps::PushReply reply;
  auto writer = stub.Push(&context, &reply);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

dtrain::ps::PushChunk gradient_chunk(int64_t offset, int64_t n, int64_t version = 0) {
  dtrain::ps::PushChunk c;
  c.set_computed_version(version);
  c.mutable_chunk()->set_dtype(comm::rpc::FLOAT32);
  c.mutable_chunk()->set_offset(offset);
  const std::vector<float> data(n, 1.0f);
  c.mutable_chunk()->set_data(data.data(), n * sizeof(float));
  return c;
}

}  // namespace

// A pull sends the shard's values without copying them; an update while a view is held writes
// into a copy (the view keeps its version), and once no view is held updates stay in place.
TEST(ParameterServer, PullsShareTheValuesAndUpdatesCopyOnlyWhileAViewIsHeld) {
  ParameterShard shard(0, 1, optimizer("sgd", 1.0));
  ASSERT_EQ(shard.initialize(6, at::zeros({6})), "");
  auto where = [&] { return shard.share(0, 1, nullptr).data_ptr(); };
  const void* first = where();
  int64_t version = -1, v = 0, st = 0;
  const at::Tensor view = shard.share(2, 5, &version);
  EXPECT_EQ(version, 0);
  EXPECT_EQ(view.data_ptr(), static_cast<const char*>(first) + 2 * sizeof(float));
  ASSERT_EQ(shard.apply(0, at::ones({6}), 0, 0, false, &v, &st, nullptr), "");
  EXPECT_TRUE(at::equal(view, at::zeros({3})));  // still version 0
  EXPECT_TRUE(at::equal(shard.read(0, 6, nullptr), -at::ones({6})));
  const void* second = where();
  EXPECT_NE(second, first);
  ASSERT_EQ(shard.apply(0, at::ones({6}), 1, 0, false, &v, &st, nullptr), "");
  EXPECT_EQ(where(), second);  // no view held: in place
  // Over gRPC: a finished pull leaves no view behind, so the next push updates in place.
  ShardServerOptions options;
  options.optimizer = optimizer("sgd", 1.0);
  ShardServer server(options);
  PsClient client({server.address()});
  client.initialize(at::zeros({1000}));
  at::Tensor flat = at::empty({1000});
  const auto versions = client.pull(flat);
  const void* before = server.shard().share(0, 1, nullptr).data_ptr();
  client.push(at::ones({1000}), versions);
  EXPECT_EQ(server.shard().share(0, 1, nullptr).data_ptr(), before);
  client.pull(flat);
  EXPECT_TRUE(at::equal(flat, -at::ones({1000})));
}

TEST(ParameterServer, MalformedAndFuzzedMessagesAreRefusedAndChangeNothing) {
  ShardServerOptions options;
  options.optimizer = optimizer("sgd", 0.1);
  ShardServer server(options);
  PsClient client({server.address()});
  const int64_t n = 64;
  client.initialize(random_vector(n, 4));
  auto stub = dtrain::ps::ParameterServer::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  at::Tensor before = at::empty({n});
  client.pull(before);

  auto refused = [&](const std::vector<dtrain::ps::PushChunk>& chunks, const std::string& field) {
    const grpc::Status status = push_raw(*stub, chunks);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(status.error_message().find(field), std::string::npos) << status.error_message();
  };
  auto wrong_dtype = gradient_chunk(0, 8);
  wrong_dtype.mutable_chunk()->set_dtype(comm::rpc::FLOAT64);
  refused({wrong_dtype}, "field 'dtype' is FLOAT64, expected FLOAT32");
  refused({gradient_chunk(60, 8)}, "field 'offset' 60 with 8 elements is outside [0, 64)");
  refused({gradient_chunk(0, 8, 5)},
          "field 'computed_version' is 5, but the shard is at version 0");
  refused({gradient_chunk(0, 8), gradient_chunk(16, 8)}, "field 'offset' is 16, expected 8");
  auto ragged = gradient_chunk(0, 8);
  ragged.mutable_chunk()->mutable_data()->push_back('x');
  refused({ragged}, "not a whole number of FLOAT32 elements");
  auto oversized = gradient_chunk(0, 1);
  oversized.mutable_chunk()->set_data(std::string(comm::rpc::kMaxChunkBytes + 4, '\0'));
  refused({oversized}, "field 'data' holds");
  {
    grpc::ClientContext context;
    dtrain::ps::PullRequest request;
    request.set_begin(10);
    request.set_end(100);
    auto reader = stub->Pull(&context, request);
    dtrain::ps::PullChunk ignored;
    while (reader->Read(&ignored)) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("fields 'begin', 'end' ask for [10, 100)"),
              std::string::npos);
  }

  // Fuzz: random bytes and single-byte mutations of a valid message. Whatever is refused
  // leaves the version and the values as they were; nothing crashes the server.
  std::mt19937 random(7);
  std::string valid;
  gradient_chunk(0, 16).SerializeToString(&valid);
  const size_t payload = 16 * sizeof(float);  // the data bytes, at the end of the encoding
  int accepted = 0, refusals = 0, parsed = 0;
  for (int i = 0; i < 300; ++i) {
    std::string bytes;
    if (i % 3 == 0) {  // random bytes
      bytes.resize(random() % 200);
      for (auto& b : bytes) b = static_cast<char>(random());
    } else if (i % 3 == 1) {  // one byte of a valid message's fields (not its data) changed
      bytes = valid;
      bytes[random() % (bytes.size() - payload)] = static_cast<char>(random());
    } else {  // well-formed protobuf with random field values
      auto m = gradient_chunk(static_cast<int64_t>(random() % 90) - 10, random() % 24,
                              static_cast<int64_t>(random() % 4) - 1);
      m.mutable_chunk()->set_dtype(static_cast<comm::rpc::DType>(random() % 4));
      if (random() % 4 == 0) m.mutable_chunk()->mutable_data()->resize(random() % 100);
      m.SerializeToString(&bytes);
    }
    dtrain::ps::PushChunk message;
    if (!message.ParseFromString(bytes)) continue;
    ++parsed;
    const int64_t version_before = server.shard().version();
    at::Tensor values_before = at::empty({n});
    client.pull(values_before);
    const grpc::Status status = push_raw(*stub, {message});
    at::Tensor values_after = at::empty({n});
    client.pull(values_after);
    if (status.ok()) {
      ++accepted;
      EXPECT_EQ(server.shard().version(), version_before + 1);
    } else {
      ++refusals;
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_EQ(server.shard().version(), version_before);
      EXPECT_TRUE(at::equal(values_before, values_after)) << status.error_message();
    }
  }
  EXPECT_GT(refusals, 50) << parsed << " parsed, " << accepted << " accepted";
  EXPECT_GT(accepted, 3) << parsed << " parsed";
  // The valid pushes among the mutations did apply; the server still answers normally.
  at::Tensor after = at::empty({n});
  EXPECT_EQ(client.pull(after)[0], server.shard().version());
  EXPECT_EQ(server.shard().version(), accepted);
}

TEST(ParameterServer, AShardThatNeverAnswersIsNamedWithinTheDeadline) {
  const int port = free_port();  // nothing listens there
  PsClientOptions options;
  options.rpc_timeout = 700ms;
  const auto start = std::chrono::steady_clock::now();
  try {
    PsClient client({"127.0.0.1:" + std::to_string(port)}, options);
    ADD_FAILURE() << "a client to a missing shard was made";
  } catch (const TimeoutError& e) {
    const std::string text = e.what();
    EXPECT_NE(text.find("parameter server 127.0.0.1:" + std::to_string(port) +
                        ": Describe got no answer within 700 ms"),
              std::string::npos)
        << text;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  // Shards listed out of order are named.
  TwoShards ps("adagrad");
  try {
    PsClient client({ps.addresses[1], ps.addresses[0]});
    ADD_FAILURE() << "shards out of order were accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("is shard 1/2, but it was given as shard 0 of 2"),
              std::string::npos)
        << e.what();
  }
}

// The learning-rate schedule runs on the shard, by version: warmup then cosine decay, as the
// Trainer's schedule does by step.
TEST(ParameterServer, TheShardAppliesTheLearningRateScheduleByVersion) {
  ShardOptimizer o = optimizer("sgd", 0.2);
  o.schedule.decay = "cosine";
  o.schedule.warmup_steps = 3;
  o.total_versions = 10;
  ParameterShard shard(0, 1, o);
  ASSERT_EQ(shard.initialize(2, at::zeros({2})), "");
  const optim::LrSchedule expected(0.2, 10, o.schedule);
  for (int64_t v = 0; v < 10; ++v) {
    int64_t version = 0, staleness = 0;
    double lr = 0;
    EXPECT_DOUBLE_EQ(shard.current_lr(), expected.at(v));
    const at::Tensor before = shard.read(0, 2, nullptr);
    ASSERT_EQ(shard.apply(0, at::ones({2}), v, 0, false, &version, &staleness, &lr), "");
    EXPECT_DOUBLE_EQ(lr, expected.at(v)) << v;
    // SGD moved the values by exactly that rate.
    EXPECT_NEAR((before - shard.read(0, 2, nullptr))[0].item<double>(), expected.at(v), 1e-6);
  }
  EXPECT_LT(expected.at(9), expected.at(3));  // it did decay
  o.total_versions = 0;
  EXPECT_THROW(ParameterShard(0, 1, o), InputError);  // cosine needs its end
}

// A shard checkpoint restores values, optimizer state and version exactly; a damaged file or
// another shard's is refused with the file named.
TEST(ParameterServer, ShardCheckpointsRoundTripAndDamagedOnesAreNamed) {
  dtrain::test::TempDir dir;
  for (const std::string name : {"adagrad", "adam", "adam64"}) {
    // adam64: a float64 shard keeps its dtype through the file.
    const at::ScalarType dtype = name == "adam64" ? at::kDouble : at::kFloat;
    const std::string opt = name == "adam64" ? "adam" : name;
    ParameterShard shard(1, 2, optimizer(opt, 0.05));
    ASSERT_EQ(shard.initialize(10, random_vector(5, 1, dtype)), "");
    int64_t version = 0, staleness = 0;
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(shard.apply(5, random_vector(5, 10 + i, dtype), i, 0, false, &version, &staleness,
                            nullptr),
                "");
    }
    const std::string file = dir / (name + ".pt");
    EXPECT_EQ(shard.save(file), 3);
    ParameterShard restored(1, 2, optimizer(opt, 0.05));
    EXPECT_EQ(restored.load(file), 3);
    EXPECT_EQ(restored.version(), 3);
    EXPECT_EQ(restored.dtype(), dtype);
    // The next update is the same on both: the optimizer state came back too.
    ASSERT_EQ(
        shard.apply(5, random_vector(5, 20, dtype), 3, 0, false, &version, &staleness, nullptr),
        "");
    ASSERT_EQ(
        restored.apply(5, random_vector(5, 20, dtype), 3, 0, false, &version, &staleness, nullptr),
        "");
    EXPECT_TRUE(at::equal(shard.read(5, 10, nullptr), restored.read(5, 10, nullptr))) << name;
    ParameterShard other(0, 2, optimizer(opt, 0.05));
    try {
      other.load(file);
      ADD_FAILURE() << "another shard's checkpoint was loaded";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("belongs to shard 1/2, this is shard 0/2"),
                std::string::npos)
          << e.what();
    }
  }
  std::FILE* f = std::fopen((dir / "bad.pt").c_str(), "w");
  std::fputs("not a checkpoint", f);
  std::fclose(f);
  ParameterShard shard(0, 1, optimizer("sgd", 0.1));
  try {
    shard.load(dir / "bad.pt");
    ADD_FAILURE() << "a damaged checkpoint was loaded";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "bad.pt"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(shard.initialized());
}

// With a token, every call must carry it: none or a wrong one is UNAUTHENTICATED (named); with
// TLS, a client trusting the certificate trains and a plaintext one is refused.
TEST(ParameterServer, TokensAndTlsGuardEveryCall) {
  dtrain::test::TempDir dir;
  ShardServerOptions options;
  options.auth_token = "s3cret-token";
  ShardServer server(options);
  auto expect_refused = [&](const std::string& token) {
    PsClientOptions client;
    client.rpc_timeout = 2000ms;
    client.auth_token = token;
    try {
      PsClient c({server.address()}, client);
      ADD_FAILURE() << "a call with token '" << token << "' was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("refused Describe as unauthenticated"),
                std::string::npos)
          << e.what();
    }
  };
  expect_refused("");
  expect_refused("s3cret-tokeN");
  expect_refused("s3cret-token-and-more");
  PsClientOptions good;
  good.auth_token = "s3cret-token";
  PsClient client({server.address()}, good);
  EXPECT_TRUE(client.initialize(at::ones({6})));
  at::Tensor flat = at::zeros({6});
  client.pull(flat);
  EXPECT_TRUE(at::equal(flat, at::ones({6})));
  // Raw call without metadata: the status itself.
  auto stub = dtrain::ps::ParameterServer::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  dtrain::ps::ShardInfo info;
  EXPECT_EQ(stub->Describe(&context, {}, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed: the TLS half of this test needs it to make a "
                    "throwaway certificate (scripts/setup installs it)";
  }
  const std::string make_cert =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
      (dir / "key.pem") + " -out " + (dir / "cert.pem") + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(make_cert.c_str()), 0) << make_cert;
  ShardServerOptions tls_options;
  tls_options.tls_cert = dir / "cert.pem";
  tls_options.tls_key = dir / "key.pem";
  ShardServer tls_server(tls_options);
  PsClientOptions tls_client;
  tls_client.tls = true;
  tls_client.tls_ca = dir / "cert.pem";
  PsClient secure({tls_server.address()}, tls_client);
  EXPECT_TRUE(secure.initialize(at::full({4}, 2.0)));
  at::Tensor pulled = at::zeros({4});
  secure.pull(pulled);
  EXPECT_TRUE(at::equal(pulled, at::full({4}, 2.0)));
  PsClientOptions plain;
  plain.rpc_timeout = 1500ms;
  EXPECT_THROW(PsClient({tls_server.address()}, plain), Error);
}
