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

// The states of the device's default generator and of `extra` (a model's own).
std::vector<at::Tensor> states_of(const std::vector<at::Generator>& generators) {
  std::vector<at::Tensor> states;
  for (const at::Generator& g : generators) {
    at::Generator generator = g;
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state());
  }
  return states;
}

void set_states(const std::vector<at::Generator>& generators,
                const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < generators.size(); ++i) {
    at::Generator generator = generators[i];
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(states[i]);
  }
}

struct CheckpointBackward : torch::autograd::Node {
  MultiSegmentFn fn;
  std::vector<at::Tensor> inputs;  // detached
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> parameters;
  std::vector<at::Generator> generators;  // the device's default one first
  std::vector<at::Tensor> rng_states;
  c10::Device device{c10::DeviceType::CPU};
  compat::AutocastState autocast{};

  std::string name() const override { return "dtrain::CheckpointBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const std::vector<at::Tensor> outer_states = states_of(generators);
    set_states(generators, rng_states);  // the forward's dropout masks
    const compat::AutocastState outer_autocast = compat::autocast_state(device.type());
    compat::set_autocast_state(device.type(), autocast);
    std::vector<at::Tensor> xs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      xs.push_back(inputs[i].detach().requires_grad_(input_requires_grad[i]));
    }
    at::Tensor y;
    try {
      torch::AutoGradMode enable(true);
      y = fn(xs);
    } catch (...) {
      compat::set_autocast_state(device.type(), outer_autocast);
      set_states(generators, outer_states);
      throw;
    }
    compat::set_autocast_state(device.type(), outer_autocast);
    set_states(generators, outer_states);
    std::vector<at::Tensor> wrt;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (input_requires_grad[i]) wrt.push_back(xs[i]);
    }
    wrt.insert(wrt.end(), parameters.begin(), parameters.end());
    torch::autograd::variable_list found;
    if (!wrt.empty() && y.requires_grad()) {
      found = torch::autograd::grad({y}, wrt, {grads.at(0)}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      found.assign(wrt.size(), at::Tensor());
    }
    // One per next edge: each input (undefined where it needs none), then the parameters.
    torch::autograd::variable_list result;
    size_t next = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      result.push_back(input_requires_grad[i] ? found[next++] : at::Tensor());
    }
    result.insert(result.end(), found.begin() + static_cast<std::ptrdiff_t>(next), found.end());
    return result;
  }

  void release_variables() override {
    inputs.clear();
    rng_states.clear();
  }
};

}  // namespace

at::Tensor checkpoint(const MultiSegmentFn& fn, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& parameters,
                      const std::vector<at::Generator>& generators) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);
  DTRAIN_CHECK(!inputs.empty(), "checkpoint: a segment needs an input");
  auto node =
      std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->fn = fn;
  for (const auto& x : inputs) {
    node->inputs.push_back(x.detach());
    node->input_requires_grad.push_back(x.requires_grad());
  }
  for (const auto& p : parameters) {
    if (p.requires_grad()) node->parameters.push_back(p);
  }
  node->device = inputs.front().device();
  node->autocast = compat::autocast_state(node->device.type());
  node->generators.push_back(generator_of(node->device));
  node->generators.insert(node->generators.end(), generators.begin(), generators.end());
  node->rng_states = states_of(node->generators);
  at::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = fn(inputs);
  }
  DTRAIN_CHECK(y.is_floating_point(), "checkpoint: the segment must return a floating tensor");
  for (const auto& x : inputs) {
    if (y.is_same(x) || y.is_alias_of(x)) y = y.clone();  // never rewire the caller's tensor
  }
  torch::autograd::edge_list edges;
  for (const auto& x : inputs) edges.push_back(torch::autograd::impl::gradient_edge(x));
  for (const auto& p : node->parameters) edges.push_back(torch::autograd::impl::gradient_edge(p));
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(y, node);
  return y;
}

at::Tensor checkpoint(const SegmentFn& fn, const at::Tensor& x,
                      const std::vector<at::Tensor>& parameters,
                      const std::vector<at::Generator>& generators) {
  return checkpoint([fn](const std::vector<at::Tensor>& xs) { return fn(xs.front()); },
                    std::vector<at::Tensor>{x}, parameters, generators);
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
                     "--checkpointing must be none, sqrt or a segment count >= 1",
                     value == "selective" ? " (selective recomputes attention's core: gpt and "
                                            "llama models only)"
                                          : "",
                     ", got '", value, "'");
  return std::min<int64_t>(k, std::max<int64_t>(layers, 1));
}

at::Tensor checkpoint_stages(const std::vector<SegmentFn>& stages,
                             const std::vector<std::vector<at::Tensor>>& parameters,
                             int64_t segments, const at::Tensor& x,
                             const std::vector<at::Generator>& generators) {
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
      h = checkpoint(run, h, segment_parameters, generators);
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
