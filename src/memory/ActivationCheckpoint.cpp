// The checkpoint autograd node: forward without grad, recompute + torch::autograd::grad in
// backward, returning gradients for the segment input and its parameters.
#include "dtrain/memory/ActivationCheckpoint.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/torch.h>

#include <cmath>

#include "common/TorchCompat.h"
#include "dtrain/common/Error.h"

namespace dtrain::memory {

namespace {

// The recomputation replays the forward's autocast (thread-local: a GPU's backward runs on
// another thread) and random state, of the device the segment runs on.
at::Generator generator_of(const c10::Device& device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator()
                         : at::globalContext().defaultGenerator(device);
}

struct CheckpointBackward : torch::autograd::Node {
  SegmentFn fn;
  at::Tensor input;  // detached
  bool input_requires_grad = false;
  std::vector<at::Tensor> parameters;
  at::Tensor rng_state;
  c10::Device device{c10::DeviceType::CPU};
  compat::AutocastState autocast{};

  std::string name() const override { return "dtrain::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Generator generator = generator_of(device);
    at::Tensor outer_state;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      outer_state = generator.get_state();
      generator.set_state(rng_state);  // the forward's dropout masks
    }
    const compat::AutocastState outer_autocast = compat::autocast_state(device.type());
    compat::set_autocast_state(device.type(), autocast);
    at::Tensor x = input.detach().requires_grad_(input_requires_grad);
    at::Tensor y;
    try {
      torch::AutoGradMode enable(true);
      y = fn(x);
    } catch (...) {
      compat::set_autocast_state(device.type(), outer_autocast);
      throw;
    }
    compat::set_autocast_state(device.type(), outer_autocast);
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(outer_state);
    }
    std::vector<at::Tensor> wrt;
    if (input_requires_grad) wrt.push_back(x);
    wrt.insert(wrt.end(), parameters.begin(), parameters.end());
    torch::autograd::variable_list result;
    if (!wrt.empty() && y.requires_grad()) {
      result = torch::autograd::grad({y}, wrt, {grads.at(0)}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      result.assign(wrt.size(), at::Tensor());
    }
    if (!input_requires_grad) result.insert(result.begin(), at::Tensor());
    return result;  // one per next edge: input, then parameters
  }

  void release_variables() override {
    input.reset();
    rng_state.reset();
  }
};

}  // namespace

at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& x,
                      const std::vector<at::Tensor>& parameters) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  auto node =
      std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->fn = fn;
  node->input = x.detach();
  node->input_requires_grad = x.requires_grad();
  for (const auto& p : parameters) {
    if (p.requires_grad()) node->parameters.push_back(p);
  }
  node->device = x.device();
  node->autocast = compat::autocast_state(node->device.type());
  {
    at::Generator generator = generator_of(node->device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    node->rng_state = generator.get_state();
  }
  at::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(x);
  }
  DTRAIN_CHECK(y.is_floating_point(), "checkpoint: the segment must return a floating tensor");
  if (y.is_same(x) || y.is_alias_of(x)) y = y.clone();  // never rewire the caller's tensor
  torch::autograd::edge_list edges;
  edges.push_back(torch::autograd::impl::gradient_edge(x));
  for (const auto& p : node->parameters) edges.push_back(torch::autograd::impl::gradient_edge(p));
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(y, node);
  return y;
}

at::Tensor checkpoint(torch::nn::Module& module, const SegmentFn& forward, const at::Tensor& x) {
  return checkpoint(forward, x, module.parameters());
}

int64_t sqrt_segments(int64_t layers) {
  return std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(layers))));
}

int64_t parse_segments(const std::string& value, int64_t layers) {
  if (value == "none" || value.empty()) return 0;
  if (value == "sqrt") return sqrt_segments(layers);
  char* end = nullptr;
  const long long k = std::strtoll(value.c_str(), &end, 10);
  DTRAIN_CHECK_INPUT(end && *end == '\0' && k >= 1,
                     "--checkpointing must be none, sqrt or a "
                     "segment count >= 1, got '",
                     value, "'");
  return std::min<int64_t>(k, std::max<int64_t>(layers, 1));
}

at::Tensor checkpoint_stages(const std::vector<SegmentFn>& stages,
                             const std::vector<std::vector<at::Tensor>>& parameters,
                             int64_t segments, const at::Tensor& x) {
  DTRAIN_CHECK_EQ(stages.size(), parameters.size(), "one parameter list per stage");
  const int64_t n = static_cast<int64_t>(stages.size());
  segments = std::min(segments, n);
  at::Tensor h = x;
  if (segments <= 1) {
    for (const auto& stage : stages) h = stage(h);
    return h;
  }
  // The first n % segments segments get one stage more.
  int64_t begin = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t end = begin + n / segments + (s < n % segments ? 1 : 0);
    // Owned copy: the recompute runs in backward, after the caller's `stages` are gone.
    auto run = [segment = std::vector<SegmentFn>(stages.begin() + begin, stages.begin() + end)](
                   const at::Tensor& input) {
      at::Tensor out = input;
      for (const auto& stage : segment) out = stage(out);
      return out;
    };
    if (s + 1 == segments) {
      h = run(h);  // the last segment's activations are needed right away by backward
    } else {
      std::vector<at::Tensor> segment_parameters;
      for (int64_t i = begin; i < end; ++i) {
        segment_parameters.insert(segment_parameters.end(), parameters[i].begin(),
                                  parameters[i].end());
      }
      h = checkpoint(run, h, segment_parameters);
    }
    begin = end;
  }
  return h;
}

at::Tensor checkpoint_sequential(const torch::nn::Sequential& sequence, int64_t segments,
                                 const at::Tensor& x) {
  std::vector<SegmentFn> stages;
  std::vector<std::vector<at::Tensor>> parameters;
  torch::nn::Sequential shared = sequence;  // a holder shares the module: no copy
  for (size_t i = 0; i < shared->size(); ++i) {
    stages.push_back([shared, i](const at::Tensor& input) mutable {
      return (shared->begin() + static_cast<std::ptrdiff_t>(i))->forward(input);
    });
    parameters.push_back(shared->children()[i]->parameters());
  }
  return checkpoint_stages(stages, parameters, segments, x);
}

}  // namespace dtrain::memory
