// Memory-saver benchmark, one configuration per fresh process: step time and peak resident memory
// of a model trained in a precision mode (--precision) or with activation checkpointing
// (--segments). Prints one JSON line. bench/precision/precision_reference.py is its PyTorch twin.
#include <torch/torch.h>

#include <sys/resource.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "BenchMemory.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/precision/Precision.h"

using namespace dtrain;
using namespace dtrain::bench;

namespace {

// A pre-norm transformer block (attention + 4x MLP), written out so the PyTorch twin is the same.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads)
      : heads(heads),
        ln1(torch::nn::LayerNormOptions({d})),
        qkv(d, 3 * d),
        proj(d, d),
        ln2(torch::nn::LayerNormOptions({d})),
        up(d, 4 * d),
        down(4 * d, d) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    register_module("up", up);
    register_module("down", down);
  }
  // ATen's linear, as Python's nn.Linear calls: it fuses the bias into one addmm for 3-D
  // inputs, where the C++ frontend's torch::nn::Linear runs matmul then a separate add.
  static at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
    return torch::linear(x, layer->weight, layer->bias);
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    // unbind, as Python's `q, k, v = tensor` does (three selects would each back-propagate a
    // full-size zero tensor).
    auto parts =
        linear(qkv, ln1(x)).view({b, t, 3, heads, d / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
    auto att = torch::softmax(torch::matmul(parts[0], parts[1].transpose(-2, -1)) /
                                  std::sqrt(static_cast<double>(d / heads)),
                              -1);
    auto h = x + linear(proj, torch::matmul(att, parts[2]).transpose(1, 2).reshape({b, t, d}));
    return h + linear(down, torch::gelu(linear(up, ln2(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear up, down;
};

// One layer of the activation-checkpointing model: Linear then ReLU (a Sequential cannot hold a
// Sequential in LibTorch).
struct LinearReluImpl : torch::nn::Module {
  explicit LinearReluImpl(int64_t width) : fc(width, width) { register_module("fc", fc); }
  at::Tensor forward(const at::Tensor& x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(LinearRelu);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain precision / activation-checkpointing benchmark (one configuration)"};
  std::string model = "mlp", precision_name = "fp32";
  int64_t batch = 256, steps = 10, warmup = 2, segments = -1, threads = 2;
  app.add_option("--model", model, "mlp, cnn, transformer, deep-mlp")->capture_default_str();
  app.add_option("--precision", precision_name, "fp32 or bf16-mixed")->capture_default_str();
  app.add_option("--segments", segments, "deep-mlp: -1 plain, K checkpoint_sequential segments")
      ->capture_default_str();
  app.add_option("--batch", batch, "Batch size")->capture_default_str();
  app.add_option("--steps", steps, "Measured steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Unmeasured steps")->capture_default_str();
  app.add_option("--threads", threads, "Threads")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  launch::set_threads(static_cast<int>(threads));
  const auto mode = precision::parse_precision(precision_name);
  torch::manual_seed(0);

  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  at::Tensor inputs, targets;
  bool classify = true;
  if (model == "mlp" || model == "cnn") {
    models::ModelSpec spec;
    spec.name = model;
    spec.hidden = {1024, 1024};
    Model m = models::make_model(spec);
    module = m.module;
    forward = m.forward;
    inputs = torch::randn({batch, 1, 28, 28});
    targets = torch::randint(0, 10, {batch});
  } else if (model == "transformer") {
    auto block = std::make_shared<BlockImpl>(256, 8);
    module = block;
    forward = [block](const at::Tensor& x) { return block->forward(x); };
    inputs = torch::randn({batch, 128, 256});
    classify = false;
  } else if (model == "deep-mlp") {
    torch::nn::Sequential layers;
    for (int i = 0; i < 32; ++i) layers->push_back(LinearRelu(512));
    module = layers.ptr();
    forward = [layers, segments](const at::Tensor& x) mutable {
      return segments < 0 ? layers->forward(x) : memory::checkpoint_sequential(layers, segments, x);
    };
    inputs = torch::randn({batch, 512}).requires_grad_();
    classify = false;
  } else {
    std::fprintf(stderr, "unknown model %s\n", model.c_str());
    return 2;
  }
  torch::optim::SGD optimizer(module->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const double baseline = rss_mb();
  double state_rss = 0;  // after warm-up: parameters, gradients and optimizer state allocated
  bool peak_reset = false;
  std::vector<double> step_ms;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup) {
      state_rss = rss_mb();
      peak_reset = reset_peak();
    }
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    at::Tensor loss;
    {
      precision::AutocastScope autocast(mode);
      at::Tensor out = forward(inputs);
      loss = classify ? torch::nn::functional::cross_entropy(out, targets)
                      : out.to(torch::kFloat).pow(2).mean();
    }
    loss.backward();
    optimizer.step();
    loss.item<double>();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (i >= warmup) step_ms.push_back(ms);
  }
  // Activation memory: the peak of the measured steps above the memory before them.
  const double activation = peak_reset ? status_mb("VmHWM:") - state_rss : -1;
  std::sort(step_ms.begin(), step_ms.end());
  std::printf(
      "{\"impl\": \"dtrain\", \"model\": \"%s\", \"precision\": \"%s\", \"segments\": %lld, "
      "\"batch\": %lld, \"step_ms\": %.3f, \"peak_rss_mb\": %.1f, \"baseline_rss_mb\": "
      "%.1f, \"activation_mb\": %.1f}\n",
      model.c_str(), precision_name.c_str(), static_cast<long long>(segments),
      static_cast<long long>(batch), step_ms[step_ms.size() / 2], peak_rss_mb(), baseline,
      activation);
  return 0;
}
