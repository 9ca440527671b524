// torchvision's ResNets: dtrain's resnet18 and resnet50 take torchvision's state dict by its own
// names and give its logits within 1e-5 in float32 and 1e-10 in float64, in evaluation (running
// statistics) and training (batch statistics) mode, and torchvision takes dtrain's back
// (tests/data/resnet_oracle.py in .venv-torch; skipped without it); the registry builds them for
// the data sets' shapes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "InputErrors.h"
#include "TempDir.h"
#include "dtrain/models/HuggingFace.h"
#include "dtrain/models/ResNet.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/nn/SafeTensors.h"

using namespace dtrain;
using dtrain::test::error_of;
using dtrain::test::TempDir;

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
