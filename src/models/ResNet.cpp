// torchvision's ResNet (torchvision/models/resnet.py), module for module (see ResNet.h).
#include "dtrain/models/ResNet.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/nn/SyncBatchNorm.h"
#include "models/Stages.h"

namespace dtrain::models {

namespace {

namespace nn = torch::nn;
using dtrain::nn::SyncBatchNorm2d;

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// BasicBlock (expansion 1) or Bottleneck (expansion 4), with torchvision's member names.
struct ResNetBlockImpl : nn::Module {
  ResNetBlockImpl(int64_t in, int64_t planes, int64_t stride, bool bottleneck)
      : bottleneck(bottleneck) {
    const int64_t out = planes * (bottleneck ? 4 : 1);
    if (bottleneck) {
      conv1 = register_module("conv1", conv(in, planes, 1, 1));
      bn1 = register_module("bn1", SyncBatchNorm2d(planes));
      conv2 = register_module("conv2", conv(planes, planes, 3, stride));
      bn2 = register_module("bn2", SyncBatchNorm2d(planes));
      conv3 = register_module("conv3", conv(planes, out, 1, 1));
      bn3 = register_module("bn3", SyncBatchNorm2d(out));
    } else {
      conv1 = register_module("conv1", conv(in, planes, 3, stride));
      bn1 = register_module("bn1", SyncBatchNorm2d(planes));
      conv2 = register_module("conv2", conv(planes, planes, 3, 1));
      bn2 = register_module("bn2", SyncBatchNorm2d(planes));
    }
    if (stride != 1 || in != out) {
      downsample = register_module("downsample",
                                   nn::Sequential(conv(in, out, 1, stride), SyncBatchNorm2d(out)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(bn1(conv1(x)));
    h = bn2(conv2(h));
    if (bottleneck) h = bn3(conv3(torch::relu(h)));
    return torch::relu(h + (downsample ? downsample->forward(x) : x));
  }
  bool bottleneck;
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  SyncBatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(ResNetBlock);

struct TorchvisionResNetImpl : nn::Module {
  TorchvisionResNetImpl(const std::vector<int64_t>& blocks, bool bottleneck, int64_t channels,
                        int64_t classes, const std::string& checkpointing)
      : conv1(nn::Conv2dOptions(channels, 64, 7).stride(2).padding(3).bias(false)),
        bn1(64),
        fc(nullptr) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    int64_t in = 64;
    const int64_t planes[4] = {64, 128, 256, 512};
    for (int l = 0; l < 4; ++l) {
      nn::Sequential layer;
      for (int64_t b = 0; b < blocks[l]; ++b) {
        layer->push_back(ResNetBlock(in, planes[l], b == 0 && l > 0 ? 2 : 1, bottleneck));
        in = planes[l] * (bottleneck ? 4 : 1);
      }
      layers.push_back(register_module("layer" + std::to_string(l + 1), layer));
    }
    fc = register_module("fc", nn::Linear(in, classes));
    // torchvision's initialization.
    torch::NoGradGuard no_grad;
    for (auto& module : modules(/*include_self=*/false)) {
      if (auto* c = module->as<nn::Conv2d>()) {
        nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
      } else if (auto* b = module->as<SyncBatchNorm2d>()) {
        b->weight.fill_(1.0);
        b->bias.zero_();
      }
    }
    int64_t count = 0;
    for (const auto& layer : layers) count += static_cast<int64_t>(layer->size());
    segments = memory::parse_segments(checkpointing, count + 2);
  }
  at::Tensor stem(const at::Tensor& x) {
    // Activations channels-last (NHWC) from the first convolution on: oneDNN's and cuDNN's
    // faster layout (ResNet-50's CPU step: 0.86x the time of NCHW). The weights stay NCHW, so
    // state dicts and gradient buckets are torchvision's layout.
    const at::Tensor input = x.dim() == 4 ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
    return torch::max_pool2d(torch::relu(bn1(conv1(input))), 3, 2, 1);
  }
  at::Tensor head(const at::Tensor& h) {
    return fc(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
  }
  std::vector<Stage> stages() {
    std::vector<Stage> out{
        {"stem", {conv1.ptr(), bn1.ptr()}, [this](const at::Tensor& x) { return stem(x); }}};
    for (size_t l = 0; l < layers.size(); ++l) {
      for (size_t b = 0; b < layers[l]->size(); ++b) {
        auto block = layers[l]->ptr<ResNetBlockImpl>(b);
        out.push_back({"layer" + std::to_string(l + 1) + "." + std::to_string(b),
                       {block},
                       [block](const at::Tensor& h) { return block->forward(h); }});
      }
    }
    out.push_back({"head", {fc.ptr()}, [this](const at::Tensor& h) { return head(h); }});
    return out;
  }
  at::Tensor forward(const at::Tensor& x) { return run_stages(stages(), segments, x); }
  nn::Conv2d conv1;
  SyncBatchNorm2d bn1;
  std::vector<nn::Sequential> layers;
  nn::Linear fc;
  int64_t segments = 1;
};

}  // namespace

Model make_torchvision_resnet(int64_t depth, int64_t channels, int64_t classes,
                              const std::string& checkpointing) {
  std::vector<int64_t> blocks;
  bool bottleneck = depth >= 50;
  switch (depth) {
    case 18:
      blocks = {2, 2, 2, 2};
      break;
    case 34:
      blocks = {3, 4, 6, 3};
      break;
    case 50:
      blocks = {3, 4, 6, 3};
      break;
    case 101:
      blocks = {3, 4, 23, 3};
      break;
    case 152:
      blocks = {3, 8, 36, 3};
      break;
    default:
      DTRAIN_THROW(InputError, "torchvision's ResNets are 18, 34, 50, 101 or 152 layers deep, not ",
                   depth);
  }
  DTRAIN_CHECK_INPUT(channels >= 1 && classes >= 1, "a ResNet needs input channels and classes");
  auto module =
      std::make_shared<TorchvisionResNetImpl>(blocks, bottleneck, channels, classes, checkpointing);
  Model model(module);
  model.stages = module->stages();
  for (size_t i = 0; i + 1 < model.stages.size(); ++i)
    model.stages[i].checkpoint = module->segments > 1;
  return model;
}

}  // namespace dtrain::models
