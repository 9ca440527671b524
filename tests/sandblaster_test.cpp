// Sandblaster L-BFGS, slice 1: the shards' vector commands are the unsharded vector arithmetic
// (malformed batches change nothing), and the coordinator's L-BFGS over the shards - which
// never holds a parameter-sized vector - reaches torch::optim::LBFGS's final loss on logistic
// regression of Fashion-MNIST pixels (and does not when a work unit is left out); fuzzed vector
// batches run whole or change nothing.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/parallel/ps/Sandblaster.h"
#include "dtrain/parallel/ps/WorkQueue.h"
#include "dtrain/ps.grpc.pb.h"
#include "dtrain/sandblaster.grpc.pb.h"
#include "dtrain/services/ps/ShardServer.h"
#include "dtrain/services/ps/WorkCoordinator.h"

using namespace dtrain;
using namespace dtrain::parallel::ps;
using namespace dtrain::services::ps;

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
              std::string::npos)
        << e.what();
  }
  at::Tensor pulled = at::zeros({n});
  client.pull(pulled);
  EXPECT_TRUE(at::equal(pulled, x));
  EXPECT_THROW(client.vector_ops({{VectorOp::Scale, "x", "", std::nan("")}}), InputError);
}

namespace {

// Multinomial logistic regression with an L2 term: strictly convex, one optimum.
constexpr double kL2 = 5e-2;

at::Tensor loss_of(const at::Tensor& w, const at::Tensor& b, const at::Tensor& x,
                   const at::Tensor& y, int64_t total) {
  return torch::nn::functional::cross_entropy(
             torch::addmm(b, x, w.t()), y,
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         static_cast<double>(total);
}

// Full-batch L-BFGS in one process (strong-Wolfe line search): the reference Sandblaster must
// reach. Loss: mean cross-entropy of a linear model plus 0.5 * l2 * |W|^2 (and |b|^2 when
// `bias_too`).
double torch_lbfgs_loss(const at::Tensor& x, const at::Tensor& y, double l2, bool bias_too) {
  const int64_t n = x.size(0), features = x.size(1);
  at::Tensor w = torch::zeros({10, features}, x.options().requires_grad(true));
  at::Tensor b = torch::zeros({10}, x.options().requires_grad(true));
  auto full_loss = [&] {
    at::Tensor l = loss_of(w, b, x, y, n) + 0.5 * l2 * w.pow(2).sum();
    return bias_too ? l + 0.5 * l2 * b.pow(2).sum() : l;
  };
  torch::optim::LBFGS reference({w, b}, torch::optim::LBFGSOptions(1.0)
                                            .max_iter(500)
                                            .max_eval(1000)
                                            .history_size(10)
                                            .tolerance_grad(1e-6)
                                            .tolerance_change(1e-12)
                                            .line_search_fn("strong_wolfe"));
  reference.step([&] {
    reference.zero_grad();
    at::Tensor l = full_loss();
    l.backward();
    return l;
  });
  return full_loss().item<double>();
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
  // In float64 (the shards take Initialize's dtype), so the bound holds on any CPU.
  const at::Tensor x = first.inputs.reshape({examples, 784}).to(at::kDouble);
  const at::Tensor y = first.targets;
  auto full_loss = [&](const at::Tensor& w, const at::Tensor& b) {
    return loss_of(w, b, x, y, examples) + 0.5 * kL2 * w.pow(2).sum();
  };

  // The reference: single-process full-batch L-BFGS with a strong-Wolfe line search.
  const double expected = torch_lbfgs_loss(x, y, kL2, false);

  // Sandblaster: the model lives on 2 shards; each evaluation computes the work units' losses
  // and gradients at the shards' x and adds each unit's gradient into their g.
  auto sandblaster = [&](int64_t units_used, LbfgsResult* out) {
    Shards shards(2);
    PsClient client(shards.addresses);
    client.initialize(at::zeros({10 * 784 + 10}, at::kDouble));
    at::Tensor flat = at::zeros({10 * 784 + 10}, at::kDouble);
    auto evaluate = [&](int64_t round) {
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
        const at::Tensor gradient = at::cat({wu.grad().reshape({-1}), bu.grad()});
        EXPECT_EQ(client.accumulate(gradient, "g", round, u), 0);
        // A backup copy of the unit finishing second, and a late copy of the previous round,
        // are ignored by every shard.
        if (u == 1) {
          EXPECT_EQ(client.accumulate(gradient, "g", round, u), 2);
        }
        if (u == 2 && round > 1) {
          EXPECT_EQ(client.accumulate(gradient, "g", round - 1, u), 2);
        }
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
    return client.vector_ops({{VectorOp::Dot, "x", "x", 0.0},
                              {VectorOp::Dot, "g", "g", 0.0},
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
        const auto kind = static_cast<dtrain::ps::VectorOp::Kind>(random() % 7);  // 5, 6 invalid
        op->set_kind(kind);
        op->set_dst(names[random() % names.size()]);
        // Mostly the fields the kind uses; now and then one it does not (refused).
        const bool reads_src = kind == dtrain::ps::VectorOp::COPY ||
                               kind == dtrain::ps::VectorOp::AXPY ||
                               kind == dtrain::ps::VectorOp::DOT;
        const bool uses_alpha =
            kind == dtrain::ps::VectorOp::SCALE || kind == dtrain::ps::VectorOp::AXPY;
        if (reads_src || random() % 16 == 0) op->set_src(names[random() % names.size()]);
        if (uses_alpha || random() % 16 == 0)
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

// The work queue hands out every unit once, then backup copies of the units still running;
// the first report of a unit counts; a unit whose worker went silent is handed out again.
TEST(Sandblaster, WorkUnitsBackupCopiesAndLostUnits) {
  using std::chrono::milliseconds;
  WorkQueueOptions options;
  options.min_lost = milliseconds(200);
  WorkQueue queue(options);
  queue.open(1, 3);
  const Assignment a = queue.next(0, milliseconds(0));
  const Assignment b = queue.next(1, milliseconds(0));
  const Assignment c = queue.next(2, milliseconds(0));
  ASSERT_EQ(a.kind, Assignment::Unit);
  EXPECT_EQ(std::vector<int64_t>({a.unit, b.unit, c.unit}), std::vector<int64_t>({0, 1, 2}));
  EXPECT_FALSE(a.backup || b.backup || c.backup);
  EXPECT_TRUE(queue.finish(2, 1, 2, 0.25, 0.01));
  // Worker 2 is idle: it gets a backup copy of the unit running longest (unit 0).
  const Assignment backup = queue.next(2, milliseconds(0));
  ASSERT_EQ(backup.kind, Assignment::Unit);
  EXPECT_EQ(backup.unit, 0);
  EXPECT_TRUE(backup.backup);
  EXPECT_TRUE(queue.finish(2, 1, 0, 0.5, 0.01));   // the backup wins
  EXPECT_FALSE(queue.finish(0, 1, 0, 0.5, 0.01));  // the original, late: does not count
  EXPECT_FALSE(queue.finish(0, 1, 2, 0.5, 0.01));  // a unit already done
  // Unit 1's worker went silent: past the lost bound, an idle worker gets it again (a second
  // copy is a backup already, so with backups off it is the lost-unit rule that hands it out).
  WorkQueueOptions no_backups = options;
  no_backups.backup_tasks = false;
  WorkQueue quiet(no_backups);
  quiet.open(1, 2);
  quiet.next(0, milliseconds(0));
  quiet.next(1, milliseconds(0));
  EXPECT_TRUE(quiet.finish(0, 1, 0, 1.0, 0.001));
  EXPECT_EQ(quiet.next(0, milliseconds(0)).kind, Assignment::Wait);  // no backups, not lost yet
  const Assignment again = quiet.next(0, milliseconds(2000));
  ASSERT_EQ(again.kind, Assignment::Unit);
  EXPECT_EQ(again.unit, 1);
  EXPECT_TRUE(quiet.finish(0, 1, 1, 2.0, 0.001));
  EXPECT_DOUBLE_EQ(quiet.wait_round(milliseconds(100)), 3.0);
  EXPECT_EQ(quiet.stats().reissued, 1);
  EXPECT_EQ(quiet.stats().backups_won, 1);
  // A round nobody finishes is an error naming the missing units within the bound; a closed
  // queue tells workers the run is over.
  quiet.open(2, 2);
  try {
    quiet.wait_round(milliseconds(300));
    ADD_FAILURE() << "a stalled round was waited for forever";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("unit 0 (not handed out), unit 1"), std::string::npos)
        << e.what();
  }
  quiet.close("stop");
  const Assignment done = quiet.next(1, milliseconds(0));
  EXPECT_EQ(done.kind, Assignment::Done);
  EXPECT_EQ(done.reason, "stop");
  EXPECT_EQ(quiet.workers_not_told_done(), std::vector<int>({0}));
}

// Tapered units: the last 2 x workers are a half and a quarter of the others, contiguous and
// covering the set (equal when there are too few units); an idle worker gets a backup copy only
// where its copy would finish first (from the speeds its reports measured), or of a unit running
// past what its worker's speed predicts.
TEST(Sandblaster, TaperedUnitsEndSmallAndBackupsGoWhereACopyFinishesFirst) {
  using std::chrono::milliseconds;
  const std::vector<int64_t> tapered = unit_bounds(7000, 20, 2, true);
  ASSERT_EQ(tapered.size(), 21u);
  EXPECT_EQ(tapered.front(), 0);
  EXPECT_EQ(tapered.back(), 7000);
  auto size = [&](const std::vector<int64_t>& b, size_t i) { return b[i + 1] - b[i]; };
  EXPECT_EQ(size(tapered, 0), 400);  // 7000 * 4 / (4 * 16 + 2 * 2 + 2 * 1)
  EXPECT_EQ(size(tapered, 16), 200);
  EXPECT_EQ(size(tapered, 19), 100);
  const std::vector<int64_t> equal = unit_bounds(7000, 20, 2, false);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(size(equal, i), 350);
  EXPECT_EQ(unit_bounds(7000, 6, 2, true), unit_bounds(7000, 6, 2, false));  // too few to taper

  WorkQueueOptions options;
  options.tapered_units = false;
  options.workers = 2;
  WorkQueue queue(options);
  EXPECT_EQ(queue.check_examples(0, 1200), "");
  queue.open(1, 4);
  // Worker 1 computes 300 examples in 0.3 s, worker 0 in 0.9 s (the reports set the speeds).
  const Assignment first = queue.next(1, milliseconds(0));
  EXPECT_EQ(std::make_pair(first.begin, first.end), std::make_pair(int64_t{0}, int64_t{300}));
  queue.next(0, milliseconds(0));
  EXPECT_TRUE(queue.finish(1, 1, 0, 0.1, 0.3));
  EXPECT_TRUE(queue.finish(0, 1, 1, 0.1, 0.9));
  EXPECT_EQ(queue.next(1, milliseconds(0)).unit, 2);
  EXPECT_EQ(queue.next(0, milliseconds(0)).unit, 3);
  EXPECT_TRUE(queue.finish(0, 1, 3, 0.1, 0.9));
  // The slow worker idle, the fast one due in 0.3 s: a copy taking 0.9 s would not win.
  EXPECT_EQ(queue.next(0, milliseconds(0)).kind, Assignment::Wait);
  // Past 0.3 s the unit runs longer than its worker's speed predicts: then it is copied.
  std::this_thread::sleep_for(milliseconds(350));
  const Assignment late = queue.next(0, milliseconds(0));
  EXPECT_EQ(late.kind, Assignment::Unit);
  EXPECT_EQ(late.unit, 2);
  EXPECT_TRUE(late.backup);
  // The other way round: the fast worker idle while the slow one holds the last unit.
  queue.open(2, 4);
  EXPECT_EQ(queue.next(0, milliseconds(0)).unit, 0);
  for (int64_t unit = 1; unit < 4; ++unit) {
    EXPECT_EQ(queue.next(1, milliseconds(0)).unit, unit);
    EXPECT_TRUE(queue.finish(1, 2, unit, 0.1, 0.3));
  }
  const Assignment copy = queue.next(1, milliseconds(0));
  EXPECT_EQ(copy.kind, Assignment::Unit);
  EXPECT_EQ(copy.unit, 0);
  EXPECT_TRUE(copy.backup);
}

namespace {

struct Output {
  int code = -1;
  std::string text;
};

Output run(const std::string& command) {
  Output out;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe)) out.text += buffer;
  const int status = ::pclose(pipe);
  out.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

double metric(const std::string& all, const std::string& key) {
  const auto at = all.rfind("\"" + key + "\":");
  return at == std::string::npos ? -1.0 : std::atof(all.c_str() + at + key.size() + 3);
}

}  // namespace

// `dtrain train --strategy sandblaster` over worker processes: logistic regression of the
// synthetic set reaches single-process L-BFGS's loss within 1e-4 relative, even though worker 1
// dies holding a work unit (after pushing its gradient, before reporting it): the unit is handed
// out again, its second gradient ignored by the shards, and the run completes.
TEST(Sandblaster, WorkerProcessesReachTorchsLbfgsLossWhenAWorkerDiesHoldingAUnit) {
  const int64_t examples = 1000;
  const double l2 = 1e-2;
  const data::TensorDataset set = data::make_synthetic(examples, {1, 28, 28}, 10, 3);
  const data::Batch all = set.slice(0, examples);
  at::set_num_threads(1);
  const double expected =
      torch_lbfgs_loss(all.inputs.reshape({examples, 784}).to(at::kFloat), all.targets, l2, true);
  const std::string dir = ::testing::TempDir() + "sandblaster-processes";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const Output out =
      run("DTRAIN_SIMULATE_FAILURE=1:5 " + std::string(DTRAIN_CLI_PATH) +
          " train --strategy sandblaster --nproc 3 --ps-shards 2 --threads 1 --dataset synthetic "
          "--synthetic-examples 1000 --seed 3 --model linear --weight-decay 0.01 --max-steps 300 "
          "--work-units 20 --no-backup-tasks --no-progress --eval-every 5 --defer-eval --metrics " +
          dir +
          "/m.jsonl "
          "--checkpoint-dir " +
          dir + "/ckpt");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_NE(out.text.find("rank 1 kills itself"), std::string::npos) << out.text;
  std::ifstream file(dir + "/m.jsonl");
  const std::string metrics((std::istreambuf_iterator<char>(file)),
                            std::istreambuf_iterator<char>());
  const double got = metric(metrics, "final_loss");
  std::printf("torch LBFGS %.8f, Sandblaster over processes %.8f (%g iterations, %g reissued)\n",
              expected, got, metric(metrics, "iterations"), metric(metrics, "units_reissued"));
  EXPECT_LT(std::abs(got - expected) / expected, 1e-4) << metrics;
  EXPECT_GE(metric(metrics, "units_reissued"), 1) << metrics;
  EXPECT_EQ(metric(metrics, "worker1_units"), 4) << metrics;  // its 5th never reported
  // Iteration 5's parameters were kept and evaluated after the run (--defer-eval).
  EXPECT_NE(metrics.find("\"deferred\":1,\"epoch\":0,\"event\":\"eval\",\"seconds\""),
            std::string::npos)
      << metrics;
  EXPECT_NE(out.text.find("sandblaster: L-BFGS stopped after"), std::string::npos) << out.text;
  EXPECT_EQ(run(std::string(DTRAIN_CLI_PATH) + " ckpt verify " + dir + "/ckpt").code, 0);
}

// The coordinator's service: without the token a call is UNAUTHENTICATED; random and mutated
// requests are answered (OK, or INVALID_ARGUMENT / FAILED_PRECONDITION naming the field) and a
// refused one changes nothing; keyed pushes with a bad unit are refused by the shard.
TEST(Sandblaster, CoordinatorServiceRefusesBadCallsAndChangesNothing) {
  WorkQueue queue;
  WorkCoordinatorOptions options;
  options.auth_token = "secret";
  WorkCoordinatorServer server(queue, options);
  auto stub = dtrain::sandblaster::WorkCoordinator::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()));
  queue.open(1, 4);
  auto call_get = [&](const dtrain::sandblaster::WorkRequest& request, bool token) {
    grpc::ClientContext context;
    if (token) context.AddMetadata("authorization", "Bearer secret");
    dtrain::sandblaster::WorkReply reply;
    return stub->GetWork(&context, request, &reply);
  };
  auto call_finish = [&](const dtrain::sandblaster::UnitResult& request) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer secret");
    dtrain::sandblaster::FinishReply reply;
    return stub->Finish(&context, request, &reply);
  };
  dtrain::sandblaster::WorkRequest good;
  good.set_worker(0);
  good.set_examples(100);
  EXPECT_EQ(call_get(good, false).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(queue.stats().issued, 0);
  ASSERT_TRUE(call_get(good, true).ok());
  EXPECT_EQ(queue.stats().issued, 1);
  dtrain::sandblaster::WorkRequest other = good;
  other.set_examples(99);  // another data set
  const grpc::Status mismatch = call_get(other, true);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(mismatch.error_message().find("every worker must cut the same data"),
            std::string::npos);
  std::mt19937 random(7);
  int refused = 0;
  for (int i = 0; i < 200; ++i) {
    const WorkStats before = queue.stats();
    // Random bytes (a quarter) or a valid message with fields set to random edge values.
    std::string bytes(random() % 40, '\0');
    for (auto& b : bytes) b = static_cast<char>(random());
    auto pick = [&](std::initializer_list<double> values) {
      return *(values.begin() + random() % values.size());
    };
    grpc::Status status;
    if (i % 2 == 0) {
      dtrain::sandblaster::WorkRequest request;
      if (i % 4 == 0) {
        if (!request.ParseFromString(bytes)) continue;
        if (request.wait_ms() >= 0 && request.wait_ms() <= 5000) request.set_wait_ms(0);
      } else {
        request.set_worker(static_cast<int>(pick({-3, 0, 1, 2})));
        request.set_examples(static_cast<int64_t>(pick({-1, 0, 99, 100})));
        request.set_wait_ms(static_cast<int64_t>(pick({-5, 0, 6000})));
      }
      status = call_get(request, true);
    } else {
      dtrain::sandblaster::UnitResult request;
      if (i % 4 == 1) {
        if (!request.ParseFromString(bytes)) continue;
      } else {
        request.set_worker(static_cast<int>(pick({-1, 0, 3})));
        request.set_round(static_cast<int64_t>(pick({-1, 0, 1, 2})));
        request.set_unit(static_cast<int64_t>(pick({-1, 0, 3, 5, 1 << 21})));
        request.set_loss(pick({std::nan(""), INFINITY, 0.5}));
        request.set_seconds(pick({-1.0, std::nan(""), 0.1}));
      }
      status = call_finish(request);
    }
    if (!status.ok()) {
      ++refused;
      EXPECT_TRUE(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                  status.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
          << status.error_message();
      const bool named = status.error_message().find("field '") != std::string::npos ||
                         status.error_message().find("training examples") != std::string::npos;
      EXPECT_TRUE(named) << status.error_message();
      const WorkStats after = queue.stats();
      EXPECT_EQ(after.issued, before.issued);
      EXPECT_EQ(after.late_reports, before.late_reports);
    }
  }
  EXPECT_GT(refused, 20);
  // The shard's side: a keyed push with a unit out of range is refused naming the field.
  Shards shards(1);
  PsClient client(shards.addresses);
  client.initialize(at::zeros({8}));
  client.vector_ops({{VectorOp::Zero, "g", "", 0.0, 1}});
  try {
    client.accumulate(at::ones({8}), "g", 1, kMaxUnits);
    ADD_FAILURE() << "a unit out of range was accumulated";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("field 'unit'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(client.vector_ops({{VectorOp::Scale, "g", "", 1.0, 2}}),
               InputError);  // round on SCALE
  EXPECT_EQ(client.vector_ops({{VectorOp::Dot, "g", "g", 0.0}})[0], 0.0);
}
