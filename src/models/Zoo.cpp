// The reference models. No BatchNorm in the MLP and CNN, so N-rank data parallelism is exactly
// equivalent to 1-rank training on the same global batch; the ResNets keep BatchNorm as real
// ResNets do: its statistics are per rank, as in PyTorch DDP, unless --sync-batchnorm gives its
// layers the data-parallel group (nn/SyncBatchNorm.h).
#include "dtrain/models/Zoo.h"

#include <torch/torch.h>

#include <algorithm>

#include "dtrain/common/Error.h"
#include "dtrain/common/Registry.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/models/ResNet.h"
#include "dtrain/nn/SyncBatchNorm.h"
#include "dtrain/nn/WeightGrad.h"
#include "models/Stages.h"

namespace dtrain::models {

namespace {

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
  /// One stage per Linear (with the ReLU after it); the first also flattens.
  std::vector<Stage> stages() {
    std::vector<Stage> out;
    const auto children = layers->children();
    for (size_t i = 0; i < children.size(); i += 2) {
      const bool last = i + 1 >= children.size();
      auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(children[i]);
      // nn::linear: a zero-bubble pipeline defers the weight gradient to its W.
      out.push_back({"layers." + std::to_string(i),
                     {children[i]},
                     [linear, first = i == 0, last](const at::Tensor& x) {
                       at::Tensor h = dtrain::nn::linear(first ? x.flatten(1) : x, linear->weight,
                                                         linear->bias);
                       return last ? h : torch::relu(h);
                     }});
    }
    return out;
  }
  int64_t segments;
  torch::nn::Sequential layers;
};

// Two conv blocks (32 and 64 channels, each with 2x2 max pooling) and a two-layer head.
// "cnn": 3x3 kernels and a 128-unit layer (~0.4M parameters on 28x28, >90% on Fashion-MNIST);
// "fedavg-cnn": McMahan et al.'s FedAvg CNN, 5x5 kernels and a 512-unit layer (1,663,370).
struct CnnImpl : torch::nn::Module {
  CnnImpl(int64_t channels, int64_t height, int64_t width, int64_t classes,
          const std::string& checkpointing, int64_t kernel, int64_t head_width)
      : segments(memory::parse_segments(checkpointing, 3)),
        conv1(torch::nn::Conv2dOptions(channels, 32, kernel).padding(kernel / 2)),
        conv2(torch::nn::Conv2dOptions(32, 64, kernel).padding(kernel / 2)),
        fc1(64 * (height / 4) * (width / 4), head_width),
        fc2(head_width, classes) {
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
    return run_stages(stages(), segments, x);
  }
  std::vector<Stage> stages() {
    return {{"conv1",
             {conv1.ptr()},
             [this](const at::Tensor& h) { return torch::max_pool2d(torch::relu(conv1(h)), 2); }},
            {"conv2",
             {conv2.ptr()},
             [this](const at::Tensor& h) { return torch::max_pool2d(torch::relu(conv2(h)), 2); }},
            {"head", {fc1.ptr(), fc2.ptr()}, [this](const at::Tensor& h) {
               return fc2(torch::relu(fc1(h.flatten(1))));
             }}};
  }
  int64_t segments;
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

// "vgg": VGG's shape (Simonyan & Zisserman 2015) at a small scale, PipeDream's example of a
// model whose compute and parameters live apart: two blocks of two 3x3 convolutions (32 and 64
// channels, ReLU, 2x2 max pooling), average pooling to 7x7 (as torchvision's VGG), then three
// fully-connected layers (1024, 1024, classes). On 28x28 the convolutions are ~80% of the
// compute and 1.5% of the 4.3M parameters. One stage per layer.
struct VggImpl : torch::nn::Module {
  VggImpl(int64_t channels, int64_t classes, const std::string& checkpointing)
      : segments(memory::parse_segments(checkpointing, 7)) {
    const int64_t widths[] = {32, 32, 64, 64};
    int64_t in = channels;
    for (int i = 0; i < 4; ++i) {
      convs.push_back(register_module(
          concat("conv", i + 1),
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, widths[i], 3).padding(1))));
      in = widths[i];
    }
    const int64_t sizes[] = {64 * 7 * 7, 1024, 1024, classes};
    for (int i = 0; i < 3; ++i) {
      fcs.push_back(
          register_module(concat("fc", i + 1), torch::nn::Linear(sizes[i], sizes[i + 1])));
    }
  }
  at::Tensor forward(const at::Tensor& x) { return run_stages(stages(), segments, x); }
  std::vector<Stage> stages() {
    std::vector<Stage> out;
    for (int i = 0; i < 4; ++i) {
      out.push_back({concat("conv", i + 1), {convs[i].ptr()}, [this, i](const at::Tensor& h) {
                       at::Tensor y = torch::relu(convs[i](h));
                       if (i % 2 == 1) y = torch::max_pool2d(y, 2);
                       return i == 3 ? torch::adaptive_avg_pool2d(y, {7, 7}) : y;
                     }});
    }
    for (int i = 0; i < 3; ++i) {
      // nn::linear: a zero-bubble pipeline defers the weight gradient to its W.
      out.push_back({concat("fc", i + 1), {fcs[i].ptr()}, [this, i](const at::Tensor& h) {
                       at::Tensor y = dtrain::nn::linear(i == 0 ? h.flatten(1) : h, fcs[i]->weight,
                                                         fcs[i]->bias);
                       return i < 2 ? torch::relu(y) : y;
                     }});
    }
    return out;
  }
  int64_t segments;
  std::vector<torch::nn::Conv2d> convs;
  std::vector<torch::nn::Linear> fcs;
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
          "shortcut",
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = bn2(conv2(h));
    return torch::relu(h + (shortcut ? shortcut(x) : x));
  }
  torch::nn::Conv2d conv1;
  dtrain::nn::SyncBatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  dtrain::nn::SyncBatchNorm2d bn2;
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
  at::Tensor forward(const at::Tensor& x) { return run_stages(stages(), segments, x); }
  std::vector<Stage> stages() {
    std::vector<Stage> out{{"stem", {stem.ptr(), stem_bn.ptr()}, [this](const at::Tensor& h) {
                              return torch::relu(stem_bn(stem(h)));
                            }}};
    for (size_t i = 0; i < blocks->size(); ++i) {
      out.push_back(
          {"blocks." + std::to_string(i), {blocks->children()[i]}, [this, i](const at::Tensor& h) {
             return (blocks->begin() + static_cast<std::ptrdiff_t>(i))->forward(h);
           }});
    }
    out.push_back({"head", {head.ptr()}, [this](const at::Tensor& h) {
                     return head(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
                   }});
    return out;
  }
  int64_t segments;
  torch::nn::Conv2d stem;
  dtrain::nn::SyncBatchNorm2d stem_bn;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};

