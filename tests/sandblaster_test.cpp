// Sandblaster L-BFGS, slice 1: the shards' vector commands are the unsharded vector arithmetic
// (malformed batches change nothing), and the coordinator's L-BFGS over the shards - which
// never holds a parameter-sized vector - reaches torch::optim::LBFGS's final loss on logistic
// regression of Fashion-MNIST pixels (and does not when a work unit is left out); fuzzed vector
// batches run whole or change nothing.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <filesystem>
#include <random>

#include "dtrain/common/Error.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/ps.grpc.pb.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/parallel/ps/Sandblaster.h"
#include "dtrain/parallel/ps/ShardServer.h"

using namespace dtrain;
using namespace dtrain::parallel::ps;

namespace {

struct Shards {
  std::vector<std::unique_ptr<ShardServer>> servers;
  std::vector<std::string> addresses;
  explicit Shards(int n) {
    for (int i = 0; i < n; ++i) {
      ShardServerOptions options;
      options.shard = i;
      options.shards = n;
      servers.push_back(std::make_unique<ShardServer>(options));
      addresses.push_back(servers.back()->address());
    }
  }
};

}  // namespace

TEST(Sandblaster, VectorCommandsAreTheUnshardedArithmeticAndBadOnesChangeNothing) {
  Shards shards(3);
  PsClient client(shards.addresses);
  const int64_t n = 1001;  // uneven slices
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor x = at::randn({n}, gen);
  client.initialize(x);
  const std::vector<double> dots = client.vector_ops({
      {VectorOp::Copy, "d", "x", 0.0},
      {VectorOp::Scale, "d", "", 2.0},
      {VectorOp::Axpy, "d", "x", 0.5},  // d = 2.5 x
      {VectorOp::Dot, "d", "x", 0.0},
      {VectorOp::Zero, "g", "", 0.0},
      {VectorOp::Axpy, "g", "d", -1.0},
      {VectorOp::Dot, "g", "g", 0.0},
  });
  const at::Tensor d = (x * 2.0 + x * 0.5).to(at::kDouble);
  ASSERT_EQ(dots.size(), 2u);
  EXPECT_NEAR(dots[0], at::dot(d, x.to(at::kDouble)).item<double>(), 1e-9 * std::abs(dots[0]));
  EXPECT_NEAR(dots[1], at::dot(d, d).item<double>(), 1e-9 * dots[1]);
  // Gradients accumulate into a named vector, never into x.
  client.accumulate(at::ones({n}), "g");
  client.accumulate(at::ones({n}), "g");
  EXPECT_NEAR(client.vector_ops({{VectorOp::Dot, "g", "x", 0.0}})[0],
              at::dot((2.0 - d), x.to(at::kDouble)).item<double>(), 1e-6 * n);
  EXPECT_THROW(client.accumulate(at::ones({n}), "x"), InputError);
  EXPECT_THROW(client.accumulate(at::ones({n}), "nowhere"), InputError);
  // A batch naming a missing vector is refused whole: its first op did not run.
  try {
    client.vector_ops({{VectorOp::Scale, "x", "", 0.0}, {VectorOp::Axpy, "x", "nowhere", 1.0}});
    ADD_FAILURE() << "a batch with a missing vector was run";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("vector op 1: field 'src' names vector 'nowhere'"),
              std::string::npos) << e.what();
  }
  at::Tensor pulled = at::zeros({n});
  client.pull(pulled);
  EXPECT_TRUE(at::equal(pulled, x));
  EXPECT_THROW(client.vector_ops({{VectorOp::Scale, "x", "", std::nan("")}}), InputError);
}

