// torchvision's ResNets: dtrain's resnet18 and resnet50 take torchvision's state dict by its own
// names and give its logits within 1e-5 in float32 and 1e-10 in float64, in evaluation (running
// statistics) and training (batch statistics) mode, and torchvision takes dtrain's back
// (tests/data/resnet_oracle.py in .venv-torch; skipped without it); the registry builds them for
// the data sets' shapes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "InputErrors.h"
#include "RankThreads.h"
#include "TempDir.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/models/ResNet.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/SafeTensors.h"
#include "dtrain/nn/SyncBatchNorm.h"
#include "dtrain/train/Trainer.h"

using namespace dtrain;
using dtrain::test::error_of;
using dtrain::test::TempDir;

namespace {

// A ResNet's parameters and BatchNorm buffers after 4 float64 steps of `strategy` on `world`
// rank threads, 16 images of 3 x 8 x 8 per step in all (16 / world per rank).
std::vector<at::Tensor> trained_resnet(int world, bool sync, const std::string& name = "resnet",
                                       const std::string& strategy = "ddp") {
  const auto synthetic = data::make_synthetic(64, {3, 8, 8}, 4, 5);
  const data::TensorDataset dataset(synthetic.raw_inputs().to(at::kDouble), synthetic.targets());
  train::TrainerOptions options;
  options.strategy = strategy;
  options.batch_size = 16 / world;
  options.max_steps = 4;
  options.optimizer.name = "sgd";
  options.optimizer.lr = 0.1;
  options.optimizer.momentum = 0.9;
  options.seed = 3;
  options.progress = false;
  options.sync_batchnorm = sync;
  models::ModelSpec spec;
  spec.name = name;
  spec.input_shape = {3, 8, 8};
  spec.classes = 4;
  std::vector<Model> built;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(11);
    built.push_back(models::make_model(spec));
    built.back().module->to(at::kDouble);
  }
  std::vector<at::Tensor> state;
  test::run_ranks(
      world,
      [&](const comm::CommunicatorPtr& comm) {
        train::Trainer trainer(options, comm);
        trainer.fit(built[comm->rank()], dataset);
        trainer.strategy().materialize();
        if (comm->rank() != 0) return;
        const auto& module = *trainer.strategy().model().module;
        for (const auto& p : module.parameters()) state.push_back(p.detach().clone());
        for (const auto& b : module.buffers()) state.push_back(b.detach().clone());
      },
      std::chrono::seconds(120));
  return state;
}

double largest_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double most = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    most = std::max(most, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return most;
}

}  // namespace

// torch.nn.SyncBatchNorm's promise: data-parallel ranks whose BatchNorm statistics span the
// group train as one process on the global batch: parameters and running statistics (float64).
// Without it each rank normalizes by its own share's statistics and the runs part.
TEST(SyncBatchNorm, RanksTrainAsOneProcessOnTheGlobalBatch) {
  at::set_num_threads(1);
  const auto one = trained_resnet(1, false);
  for (int world : {2, 4}) {
    EXPECT_LT(largest_difference(trained_resnet(world, true), one), 1e-10) << world << " ranks";
  }
  EXPECT_LT(largest_difference(trained_resnet(2, true, "resnet", "zero2"), one), 1e-10);
  EXPECT_GT(largest_difference(trained_resnet(2, false), one), 1e-4);  // plain BatchNorm
}

TEST(SyncBatchNorm, TorchvisionsResNetToo) {
  at::set_num_threads(1);
  EXPECT_LT(
      largest_difference(trained_resnet(2, true, "resnet18"), trained_resnet(1, false, "resnet18")),
      1e-10);
}

// The layer alone: its output and every gradient equal BatchNorm2d's on the whole batch, each
// rank holding a share of different size (Chan's combination is exact for uneven shares).
TEST(SyncBatchNorm, UnevenSharesGiveBatchNormOfTheWholeBatch) {
  at::set_num_threads(1);
  torch::manual_seed(4);
  const at::Tensor x = torch::randn({7, 3, 2, 2}, at::kDouble) * 3 + 5;
  const at::Tensor dy = torch::randn({7, 3, 2, 2}, at::kDouble);
  torch::nn::BatchNorm2d plain(3);
  plain->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    plain->weight.uniform_(0.5, 1.5);
    plain->bias.uniform_(-1, 1);
  }
  const at::Tensor whole = x.clone().requires_grad_();
  const at::Tensor expected = plain(whole);
  expected.backward(dy);
  const int64_t starts[3] = {0, 2, 7};  // rank 0 holds 2 images, rank 1 five
  std::vector<at::Tensor> outputs(2), grads(2), weight_grads(2), means(2);
  test::run_ranks(
      2,
      [&](const comm::CommunicatorPtr& comm) {
        const int r = comm->rank();
        nn::SyncBatchNorm2d layer(3);
        layer->to(at::kDouble);
        {
          torch::NoGradGuard no_grad;
          layer->weight.copy_(plain->weight);
          layer->bias.copy_(plain->bias);
        }
        EXPECT_EQ(nn::set_sync_batchnorm(*layer, comm), 1);
        const at::Tensor mine =
            x.narrow(0, starts[r], starts[r + 1] - starts[r]).clone().requires_grad_();
        const at::Tensor y = layer(mine);
        y.backward(dy.narrow(0, starts[r], starts[r + 1] - starts[r]));
        outputs[r] = y.detach();
        grads[r] = mine.grad();
        weight_grads[r] = layer->weight.grad().clone();
        means[r] = layer->running_var.clone();
      },
      std::chrono::seconds(30));
  EXPECT_LT((at::cat(outputs) - expected).abs().max().item<double>(), 1e-12);
  EXPECT_LT((at::cat(grads) - whole.grad()).abs().max().item<double>(), 1e-12);
  // Each rank's parameter gradient is its share's (data parallelism sums them).
  EXPECT_LT((weight_grads[0] + weight_grads[1] - plain->weight.grad()).abs().max().item<double>(),
            1e-12);
  for (const auto& running : means) {
    EXPECT_LT((running - plain->running_var).abs().max().item<double>(), 1e-12);
  }
}