template <typename M>
Model with_stages(std::shared_ptr<M> module) {
  Model model(module);
  model.stages = module->stages();
  // Strategies that run the stages themselves (ZeRO-3) checkpoint stage by stage.
  for (size_t i = 0; i + 1 < model.stages.size(); ++i)
    model.stages[i].checkpoint = module->segments > 1;
  return model;
}

}  // namespace

namespace {

// The main job's recipe (configs/fashion-mnist-ddp.toml): SGD with momentum, cosine decay after
// a short warmup.
TrainingRecipe image_recipe() {
  TrainingRecipe r;
  r.optimizer.name = "sgd";
  r.optimizer.lr = 0.05;
  r.optimizer.momentum = 0.9;
  r.optimizer.weight_decay = 5e-4;
  r.schedule.decay = "cosine";
  r.schedule.warmup_steps = 100;
  r.batch_size = 64;
  return r;
}

// configs/fortunes-gpt.toml's: AdamW with decoupled weight decay, cosine decay, clipping (the
// image recipe's SGD leaves the GPT at 3.35 nats/char after 300 steps).
TrainingRecipe gpt_recipe() {
  TrainingRecipe r;
  r.optimizer.name = "adamw";
  r.optimizer.lr = 0.002;
  r.optimizer.weight_decay = 0.1;
  r.schedule.decay = "cosine";
  r.schedule.warmup_steps = 100;
  r.batch_size = 32;
  r.max_grad_norm = 1.0;
  return r;
}

Model build_linear(const ModelSpec& spec) {  // multinomial logistic regression: one layer
  return with_stages(std::make_shared<MlpImpl>(product(spec.input_shape), std::vector<int64_t>{},
                                               spec.classes, spec.checkpointing));
}

Model build_mlp(const ModelSpec& spec) {
  return with_stages(std::make_shared<MlpImpl>(product(spec.input_shape), spec.hidden, spec.classes,
                                               spec.checkpointing));
}

Model build_cnn(const ModelSpec& spec) {
  const auto& shape = spec.input_shape;
  DTRAIN_CHECK_INPUT(shape.size() == 3 && shape[1] >= 4 && shape[2] >= 4, "model ", spec.name,
                     " needs image inputs [C, H>=4, W>=4]");
  const bool fedavg = spec.name == "fedavg-cnn";
  return with_stages(std::make_shared<CnnImpl>(shape[0], shape[1], shape[2], spec.classes,
                                               spec.checkpointing, fedavg ? 5 : 3,
                                               fedavg ? 512 : 128));
}

Model build_vgg(const ModelSpec& spec) {
  const auto& shape = spec.input_shape;
  DTRAIN_CHECK_INPUT(shape.size() == 3 && shape[1] >= 4 && shape[2] >= 4, "model ", spec.name,
                     " needs image inputs [C, H>=4, W>=4]");
  return with_stages(std::make_shared<VggImpl>(shape[0], spec.classes, spec.checkpointing));
}

Model build_resnet(const ModelSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.input_shape.size() == 3, "model resnet needs image inputs [C, H, W]");
  return with_stages(
      std::make_shared<ResNetImpl>(spec.input_shape[0], spec.classes, spec.checkpointing));
}

