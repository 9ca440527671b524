#include "dtrain/plan/ModelCost.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "dtrain/common/Error.h"
#include "dtrain/models/Gpt.h"

namespace dtrain::plan {

int64_t ModelCost::parameters() const {
  int64_t total = 0;
  for (const auto& layer : layers) total += layer.parameters;
  return total;
}

double ModelCost::model_flops_per_sample() const {
  double forward = 0;
  for (const auto& layer : layers) forward += layer.matmul_flops;
  return 3 * forward;  // backward: the gradients of inputs and of weights, each as forward
}

namespace {

/// A block whose MLP is a mixture of experts (nn/Moe.h): the dense MLP's terms (`mlp_elementwise`,
/// `mlp_saved` per token) replaced by a linear router over E experts, each token's top-k SwiGLU
/// experts of width F (the rank's tokens x k rows through them: timed as one grouped product, as
/// Megatron-Core's grouped GEMM runs them; dtrain's loop over experts launches 5 operators per
/// expert), and S shared experts on every token. The layer is replicated over the TP group
/// (only attention's output is all-reduced); each all-to-all moves the tokens' k copies.
void mixture_of_experts(Layer& block, const TransformerShape& shape, double mlp_elementwise,
                        double mlp_saved) {
  const double h = shape.hidden, s = shape.sequence, E = shape.experts, k = shape.top_k;
  const double f = shape.ffn > 0 ? shape.ffn : 4 * h, bias = shape.bias ? 1 : 0;
  const double F = shape.expert_ffn > 0 ? shape.expert_ffn : f, S = shape.shared_experts;
  const double mlp_in = shape.swiglu ? 2 * f : f;
  // Out: the dense MLP.
  block.parameters -= static_cast<int64_t>((h + bias) * mlp_in + (f + bias) * h);
  block.matmul_flops -= 2 * s * (h * mlp_in + f * h);
  block.gemms.resize(2);
  block.column_parallel_flops -= 2 * s * h * mlp_in;
  block.elementwise_elements -= s * mlp_elementwise;
  block.saved_elements -= s * mlp_saved;
  block.kernels -= shape.swiglu ? 5 : 4;
  block.tp_allreduces = 1;
  // In: the router, the routed experts (gate, up, down) and the shared ones.
  const double router = E * h, experts = E * 3 * h * F, shared = S * 3 * h * F;
  block.parameters += static_cast<int64_t>(router + experts + shared);
  block.expert_parameters = static_cast<int64_t>(experts);
  block.replicated_parameters += static_cast<int64_t>(router + shared);
  block.matmul_flops += 2 * s * (h * E + k * 3 * h * F + S * 3 * h * F);
  block.gemms.push_back({s, E, h, Gemm::Whole});
  block.gemms.push_back({s * k, 2 * F, h, Gemm::Whole});
  block.gemms.push_back({s * k, h, F, Gemm::Whole});
  if (S > 0) {
    block.gemms.push_back({s, 2 * S * F, h, Gemm::Whole});
    block.gemms.push_back({s, h, S * F, Gemm::Whole});
  }
  // Routing (softmax and top-k over E scores: 4 passes), the rows gathered by expert and the
  // results weighted and added back (2 + 3 passes over tokens x k x h), SwiGLU on each expert's
  // rows (5 per hidden unit) and on the shared experts'.
  block.elementwise_elements += s * (4 * E + 5 * k * h + 5 * k * F + 5 * S * F);
  block.kernels += 12 + 5 * E + (S > 0 ? 5 : 0);
  // Kept for backward: the router's scores, the rows sent (k x h per token), each expert's
  // gate, up and product (3 k F), the shared experts' (3 S F); none of it split by TP.
  const double moe_saved = s * (E + k * h + 3 * k * F + 3 * S * F);
  block.saved_elements += moe_saved;
  block.replicated_saved_elements += moe_saved;
  block.alltoall_elements = s * k * h;
}

}  // namespace

ModelCost transformer(const TransformerShape& shape, const std::string& name) {
  const double h = shape.hidden, s = shape.sequence, a = shape.heads, v = shape.vocabulary;
  const double f = shape.ffn > 0 ? shape.ffn : 4 * h;
  DTRAIN_CHECK_INPUT(shape.layers > 0 && shape.hidden > 0 && shape.heads > 0 &&
                         shape.sequence > 0 && shape.vocabulary > 0,
                     "a transformer needs layers, hidden, heads, seq and vocab > 0");
  DTRAIN_CHECK_INPUT(shape.head_dim > 0 || shape.hidden % shape.heads == 0, "transformer: hidden ",
                     shape.hidden, " is not divisible by heads ", shape.heads,
                     " (give the head width)");
  const int kv_heads = shape.kv_heads > 0 ? shape.kv_heads : shape.heads;
  DTRAIN_CHECK_INPUT(shape.heads % kv_heads == 0, "transformer: kv heads ", kv_heads,
                     " do not divide heads ", shape.heads);
  // Grouped-query attention: K and V have g x ah columns each, where ah = heads x head width is
  // the query's and the output projection's (h unless the head width is given).
  const double g = static_cast<double>(kv_heads) / shape.heads;
  const double ah = shape.head_dim > 0 ? a * shape.head_dim : h;
  // Qwen3's head norms: RMSNorm of the queries' and keys' ah (1 + g) elements, one weight of
  // head_dim each, replicated over TP.
  const double qk_norms = shape.qk_norm ? 2 * ah / a : 0;
  const double qk_norm_elements = shape.qk_norm ? 2 * ah * (1 + g) : 0;
  const double bias = shape.bias ? 1 : 0;
  const double norm = shape.rmsnorm ? h : h * (1 + bias);  // one norm's parameters
  const double mlp_in = shape.swiglu ? 2 * f : f;          // the MLP's first projection(s)
  ModelCost model;
  model.name = name;
  model.tokens_per_sample = shape.sequence;
  model.heads = shape.heads;

  // Token and (learned) position embeddings (vocabulary-parallel under TP: one all-reduce of
  // the output), then embedding dropout.
  Layer embedding;
  embedding.name = "embedding";
  const double positions = shape.rope ? 0 : s * h;
  embedding.parameters = static_cast<int64_t>(v * h + positions);
  const double drop = shape.dropout ? 1 : 0;
  // gather (read, write) and the position add (read 2, write 1: one more); dropout reads,
  // writes and writes its mask
  embedding.elementwise_elements = (2 + (shape.rope ? 0 : 1) + 3 * drop) * s * h;
  embedding.kernels = (shape.rope ? 2 : 3) + 2 * drop;
  embedding.saved_elements = drop * s * h;  // the dropout mask; the indices are negligible
  embedding.replicated_saved_elements = drop * s * h;
  embedding.output_elements = s * h;
  embedding.tensor_parallel = true;
  embedding.tp_allreduces = 1;
  embedding.replicated_parameters = static_cast<int64_t>(positions);
  model.layers.push_back(embedding);

  // A pre-norm block. Matrix products: Q, K, V (h (1 + 2g) outputs) and the output projection,
  // the MLP (h x mlp_in and f x h), attention's scores and weighted sum (2 s h per token each
  // way, whatever g). Element-wise traffic per token, in elements: two norms (read + write,
  // 4h), head split copies of Q, K, V and the merge of the output (2h (1 + 2g) + 2h), two
  // residual adds (6h) and with dropout two dropouts (6h), GELU (2f) or SwiGLU's SiLU and
  // product (5f), rotary positions on Q and K (read, read the table, write: 3h (1 + g)); per
  // head and query, scale-mask-softmax over s keys (3 a s fused) and its dropout (2 a s).
  // Saved for backward (Korthikanti et al. 2022, 34 s h + 5 a s^2 bytes at 16 bits for GPT-3's
  // block, here in elements): the norms' inputs and outputs (4 s h), Q, K and V (s h (1 + 2g)),
  // the projection's input (s h), the MLP's intermediates (GELU: its input and output, 2 s f;
  // SwiGLU: gate, up and product, 3 s f), the dropout masks (s h, half an element each) and
  // attention's core (2.5 a s^2); 5 s h (norm inputs and outputs, dropout masks) tensor
  // parallelism does not split. Without dropout its masks (2 s h + a s^2 bytes) go and
  // attention's dropout output is softmax's (2 a s^2 bytes).
  const double mlp_elementwise = shape.swiglu ? 5 * f : 2 * f;
  const double mlp_saved = shape.swiglu ? 3 * f : 2 * f;
  const double rope_elementwise = shape.rope ? 3 * ah * (1 + g) : 0;
  model.experts = shape.experts;
  for (int i = 0; i < shape.layers; ++i) {
    Layer block;
    block.name = concat("block.", i);
    const double qkv = ah * (1 + 2 * g);
    block.parameters = static_cast<int64_t>(2 * norm + qk_norms + (h + bias) * qkv +
                                            (ah + bias) * h + (h + bias) * mlp_in + (f + bias) * h);
    block.matmul_flops = 2 * s * (h * qkv + ah * h + h * mlp_in + f * h) + 4 * s * s * ah;
    block.matmul_dim = h;
    block.gemms = {{s, qkv, h, Gemm::Columns},
                   {s, h, ah, Gemm::Inner},
                   {s, mlp_in, h, Gemm::Columns},
                   {s, h, f, Gemm::Inner}};
    const bool moe = shape.experts > 0 && i >= shape.moe_first_dense &&
                     (i - shape.moe_first_dense) % std::max(1, shape.moe_every) == 0;
    // Attention's scores: fused scale-mask-softmax reads and writes them once (2 passes; the
    // 3 a s above counts the mask); written out, the scale (2), masked_fill (2 + its mask) and
    // softmax (2) pass over them three times.
    const double score_passes = shape.fused_softmax ? 3 : 6;
    block.elementwise_elements = s * (10 * h + 2 * qkv + 2 * ah + 6 * drop * h + mlp_elementwise +
                                      rope_elementwise + qk_norm_elements) +
                                 (score_passes + 2 * drop) * a * s * s;
    block.kernels = 18 + 4 * drop + (shape.fused_softmax ? 0 : 2) + (shape.swiglu ? 1 : 0) +
                    (shape.rope ? 2 : 0) + (shape.qk_norm ? 2 : 0);
    block.saved_elements = s * (4 * h + qkv + ah + mlp_saved + qk_norm_elements / 2) +
                           drop * s * h + (1 + 1.5 * drop) * a * s * s;
    block.replicated_saved_elements = (4 + drop) * s * h;
    // Selective recomputation: softmax's output, the dropout mask and its output (a s^2 each,
    // the mask half an element) go; the scores and the weighted sum are computed again.
    block.attention_saved_elements = (1 + 1.5 * drop) * a * s * s;
    block.attention_flops = 4 * s * s * ah;
    block.attention_elements = (score_passes + 2 * drop) * a * s * s;
    block.attention_kernels = (shape.fused_softmax ? 3 : 5) + 2 * drop;
    block.output_elements = s * h;
    block.tensor_parallel = true;
    block.tp_allreduces = 2;
    block.column_parallel_flops = 2 * s * (h * qkv + h * mlp_in);
    // 2 norms (and the head norms), the row-parallel layers' biases
    block.replicated_parameters = static_cast<int64_t>(2 * norm + qk_norms + 2 * bias * h);
    block.block = true;
    block.kv_elements = 2 * g * s * ah;
    block.qkvo_elements = (2 + 2 * g) * s * ah;
    block.core_flops = (shape.flash ? 2 : 4) * s * s * ah;
    if (shape.flash) {
      // One kernel reads Q, K, V and writes the output (and its log-sum-exp per row, kept for
      // backward, in fp32); no score or mask tensor exists; of the 4 s^2 h flops only the
      // blocks on and below the diagonal are computed (half), and backward computes the scores
      // (half of 2 s^2 h) again. Selective recomputation has nothing left to drop.
      block.elementwise_elements -= block.attention_elements;
      block.elementwise_elements += 4 * s * ah;
      block.saved_elements -= block.attention_saved_elements;
      block.saved_elements += 2 * a * s;
      block.kernels -= block.attention_kernels - 1;
      block.skipped_flops = 2 * s * s * ah;
      block.recomputed_backward_flops = s * s * ah;
      block.attention_saved_elements = 0;
      block.attention_flops = 0;
      block.attention_elements = 0;
      block.attention_kernels = 0;
    }
    if (moe) mixture_of_experts(block, shape, mlp_elementwise, mlp_saved);
    model.layers.push_back(block);
  }

  // Final norm and the output projection (tied to the token embedding: no parameters of its
  // own; untied: its own vocabulary x width weight), then the softmax cross-entropy over the
  // vocabulary (kept in fp32: 2 elements each).
  Layer head;
  head.name = "head";
  head.parameters = static_cast<int64_t>(norm + (shape.tied ? 0 : v * h));
  head.matmul_flops = 2 * s * h * v;
  head.matmul_dim = std::min(h, v);
  head.gemms = {{s, v, h, Gemm::Columns}};
  head.elementwise_elements = 4 * s * h + 8 * s * v;
  head.kernels = 10;
  head.saved_elements = 2 * s * h + 2 * s * v;
  head.replicated_saved_elements = 2 * s * h;
  head.output_elements = 1;
  head.tensor_parallel = true;
  head.replicated_parameters = static_cast<int64_t>(norm);  // the final norm
  model.layers.push_back(head);
  return model;
}

ModelCost decoder(const models::GptConfig& config, const std::string& model, int64_t vocabulary,
                  bool flash) {
  models::validate(config);
  TransformerShape shape;
  shape.experts = static_cast<int>(config.moe_experts);
  shape.top_k = static_cast<int>(config.moe_top_k);
  shape.expert_ffn =
      config.moe_experts > 0 ? static_cast<int>(models::expert_ffn_width_of(config)) : 0;
  shape.shared_experts = static_cast<int>(config.moe_shared_experts);
  shape.moe_every = static_cast<int>(config.moe_every);
  shape.moe_first_dense = static_cast<int>(config.moe_first_dense);
  shape.layers = static_cast<int>(config.layers);
  shape.hidden = static_cast<int>(config.width);
  shape.heads = static_cast<int>(config.heads);
  shape.sequence = static_cast<int>(config.context);
  shape.vocabulary = static_cast<int>(vocabulary);
  shape.ffn = static_cast<int>(models::ffn_width_of(config));
  shape.kv_heads = static_cast<int>(models::kv_heads_of(config));
  shape.tied = config.tied_embeddings;
  shape.dropout = config.dropout > 0;
  shape.flash = flash;
  shape.fused_softmax = flash;  // (written out, as dtrain's GPT on LibTorch 1.13)
  shape.swiglu = config.mlp == "swiglu";
  shape.rope = config.position == "rope";
  shape.rmsnorm = config.norm == "rmsnorm";
  shape.bias = config.bias;
  shape.head_dim = static_cast<int>(config.head_dim);
  shape.qk_norm = config.qk_norm;
  ModelCost cost = transformer(
      shape,
      concat(model, " (", config.layers, " layers, width ", config.width, ", ", config.heads,
             " heads",
             shape.kv_heads != shape.heads ? concat(" / ", shape.kv_heads, " kv") : std::string(),
             ", context ", config.context, ", vocabulary ", vocabulary, ")"));
  cost.train_flags = concat(
      "--model ", model, " --layers ", config.layers, " --width ", config.width, " --heads ",
      config.heads, " --kv-heads ", shape.kv_heads,
      config.head_dim > 0 ? concat(" --head-dim ", config.head_dim) : std::string(),
      config.qk_norm ? " --qk-norm" : "", " --ffn-width ", shape.ffn, " --context ", config.context,
      config.tied_embeddings ? " --tied-embeddings" : "",
      config.dropout > 0 ? concat(" --dropout ", config.dropout) : std::string(),
      shape.rope && config.rope_theta != models::GptConfig{}.rope_theta
          ? concat(" --rope-theta ", config.rope_theta)
          : std::string(),
      config.norm_eps != models::GptConfig{}.norm_eps ? concat(" --norm-eps ", config.norm_eps)
                                                      : std::string(),
      config.moe_experts > 0
          ? concat(" --moe-experts ", config.moe_experts, " --moe-top-k ", config.moe_top_k,
                   " --moe-ffn-width ", shape.expert_ffn, " --moe-shared-experts ",
                   config.moe_shared_experts, " --moe-every ", config.moe_every,
                   " --moe-first-dense ", config.moe_first_dense,
                   config.moe_normalize ? "" : " --no-moe-normalize")
          : std::string());
  cost.kv_heads = shape.kv_heads;
  cost.tied_embeddings = config.tied_embeddings;
  return cost;
}

namespace {

// ResNet-50 (He et al. 2016) at 224x224: every convolution with its batch norm and ReLU.
ModelCost resnet50() {
  ModelCost model;
  model.name = "resnet50";
  auto conv = [&](const std::string& name, double cin, double cout, double k, double out_hw,
                  bool relu) {
    Layer layer;
    layer.name = name;
    const double out = cout * out_hw * out_hw;
    layer.parameters = static_cast<int64_t>(cin * cout * k * k + 2 * cout);
    layer.matmul_flops = 2 * cin * k * k * out;
    layer.matmul_dim = std::min(cout, cin * k * k);
    // batch norm reads its input twice (statistics, normalization) and writes it; ReLU reads
    // and writes; the residual add of a block's last convolution is counted with it.
    layer.elementwise_elements = out * (relu ? 5 : 3);
    layer.kernels = relu ? 3 : 2;
    layer.saved_elements = out * (relu ? 2 : 1);  // batch norm's output, ReLU's; + input below
    layer.output_elements = out;
    model.layers.push_back(layer);
  };
  conv("conv1", 3, 64, 7, 112, true);
  model.layers.back().saved_elements += 3 * 224 * 224;
  model.layers.back().elementwise_elements += 64 * 112 * 112 * 2 + 64 * 56 * 56;  // max pool
  double in_channels = 64, hw = 56;
  const int blocks[] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const double width = 64 << stage;
    for (int b = 0; b < blocks[stage]; ++b) {
      const bool downsample = b == 0;
      const double out_hw = stage > 0 && b == 0 ? hw / 2 : hw;
      const std::string prefix = concat("layer", stage + 1, ".", b, ".");
      const double in_elements = in_channels * hw * hw;
      conv(prefix + "conv1", in_channels, width, 1, hw, true);
      model.layers.back().saved_elements += in_elements;
      conv(prefix + "conv2", width, width, 3, out_hw, true);
      model.layers.back().saved_elements += width * hw * hw;
      conv(prefix + "conv3", width, 4 * width, 1, out_hw, true);
      model.layers.back().saved_elements += width * out_hw * out_hw;
      if (downsample) {
        conv(prefix + "downsample", in_channels, 4 * width, 1, out_hw, false);
        model.layers.back().saved_elements += in_elements;
      }
      in_channels = 4 * width;
      hw = out_hw;
    }
  }
  Layer fc;
  fc.name = "fc";
  fc.parameters = 2048 * 1000 + 1000;
  fc.matmul_flops = 2.0 * 2048 * 1000;
  fc.matmul_dim = 1000;
  fc.elementwise_elements = 2048 * 7 * 7 + 4 * 1000;  // average pool, softmax
  fc.kernels = 4;
  fc.saved_elements = 2048 + 1000;
  fc.output_elements = 1;
  model.layers.push_back(fc);
  return model;
}

// VGG (Simonyan & Zisserman 2015): 3x3 convolutions with ReLU, 2x2 max pooling after each
// block, then fully-connected layers with ReLU (PipeDream's example: the convolutions hold the
// compute, the dense layers the parameters). `blocks`: (convolutions, channels) per block.
// "vgg16" at 224x224 (138M parameters); "vgg-small" is dtrain's --model vgg on 28x28x1 (4.3M).
ModelCost vgg(const std::string& name, double channels, double hw,
              const std::vector<std::pair<int, double>>& blocks, const std::vector<double>& dense,
              double pooled_hw) {
  ModelCost model;
  model.name = name;
  double in = channels;
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (int c = 0; c < blocks[b].first; ++c) {
      const double out_channels = blocks[b].second;
      const bool pools = c + 1 == blocks[b].first;
      Layer layer;
      layer.name = concat("conv", b + 1, "_", c + 1);
      const double out = out_channels * hw * hw;
      layer.parameters = static_cast<int64_t>(in * out_channels * 9 + out_channels);
      layer.matmul_flops = 2 * in * 9 * out;
      layer.matmul_dim = std::min(out_channels, in * 9);
      // bias + ReLU (read, write), max pooling after the block's last (read, write a quarter)
      layer.elementwise_elements = 2 * out + (pools ? 1.25 * out : 0);
      layer.kernels = pools ? 3 : 2;
      layer.saved_elements = in * hw * hw + out;  // the input (for dW) and ReLU's output
      layer.output_elements = pools ? out / 4 : out;
      model.layers.push_back(layer);
      in = out_channels;
    }
    hw /= 2;
  }
  double width = in * pooled_hw * pooled_hw;
  for (size_t i = 0; i < dense.size(); ++i) {
    Layer fc;
    fc.name = concat("fc", i + 1);
    fc.parameters = static_cast<int64_t>(width * dense[i] + dense[i]);
    fc.matmul_flops = 2 * width * dense[i];
    fc.matmul_dim = std::min(width, dense[i]);
    fc.elementwise_elements = 2 * dense[i];
    fc.kernels = 2;
    fc.saved_elements = width + dense[i];
    fc.output_elements = dense[i];
    model.layers.push_back(fc);
    width = dense[i];
  }
  return model;
}