TEST(ResNet, LogitsEqualTorchvisionsOnItsStateDict) {
  const std::string python = test::peer_python();
  if (std::system((python + " -c 'import torchvision' > /dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "no torchvision in " << python;
  }
  for (int depth : {18, 50}) {
    TempDir dir;
    const std::string command = python + " " + DTRAIN_SOURCE_DIR + "/tests/data/resnet_oracle.py " +
                                dir.path() + " " + std::to_string(depth);
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const auto expected = nn::SafeTensorsFile::open(dir / "expected.safetensors");
    models::FullTensors state;
    for (const auto& name : expected.names()) {
      if (name.rfind("state.", 0) == 0) state[name.substr(6)] = expected.get(name);
    }
    Model model = models::make_torchvision_resnet(depth, 3, 10);
    models::load_full_tensors(*model.module, state, "torchvision");
    const at::Tensor x = expected.get("input");
    torch::NoGradGuard no_grad;
    model.module->eval();
    // float32: kernels summing in other orders (LibTorch's and PyTorch's convolutions) differ
    // by rounding, which grows with the logits' scale: relative to it.
    const at::Tensor eval32 = expected.get("eval32");
    const double scale = eval32.abs().max().item<double>();
    EXPECT_LT((model(x) - eval32).abs().max().item<double>() / scale, 1e-5)
        << depth << " (logits up to " << scale << ")";
    model.module->to(at::kDouble);
    EXPECT_LT((model(x.to(at::kDouble)) - expected.get("eval64")).abs().max().item<double>(), 1e-10)
        << depth;
    model.module->train();
    const at::Tensor train = model(x.to(at::kDouble));
    EXPECT_LT((train - expected.get("train64")).abs().max().item<double>(), 1e-10) << depth;
    EXPECT_GT((train - expected.get("eval64")).abs().max().item<double>(), 1e-3);  // it matters
    // And back: dtrain's weights under dtrain's names (what `dtrain ckpt export` writes) load
    // into torchvision strictly and give dtrain's logits.
    torch::manual_seed(depth);
    Model fresh = models::make_torchvision_resnet(depth, 3, 10);
    fresh.module->eval();
    nn::NamedTensors ours{{"input", x}, {"logits", fresh(x)}};
    for (const auto& item : fresh.module->named_parameters()) {
      ours.push_back({"state." + item.key(), item.value().detach()});
    }
    for (const auto& item : fresh.module->named_buffers()) {
      ours.push_back({"state." + item.key(), item.value()});
    }
    nn::save_safetensors(dir / "ours.safetensors", ours);
    const std::string check = python + " " + DTRAIN_SOURCE_DIR +
                              "/tests/data/resnet_oracle.py --check " + (dir / "ours.safetensors") +
                              " " + std::to_string(depth);
    EXPECT_EQ(std::system(check.c_str()), 0) << check;
  }
}

TEST(ResNet, TheRegistryBuildsThemForTheDataSetsShapes) {
  models::ModelSpec spec;
  spec.input_shape = {1, 28, 28};
  for (const char* name : {"resnet18", "resnet50"}) {
    spec.name = name;
    Model model = models::make_model(spec);
    EXPECT_EQ(model(at::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10})) << name;
    EXPECT_EQ(model.stages.size(), name == std::string("resnet18") ? 10u : 18u);
    EXPECT_FALSE(models::model_info(name).parameters_only);
  }
  int64_t parameters = 0;
  for (const auto& p : models::make_torchvision_resnet(50, 3, 1000).module->parameters()) {
    parameters += p.numel();
  }
  EXPECT_EQ(parameters, 25557032);  // torchvision's count for ResNet-50
  EXPECT_NE(error_of([] { models::make_torchvision_resnet(20, 3, 10); }).find("not 20"),
            std::string::npos);
}