// The GPT's sizes (its vocabulary comes from the data, checked when it is read) against the
// tensor-parallel ranks: whole heads per rank, a sequence that splits evenly.
void check_gpt_layout(const ModelSpec& spec, const ModelLayout& layout) {
  GptConfig config = decoder_config(spec);
  config.vocab = std::max<int64_t>(config.vocab, 2);
  config.checkpointing = spec.checkpointing;
  config.sequence_parallel = layout.sequence_parallel && layout.tensor_parallel > 1;
  validate(config);
  const int tp = layout.tensor_parallel;
  DTRAIN_CHECK_INPUT(!layout.sequence_parallel || tp > 1,
                     "--sequence-parallel splits the sequence over the tensor-parallel ranks: "
                     "it needs --tensor-parallel 2 or more");
  check_context_parallel(config, layout.context_parallel, tp);
  if (tp <= 1) return;
  DTRAIN_CHECK_INPUT(config.heads % tp == 0, "--tensor-parallel ", tp, " must divide --heads (",
                     config.heads, "): each rank takes whole heads");
  DTRAIN_CHECK_INPUT(kv_heads_of(config) % tp == 0 || tp % kv_heads_of(config) == 0,
                     "--tensor-parallel ", tp, " and --kv-heads (", kv_heads_of(config),
                     "): one must divide the other (each rank takes whole key/value heads, or "
                     "shares one with --tensor-parallel / --kv-heads ranks)");
  DTRAIN_CHECK_INPUT(!layout.sequence_parallel || config.context % tp == 0,
                     "--sequence-parallel splits the --context of ", config.context,
                     " tokens over --tensor-parallel ", tp, ": it must be a multiple of it");
}

template <int Depth>
Model build_torchvision_resnet(const ModelSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.input_shape.size() == 3, "model resnet", Depth,
                     " needs image inputs [C, H, W]");
  return make_torchvision_resnet(Depth, spec.input_shape[0], spec.classes, spec.checkpointing);
}

Model build_gpt(const ModelSpec& spec, const comm::CommunicatorPtr& tensor_parallel) {
  GptConfig config = decoder_config(spec);
  config.checkpointing = spec.checkpointing;
  return make_gpt(config, tensor_parallel, spec.deferred, spec.expert_parallel,
                  spec.context_parallel);
}

// The flags of the built-in models: the MLP's widths, the decoder's shape (what `dtrain train`
// builds and `dtrain plan` predicts, from the same flags and config files).
FlagGroup<ModelSpec> mlp_flags() {
  return {"mlp", [](FlagSet& flags, ModelSpec& spec) {
            flags.add("--hidden", spec.hidden, "MLP hidden layer widths");
          }};
}