namespace {

// Multinomial logistic regression with an L2 term: strictly convex, one optimum.
constexpr double kL2 = 1e-2;

at::Tensor loss_of(const at::Tensor& w, const at::Tensor& b, const at::Tensor& x,
                   const at::Tensor& y, int64_t total) {
  return torch::nn::functional::cross_entropy(
             torch::addmm(b, x, w.t()), y,
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         static_cast<double>(total);
}

}  // namespace

TEST(Sandblaster, LbfgsOnTheShardsReachesTorchsLbfgsLoss) {
  if (!std::filesystem::exists(data::resolve_fashion_mnist_dir(""))) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup installs it)";
  }
  at::set_num_threads(1);
  const auto train = data::load_fashion_mnist("", data::Split::Train);
  const int64_t examples = 1000, units = 10, per_unit = examples / units;
  const data::Batch first = train.slice(0, examples);  // normalized pixels
  const at::Tensor x = first.inputs.reshape({examples, 784}).to(at::kFloat);
  const at::Tensor y = first.targets;
  auto full_loss = [&](const at::Tensor& w, const at::Tensor& b) {
    return loss_of(w, b, x, y, examples) + 0.5 * kL2 * w.pow(2).sum();
  };

  // The reference: single-process full-batch L-BFGS with a strong-Wolfe line search.
  at::Tensor w = torch::zeros({10, 784}, torch::requires_grad());
  at::Tensor b = torch::zeros({10}, torch::requires_grad());
  torch::optim::LBFGS reference({w, b}, torch::optim::LBFGSOptions(1.0)
                                            .max_iter(500)
                                            .max_eval(1000)
                                            .history_size(10)
                                            .tolerance_grad(1e-6)
                                            .tolerance_change(1e-12)
                                            .line_search_fn("strong_wolfe"));
  reference.step([&] {
    reference.zero_grad();
    at::Tensor l = full_loss(w, b);
    l.backward();
    return l;
  });
  const double expected = full_loss(w, b).item<double>();

  // Sandblaster: the model lives on 2 shards; each evaluation computes the work units' losses
  // and gradients at the shards' x and adds each unit's gradient into their g.
  auto sandblaster = [&](int64_t units_used, LbfgsResult* out) {
    Shards shards(2);
    PsClient client(shards.addresses);
    client.initialize(at::zeros({10 * 784 + 10}));
    at::Tensor flat = at::zeros({10 * 784 + 10});
    auto evaluate = [&] {
      client.pull(flat);
      at::Tensor wu = flat.slice(0, 0, 7840).view({10, 784}).clone().requires_grad_(true);
      at::Tensor bu = flat.slice(0, 7840).clone().requires_grad_(true);
      double f = 0;
      for (int64_t u = 0; u < units_used; ++u) {
        at::Tensor l = loss_of(wu, bu, x.slice(0, u * per_unit, (u + 1) * per_unit),
                               y.slice(0, u * per_unit, (u + 1) * per_unit), examples);
        if (u == 0) l = l + 0.5 * kL2 * wu.pow(2).sum();
        wu.mutable_grad() = at::Tensor();
        bu.mutable_grad() = at::Tensor();
        l.backward();
        client.accumulate(at::cat({wu.grad().reshape({-1}), bu.grad()}), "g");
        f += l.item<double>();
      }
      return f;
    };
    LbfgsOptions options;
    options.max_iterations = 500;
    options.tolerance_grad = 1e-6;
    options.tolerance_change = 1e-12;
    LbfgsCoordinator coordinator(client, options);
    *out = coordinator.run(evaluate);
    client.pull(flat);
    return full_loss(flat.slice(0, 0, 7840).view({10, 784}), flat.slice(0, 7840)).item<double>();
  };
  LbfgsResult result;
  const double got = sandblaster(units, &result);
  std::printf("torch LBFGS %.8f, Sandblaster %.8f (%d iterations, %d evaluations, %s)\n", expected,
              got, result.iterations, result.evaluations, result.stop_reason.c_str());
  EXPECT_LT(std::abs(got - expected) / expected, 1e-4);
  EXPECT_GT(result.iterations, 10);

  // A work unit left out: another objective, another optimum.
  LbfgsResult partial;
  const double without = sandblaster(units - 1, &partial);
  std::printf("without one work unit: %.8f\n", without);
  EXPECT_GT(std::abs(without - expected) / expected, 1e-4);
}

// Random vector batches (random kinds, names, alphas; some from random bytes): each is run
// whole or refused whole; a refused one leaves every vector as it was; nothing crashes.
TEST(Sandblaster, FuzzedVectorBatchesRunWholeOrChangeNothing) {
  Shards shards(1);
  PsClient client(shards.addresses);
  const int64_t n = 32;
  client.initialize(at::arange(n, at::kFloat));
  client.vector_ops({{VectorOp::Copy, "g", "x", 0.0}});
  auto stub = dtrain::ps::ParameterServer::NewStub(
      grpc::CreateChannel(shards.addresses[0], grpc::InsecureChannelCredentials()));
  auto state = [&] {  // x . x, g . g, x . g
    return client.vector_ops({{VectorOp::Dot, "x", "x", 0.0}, {VectorOp::Dot, "g", "g", 0.0},
                              {VectorOp::Dot, "x", "g", 0.0}});
  };
  std::mt19937 random(11);
  const std::vector<std::string> names = {"x", "g", "d", "", "nowhere", std::string(65, 'v')};
  int refused = 0, run = 0;
  for (int i = 0; i < 300; ++i) {
    dtrain::ps::VectorRequest request;
    if (i % 4 == 3) {
      std::string bytes(random() % 100, '\0');
      for (auto& b : bytes) b = static_cast<char>(random());
      if (!request.ParseFromString(bytes)) continue;
    } else {
      for (int k = 0, count = 1 + static_cast<int>(random() % 4); k < count; ++k) {
        auto* op = request.add_ops();
        op->set_kind(static_cast<dtrain::ps::VectorOp::Kind>(random() % 7));  // 5, 6 invalid
        op->set_dst(names[random() % names.size()]);
        op->set_src(names[random() % names.size()]);
        op->set_alpha(random() % 10 == 0 ? std::nan("") : 0.5);
      }
    }
    const auto before = state();
    grpc::ClientContext context;
    dtrain::ps::VectorReply reply;
    const grpc::Status status = stub->Vector(&context, request, &reply);
    if (status.ok()) {
      ++run;
      // Keep values bounded and "d" absent for the next batch to test creation again.
      client.vector_ops({{VectorOp::Copy, "x", "g", 0.0}});
    } else {
      ++refused;
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_EQ(state(), before) << status.error_message();
    }
  }
  EXPECT_GT(refused, 50);
  EXPECT_GT(run, 20);
  std::printf("%d batches run, %d refused\n", run, refused);
}
