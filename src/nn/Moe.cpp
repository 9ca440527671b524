// The mixture-of-experts layer: routing, dropless or capacity-bound dispatch, balance statistics.
#include "dtrain/nn/Moe.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/nn/DeferredInit.h"

namespace dtrain::nn {

namespace {

at::Tensor expert_swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                         const at::Tensor& down) {
  return at::matmul(at::silu(at::matmul(x, gate.t())) * at::matmul(x, up.t()), down.t());
}

}  // namespace

void validate(const MoeOptions& o) {
  DTRAIN_CHECK_INPUT(o.width > 0, "--width must be > 0 for a mixture of experts, got ", o.width);
  DTRAIN_CHECK_INPUT(o.ffn_width > 0, "the experts' FFN width must be > 0, got ", o.ffn_width);
  DTRAIN_CHECK_INPUT(o.experts >= 1, "--moe-experts must be >= 1, got ", o.experts);
  DTRAIN_CHECK_INPUT(o.top_k >= 1 && o.top_k <= o.experts, "--moe-top-k must be in [1, ", o.experts,
                     "] (the experts), got ", o.top_k);
  DTRAIN_CHECK_INPUT(o.shared_experts >= 0, "--moe-shared-experts must be >= 0, got ",
                     o.shared_experts);
  DTRAIN_CHECK_INPUT(o.score == "softmax" || o.score == "sigmoid", "--moe-score must be softmax ",
                     "or sigmoid, got '", o.score, "'");
  DTRAIN_CHECK_INPUT(o.capacity_factor >= 0, "--moe-capacity must be >= 0 (0: dropless), got ",
                     o.capacity_factor);
}

double MoeStats::imbalance() const {
  if (load.empty()) return 1.0;
  int64_t total = 0, most = 0;
  for (int64_t l : load) {
    total += l;
    most = std::max(most, l);
  }
  if (total == 0) return 1.0;
  return static_cast<double>(most) * static_cast<double>(load.size()) / static_cast<double>(total);
}

MoeImpl::MoeImpl(MoeOptions o) : options(std::move(o)) {
  validate(options);
  const int64_t E = options.experts, W = options.width, F = options.ffn_width;
  const InitRule rule = InitRule::normal(options.init_std);
  router = register_parameter("router", new_parameter({E, W}, rule));
  gate = register_parameter("gate", new_parameter({E, F, W}, rule));
  up = register_parameter("up", new_parameter({E, F, W}, rule));
  down = register_parameter("down", new_parameter({E, W, F}, rule));
  if (options.shared_experts > 0) {
    const int64_t S = options.shared_experts * F;
    shared_gate = register_parameter("shared_gate", new_parameter({S, W}, rule));
    shared_up = register_parameter("shared_up", new_parameter({S, W}, rule));
    shared_down = register_parameter("shared_down", new_parameter({W, S}, rule));
  }
  expert_bias = register_buffer("expert_bias", at::zeros({E}));
}

at::Tensor MoeImpl::forward(const at::Tensor& input) {
  const int64_t E = options.experts, K = options.top_k, W = options.width;
  DTRAIN_CHECK_INPUT(input.size(-1) == W, "moe: input of width ", input.size(-1), " for ", W);
  const at::Tensor x = input.reshape({-1, W});
  const int64_t N = x.size(0);
  const at::Tensor logits = at::matmul(x, router.t());  // [N, E]
  const at::Tensor scores = options.score == "softmax" ? logits.softmax(-1) : logits.sigmoid();
  // The bias steers the choice only; the weights are the scores themselves.
  at::Tensor chosen;  // [N, K]
  {
    torch::NoGradGuard no_grad;
    chosen = std::get<1>((scores.detach() + expert_bias.to(scores.dtype())).topk(K, -1));
  }
  at::Tensor weights = scores.gather(1, chosen);
  if (options.normalize) weights = weights / weights.sum(-1, /*keepdim=*/true);

  // Balance statistics.
  const at::Tensor flat_expert = chosen.reshape({-1});  // assignments, token-major
  const at::Tensor counts = at::bincount(flat_expert, {}, E).cpu();  // (the loop's offsets)
  stats_ = MoeStats{};
  stats_.tokens = N;
  stats_.load.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + E);
  const at::Tensor share = counts.to(scores.options()) / static_cast<double>(N * K);
  const at::Tensor per_token =
      options.score == "softmax" ? scores : scores / scores.sum(-1, /*keepdim=*/true);
  stats_.aux_loss = static_cast<double>(E) * (share * per_token.mean(0)).sum();
  stats_.z_loss = logits.logsumexp(-1).pow(2).mean();

  // Dispatch: assignments sorted by expert, token order kept within each.
  const at::Tensor order = std::get<1>(at::sort(flat_expert, /*stable=*/true, 0, false));
  const at::Tensor token_of = at::div(order, K, "floor");
  const at::Tensor slot_weight = weights.reshape({-1}).index_select(0, order);
  int64_t capacity = N * K;
  if (options.capacity_factor > 0) {
    capacity = static_cast<int64_t>(
        std::ceil(options.capacity_factor * static_cast<double>(N * K) / static_cast<double>(E)));
  }
  at::Tensor out = at::zeros_like(x);
  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = stats_.load[e];
    const int64_t taken = std::min(count, capacity);
    stats_.dropped += count - taken;
    if (taken > 0) {
      const at::Tensor tokens = token_of.narrow(0, begin, taken);
      const at::Tensor y = expert_swiglu(x.index_select(0, tokens), gate[e], up[e], down[e]);
      out = out.index_add(0, tokens, y * slot_weight.narrow(0, begin, taken).unsqueeze(1));
    }
    begin += count;
  }
  if (options.shared_experts > 0) out = out + expert_swiglu(x, shared_gate, shared_up, shared_down);
  return out.reshape(input.sizes());
}

void MoeImpl::update_bias(const std::vector<int64_t>& load, double rate) {
  DTRAIN_CHECK(static_cast<int64_t>(load.size()) == options.experts, "moe: ", load.size(),
               " loads for ", options.experts, " experts");
  torch::NoGradGuard no_grad;
  const at::Tensor l = at::tensor(load, at::kDouble);
  expert_bias.add_((rate * (l.mean() - l).sign()).to(expert_bias.dtype()));
}

}  // namespace dtrain::nn