FlagGroup<ModelSpec> decoder_flags() {
  return {"decoder", [](FlagSet& flags, ModelSpec& spec) {
            GptConfig& gpt = spec.gpt;
            flags.add("--layers", gpt.layers, "gpt, llama: transformer blocks");
            flags.add("--heads", gpt.heads, "gpt, llama: attention (query) heads");
            flags.add("--kv-heads", gpt.kv_heads,
                      "gpt, llama: key/value heads, grouped-query attention (0 = --heads; must "
                      "divide it)");
            flags.add("--width", gpt.width,
                      "gpt, llama: model width (a multiple of --heads unless --head-dim is given)");
            flags.add("--head-dim", gpt.head_dim,
                      "gpt, llama: each attention head's width (0 = --width / --heads; Qwen3's "
                      "head_dim)");
            flags
                .add("--qk-norm", gpt.qk_norm,
                     "gpt, llama: RMSNorm over each head's queries and keys before the rotary "
                     "embeddings (Qwen3's q_norm and k_norm)")
                .show_default = false;
            flags.add("--ffn-width", gpt.ffn_width,
                      "gpt, llama: the MLP's hidden width (0 = 4 x --width for gpt; llama: 8/3 "
                      "x --width rounded up to a multiple of 64)");
            flags.add("--context", gpt.context,
                      "gpt, llama: tokens per example (the attention window)");
            flags.add("--rope-theta", gpt.rope_theta,
                      "llama: the rotary embeddings' base (Llama 2: 10000; Llama 3: 500000)");
            flags.add("--norm-eps", gpt.norm_eps, "gpt, llama: LayerNorm's / RMSNorm's epsilon");
            flags.add("--dropout", gpt.dropout, "gpt, llama: dropout probability");
            flags
                .add("--tied-embeddings", gpt.tied_embeddings,
                     "gpt, llama: the output layer reuses the token embedding's weight")
                .show_default = false;
            flags.add("--moe-experts", gpt.moe_experts,
                      "llama: routed experts of each mixture-of-experts block (0 = dense MLPs)");
            flags.add("--moe-top-k", gpt.moe_top_k, "llama: experts each token is routed to");
            flags.add("--moe-shared-experts", gpt.moe_shared_experts,
                      "llama: experts every token goes through (DeepSeek's shared experts)");
            flags.add("--moe-every", gpt.moe_every,
                      "llama: a mixture-of-experts block every N blocks (after the dense ones)");
            flags.add("--moe-first-dense", gpt.moe_first_dense,
                      "llama: the first K blocks keep a dense MLP (DeepSeek's layout)");
            flags.add("--moe-capacity", gpt.moe_capacity,
                      "llama: capacity factor: each expert takes at most ceil(F x tokens x top-k "
                      "/ experts) tokens, the rest dropped and counted (0 = dropless)");
            flags.add("--moe-score", gpt.moe_score,
                      "llama: the router's scores: softmax (Mixtral, Qwen3-MoE) or sigmoid "
                      "(DeepSeek-V3)");
            flags.add_negated("--no-moe-normalize", gpt.moe_normalize,
                              "llama: the top k's scores as they are, not divided by their sum "
                              "(Qwen3-MoE's norm_topk_prob false)");
            flags.add("--moe-ffn-width", gpt.moe_ffn_width,
                      "llama: each expert's hidden width (0 = --ffn-width's)");
            flags.add("--moe-aux-loss", gpt.moe_aux_loss,
                      "llama: coefficient of the Switch/GShard load-balancing loss");
            flags.add("--moe-z-loss", gpt.moe_z_loss, "llama: coefficient of the router z-loss");
          }};
}