struct Preset {
  const char* name;
  const char* what;
  TransformerShape shape;
};
// The papers' models (their tables' shapes): Shoeybi et al. 2019 Table 1 (seq 1024, vocab
// 51,200), Narayanan et al. 2021 Table 1 (seq 2048, vocab 51,200).
const Preset kPresets[] = {
    {"megatron-1.2b", "Shoeybi et al. 2019, 1.2B", {40, 1536, 16, 1024, 51200, 0}},
    {"megatron-2.5b", "Shoeybi et al. 2019, 2.5B", {54, 1920, 20, 1024, 51200, 0}},
    {"megatron-4.2b", "Shoeybi et al. 2019, 4.2B", {64, 2304, 24, 1024, 51200, 0}},
    {"megatron-8.3b", "Shoeybi et al. 2019, 8.3B", {72, 3072, 32, 1024, 51200, 0}},
    {"gpt-1.7b", "Narayanan et al. 2021, 1.7B", {24, 2304, 24, 2048, 51200, 0}},
    {"gpt-3.6b", "Narayanan et al. 2021, 3.6B", {30, 3072, 32, 2048, 51200, 0}},
    {"gpt-7.5b", "Narayanan et al. 2021, 7.5B", {36, 4096, 32, 2048, 51200, 0}},
    {"gpt-18b", "Narayanan et al. 2021, 18.4B", {40, 6144, 48, 2048, 51200, 0}},
    {"gpt-39b", "Narayanan et al. 2021, 39.1B", {48, 8192, 64, 2048, 51200, 0}},
    {"gpt-76b", "Narayanan et al. 2021, 76.1B", {60, 10240, 80, 2048, 51200, 0}},
    {"gpt-146b", "Narayanan et al. 2021, 145.6B", {80, 12288, 96, 2048, 51200, 0}},
    {"gpt-310b", "Narayanan et al. 2021, 310.1B", {96, 16384, 128, 2048, 51200, 0}},
    {"gpt-530b", "Narayanan et al. 2021, 529.6B", {105, 20480, 128, 2048, 51200, 0}},
    {"gpt-1t", "Narayanan et al. 2021, 1008B", {128, 25600, 160, 2048, 51200, 0}},
};

