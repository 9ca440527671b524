// The reference models. No BatchNorm in the MLP and CNN, so N-rank data parallelism is exactly
// equivalent to 1-rank training on the same global batch; the ResNet keeps BatchNorm as real
// ResNets do (its statistics are per rank, as in PyTorch DDP without SyncBatchNorm).
#include "dtrain/models/Zoo.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/memory/Checkpoint.h"

namespace dtrain::models {

namespace {

std::vector<at::Tensor> concat_parameters(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<at::Tensor> all;
  for (const auto& m : modules) {
    for (const auto& p : m->parameters()) all.push_back(p);
  }
  return all;
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, const std::vector<int64_t>& hidden, int64_t out,
          const std::string& checkpointing)
      : segments(memory::parse_segments(checkpointing, static_cast<int64_t>(hidden.size()) + 1)) {
    int64_t width = in;
    for (size_t i = 0; i < hidden.size(); ++i) {
      layers->push_back(torch::nn::Linear(width, hidden[i]));
      layers->push_back(torch::nn::ReLU());
      width = hidden[i];
    }
    layers->push_back(torch::nn::Linear(width, out));
    register_module("layers", layers);
  }
  at::Tensor forward(const at::Tensor& x) {
    return memory::checkpoint_sequential(layers, segments, x.flatten(1));
  }
  int64_t segments;
  torch::nn::Sequential layers;
};

// Two 3x3 conv blocks and a two-layer head: ~0.2M parameters, >90% on Fashion-MNIST.
struct CnnImpl : torch::nn::Module {
  CnnImpl(int64_t channels, int64_t height, int64_t width, int64_t classes,
          const std::string& checkpointing)
      : segments(memory::parse_segments(checkpointing, 3)),
        conv1(torch::nn::Conv2dOptions(channels, 32, 3).padding(1)),
        conv2(torch::nn::Conv2dOptions(32, 64, 3).padding(1)),
        fc1(64 * (height / 4) * (width / 4), 128),
        fc2(128, classes) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  at::Tensor forward(const at::Tensor& x) {
    if (segments <= 1) {  // the plain path, without std::function indirection
      auto h = torch::max_pool2d(torch::relu(conv1(x)), 2);
      h = torch::max_pool2d(torch::relu(conv2(h)), 2);
      return fc2(torch::relu(fc1(h.flatten(1))));
    }
    return memory::checkpoint_stages(
        {[this](const at::Tensor& h) { return torch::max_pool2d(torch::relu(conv1(h)), 2); },
         [this](const at::Tensor& h) { return torch::max_pool2d(torch::relu(conv2(h)), 2); },
         [this](const at::Tensor& h) { return fc2(torch::relu(fc1(h.flatten(1)))); }},
        {conv1->parameters(), conv2->parameters(), concat_parameters({fc1.ptr(), fc2.ptr()})},
        segments, x);
  }
  int64_t segments;
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

struct ResidualBlockImpl : torch::nn::Module {
  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)),
        bn1(out),
        conv2(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)),
        bn2(out) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    if (stride != 1 || in != out) {
      shortcut = register_module(
          "shortcut", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride)
                                            .bias(false)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = bn2(conv2(h));
    return torch::relu(h + (shortcut ? shortcut(x) : x));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Conv2d shortcut{nullptr};
};
TORCH_MODULE(ResidualBlock);

struct ResNetImpl : torch::nn::Module {
  ResNetImpl(int64_t channels, int64_t classes, const std::string& checkpointing)
      : segments(memory::parse_segments(checkpointing, 5)),
        stem(torch::nn::Conv2dOptions(channels, 16, 3).padding(1).bias(false)),
        stem_bn(16),
        head(64, classes) {
    register_module("stem", stem);
    register_module("stem_bn", stem_bn);
    blocks->push_back(ResidualBlock(16, 16, 1));
    blocks->push_back(ResidualBlock(16, 32, 2));
    blocks->push_back(ResidualBlock(32, 64, 2));
    register_module("blocks", blocks);
    register_module("head", head);
  }
  at::Tensor forward(const at::Tensor& x) {
    std::vector<memory::SegmentFn> stages{
        [this](const at::Tensor& h) { return torch::relu(stem_bn(stem(h))); }};
    std::vector<std::vector<at::Tensor>> parameters{concat_parameters({stem.ptr(), stem_bn.ptr()})};
    for (size_t i = 0; i < blocks->size(); ++i) {
      stages.push_back([this, i](const at::Tensor& h) {
        return (blocks->begin() + static_cast<std::ptrdiff_t>(i))->forward(h);
      });
      parameters.push_back(blocks->children()[i]->parameters());
    }
    stages.push_back([this](const at::Tensor& h) {
      return head(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
    });
    parameters.push_back(head->parameters());
    return memory::checkpoint_stages(stages, parameters, segments, x);
  }
  int64_t segments;
  torch::nn::Conv2d stem;
  torch::nn::BatchNorm2d stem_bn;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};

}  // namespace

std::vector<std::string> model_names() { return {"mlp", "cnn", "resnet"}; }

Model make_model(const ModelSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.classes >= 2, "model needs at least 2 classes, got ", spec.classes);
  if (spec.name == "mlp") {
    return Model(std::make_shared<MlpImpl>(product(spec.input_shape), spec.hidden, spec.classes,
                                           spec.checkpointing));
  }
  const bool image = spec.input_shape.size() == 3;
  if (spec.name == "cnn") {
    DTRAIN_CHECK_INPUT(image && spec.input_shape[1] >= 4 && spec.input_shape[2] >= 4,
                       "model cnn needs image inputs [C, H>=4, W>=4]");
    return Model(std::make_shared<CnnImpl>(spec.input_shape[0], spec.input_shape[1],
                                           spec.input_shape[2], spec.classes,
                                           spec.checkpointing));
  }
  if (spec.name == "resnet") {
    DTRAIN_CHECK_INPUT(image, "model resnet needs image inputs [C, H, W]");
    return Model(std::make_shared<ResNetImpl>(spec.input_shape[0], spec.classes, spec.checkpointing));
  }
  DTRAIN_THROW(InputError, "unknown model '", spec.name, "' (expected mlp, cnn or resnet)");
}

}  // namespace dtrain::models