// Every model by name: how it is built, what it can do, its recipe. Adding a model: a builder
// and one line here (or register_model from outside the library).
std::vector<ModelInfo> built_in() {
  auto classifier = [](const char* name, const char* summary, Model (*build)(const ModelSpec&)) {
    ModelInfo info;
    info.name = name;
    info.summary = summary;
    info.build = [build](const ModelSpec& spec, const comm::CommunicatorPtr&) {
      return build(spec);
    };
    info.recipe = image_recipe();
    return info;
  };
  std::vector<ModelInfo> all = {
      classifier("mlp", "multilayer perceptron (--hidden widths)", build_mlp),
      classifier("linear", "multinomial logistic regression", build_linear),
      classifier("cnn", "a small CNN (3x3 convolutions)", build_cnn),
      classifier("fedavg-cnn", "McMahan et al.'s CNN (5x5 convolutions, a 512-unit layer)",
                 build_cnn),
      classifier("vgg",
                 "a VGG-style CNN: 4 3x3 convolutions (most of the compute), 3 large "
                 "fully-connected layers (most of the parameters)",
                 build_vgg),
      classifier("resnet", "a ResNet-style CNN (BatchNorm)", build_resnet),
  };
  all.front().flags = {mlp_flags()};
  all.back().parameters_only = false;  // BatchNorm's running statistics
  all.push_back(classifier("resnet18",
                           "torchvision's ResNet-18 (its names: weights load both ways)",
                           build_torchvision_resnet<18>));
  all.back().parameters_only = false;
  all.push_back(classifier("resnet50", "torchvision's ResNet-50 (v1.5, its names)",
                           build_torchvision_resnet<50>));
  all.back().parameters_only = false;
  ModelInfo gpt;
  gpt.name = "gpt";
  gpt.summary = "a GPT language model (on the text data set)";
  gpt.language_model = true;
  gpt.tensor_parallel = true;
  gpt.recipe = gpt_recipe();
  gpt.build = build_gpt;
  gpt.check_layout = check_gpt_layout;
  gpt.flags = {decoder_flags()};
  all.push_back(gpt);
  ModelInfo llama = gpt;
  llama.name = "llama";
  llama.summary =
      "a Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention "
      "(--kv-heads), no biases";
  llama.decoder_preset = llama_preset;
  all.push_back(llama);
  return all;
}

Registry<ModelInfo>& registry() {
  static Registry<ModelInfo> all("model", "--model", built_in());
  return all;
}

}  // namespace

std::vector<std::string> model_names() { return registry().names(); }

void declare_model_flags(FlagSet& flags, ModelSpec& spec,
                         const std::function<bool(const ModelInfo&)>& keep) {
  declare_flag_groups(flags, spec, registry().all(), keep);
}

const ModelInfo& model_info(const std::string& name) { return registry().at(name); }

void register_model(ModelInfo info) {
  DTRAIN_CHECK_INPUT(info.build, "register_model: a model needs a builder");
  registry().add(std::move(info));
}

TrainingRecipe training_recipe(const std::string& model) { return model_info(model).recipe; }

GptConfig decoder_config(const ModelSpec& spec) {
  GptConfig config = spec.gpt;
  const ModelInfo& info = model_info(spec.name);
  if (info.decoder_preset) info.decoder_preset(config);
  return config;
}

Model make_model(const ModelSpec& spec, const comm::CommunicatorPtr& tensor_parallel) {
  const ModelInfo& info = model_info(spec.name);
  DTRAIN_CHECK_INPUT(info.tensor_parallel || !tensor_parallel || tensor_parallel->size() == 1,
                     "--model ", spec.name, " has no tensor-parallel layers; --tensor-parallel ",
                     tensor_parallel ? tensor_parallel->size() : 1,
                     " needs --model gpt (or a model built from nn/tensor/Layers.h)");
  DTRAIN_CHECK_INPUT(
      info.language_model || !spec.expert_parallel || spec.expert_parallel->size() == 1, "--model ",
      spec.name,
      " has no experts; --expert-parallel needs --model llama "
      "with --moe-experts");
  DTRAIN_CHECK_INPUT(
      info.language_model || !spec.context_parallel || spec.context_parallel->size() == 1,
      "--model ", spec.name,
      " has no sequence to split; --context-parallel needs a model with attention over a "
      "sequence (--model gpt or llama)");
  DTRAIN_CHECK_INPUT(info.language_model || spec.classes >= 2,
                     "model needs at least 2 classes, got ", spec.classes);
  return info.build(spec, tensor_parallel);
}

}  // namespace dtrain::models