TransformerShape parse_shape(const std::string& text) {
  // "transformer:layers=24,hidden=1024,heads=16,seq=1024,vocab=51200[,ffn=4096]"
  TransformerShape shape;
  int tied = 1, dropout = 1, fused = 1, flash = 0;
  std::map<std::string, int*> fields = {
      {"layers", &shape.layers}, {"hidden", &shape.hidden},    {"heads", &shape.heads},
      {"seq", &shape.sequence},  {"vocab", &shape.vocabulary}, {"ffn", &shape.ffn},
      {"tied", &tied},           {"dropout", &dropout},        {"fused", &fused},
      {"flash", &flash}};
  const char* keys = "keys: layers, hidden, heads, seq, vocab, ffn, tied, dropout, fused, flash";
  auto is_flag = [](const std::string& key) {
    return key == "tied" || key == "dropout" || key == "fused" || key == "flash";
  };
  std::stringstream items(text.substr(text.find(':') + 1));
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto eq = item.find('=');
    DTRAIN_CHECK_INPUT(eq != std::string::npos, "--model '", text, "': '", item,
                       "' is not key=value (", keys, ")");
    const std::string key = item.substr(0, eq);
    const auto field = fields.find(key);
    DTRAIN_CHECK_INPUT(field != fields.end(), "--model '", text, "': unknown key '", key, "' (",
                       keys, ")");
    try {
      size_t used = 0;
      const int value = std::stoi(item.substr(eq + 1), &used);
      const bool flag = is_flag(key);
      DTRAIN_CHECK_INPUT(
          used == item.size() - eq - 1 && (flag ? value == 0 || value == 1 : value > 0), "bad");
      *field->second = value;
    } catch (const std::exception&) {
      DTRAIN_THROW(InputError, "--model '", text, "': ", key,
                   is_flag(key) ? " must be 0 or 1" : " must be a positive integer", ", got '",
                   item.substr(eq + 1), "'");
    }
  }
  for (const char* key : {"layers", "hidden", "heads", "seq", "vocab"}) {
    DTRAIN_CHECK_INPUT(*fields[key] > 0, "--model '", text, "': missing ", key, "=");
  }
  shape.tied = tied == 1;
  shape.dropout = dropout == 1;
  shape.fused_softmax = fused == 1;
  shape.flash = flash == 1;
  return shape;
}

/// The papers' GPTs as dtrain's GPT: its flags for the shape (dropout 0.1 as Megatron's).
ModelCost with_gpt_flags(ModelCost model, const TransformerShape& shape) {
  model.train_flags =
      concat("--model gpt --layers ", shape.layers, " --width ", shape.hidden, " --heads ",
             shape.heads, " --context ", shape.sequence,
             shape.ffn > 0 && shape.ffn != 4 * shape.hidden ? concat(" --ffn-width ", shape.ffn)
                                                            : std::string(),
             shape.tied ? " --tied-embeddings" : "", shape.dropout ? " --dropout 0.1" : "");
  return model;
}

}  // namespace

std::vector<std::string> known_models() {
  std::vector<std::string> names = {"resnet50", "vgg16", "vgg-small"};
  for (const auto& preset : kPresets) names.push_back(preset.name);
  names.push_back(
      "transformer:layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F,tied=0,dropout=0,fused=0,"
      "flash=1]");
  return names;
}

ModelCost model_named(const std::string& text) {
  if (text == "resnet50") {
    ModelCost model = resnet50();
    model.train_flags = "--model resnet50";
    return model;
  }
  if (text == "vgg16") {
    return vgg("vgg16", 3, 224, {{2, 64}, {2, 128}, {3, 256}, {3, 512}, {3, 512}},
               {4096, 4096, 1000}, 7);
  }
  if (text == "vgg-small") {
    ModelCost model = vgg("vgg-small", 1, 28, {{2, 32}, {2, 64}}, {1024, 1024, 10}, 7);
    model.train_flags = "--model vgg";  // dtrain's VGG on 28 x 28 images
    return model;
  }
  for (const auto& preset : kPresets) {
    if (text == preset.name)
      return with_gpt_flags(transformer(preset.shape, preset.name), preset.shape);
  }
  if (text.rfind("transformer:", 0) == 0) {
    const TransformerShape shape = parse_shape(text);
    return with_gpt_flags(transformer(shape, text), shape);
  }
  std::string known;
  for (const auto& name : known_models()) known += (known.empty() ? "" : ", ") + name;
  DTRAIN_THROW(InputError, "unknown --model '", text, "' (known: ", known,
               "; and dtrain train's decoders, gpt and llama, with their shape flags or a config "
               "file and --vocab)");
}

}  // namespace dtrain::plan
