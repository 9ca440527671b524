// The mixture-of-experts layer: routing, dropless or capacity-bound dispatch, balance statistics.
#include "dtrain/nn/Moe.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/tensor/Mappings.h"

namespace dtrain::nn {

namespace {

at::Tensor expert_swiglu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                         const at::Tensor& down) {
  return at::matmul(at::silu(at::matmul(x, gate.t())) * at::matmul(x, up.t()), down.t());
}

// Identity on `out` whose backward also gives `loss` (a scalar the forward computed alongside)
// the gradient `scale`: the loss joins the backward of whatever uses `out` (Megatron-Core's
// MoEAuxLossAutoScaler).
struct AddLossInBackward : torch::autograd::Function<AddLossInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out,
                            const at::Tensor& loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss_options"] = loss.options().dtype().toScalarType();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = ctx->saved_data["loss_options"].toScalarType();
    return {grads[0], at::full({}, scale, grads[0].options().dtype(dtype)), at::Tensor()};
  }
};

}  // namespace

void validate(const MoeOptions& o, int expert_ranks) {
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
  DTRAIN_CHECK_INPUT(expert_ranks >= 1 && o.experts % expert_ranks == 0, "--moe-experts (",
                     o.experts, ") must be a multiple of --expert-parallel (", expert_ranks, ")");
}

double MoeImpl::take_losses_in_backward() {
  const double taken = taken_in_backward_;
  taken_in_backward_ = 0.0;
  return taken;
}

double MoeStats::imbalance() const { return load_imbalance(load); }

double load_imbalance(const std::vector<int64_t>& load) {
  if (load.empty()) return 1.0;
  int64_t total = 0, most = 0;
  for (int64_t l : load) {
    total += l;
    most = std::max(most, l);
  }
  if (total == 0) return 1.0;
  return static_cast<double>(most) * static_cast<double>(load.size()) / static_cast<double>(total);
}

MoeImpl::MoeImpl(MoeOptions o, comm::CommunicatorPtr expert_parallel)
    : options(std::move(o)), expert_parallel_(std::move(expert_parallel)) {
  if (expert_parallel_) {
    expert_ranks_ = expert_parallel_->size();
    expert_rank_ = expert_parallel_->rank();
  }
  validate(options, expert_ranks_);
  const int64_t E = options.experts, L = local_experts(), W = options.width, F = options.ffn_width;
  const InitRule rule = InitRule::normal(options.init_std);
  router = register_parameter("router", new_parameter({E, W}, rule));
  gate = register_parameter("gate", new_parameter({L, F, W}, rule));
  up = register_parameter("up", new_parameter({L, F, W}, rule));
  down = register_parameter("down", new_parameter({L, W, F}, rule));
  if (options.shared_experts > 0) {
    const int64_t S = options.shared_experts * F;
    shared_gate = register_parameter("shared_gate", new_parameter({S, W}, rule));
    shared_up = register_parameter("shared_up", new_parameter({S, W}, rule));
    shared_down = register_parameter("shared_down", new_parameter({W, S}, rule));
  }
  expert_bias = register_buffer("expert_bias", at::zeros({E}));
}

tensor::ParameterSplits MoeImpl::local_splits() const {
  if (expert_ranks_ == 1) return {};
  const int64_t E = options.experts, W = options.width, F = options.ffn_width;
  tensor::ParameterSplits splits;
  auto block = [&](std::vector<int64_t> full) {
    tensor::ParameterSplit split;
    split.dim = 0;
    split.start = first_expert();
    split.length = local_experts();
    split.full_shape = std::move(full);
    split.expert = true;
    return split;
  };
  splits["gate"] = block({E, F, W});
  splits["up"] = block({E, F, W});
  splits["down"] = block({E, W, F});
  return splits;
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
  at::Tensor share = counts.to(scores.options()) / static_cast<double>(N * K);
  if (sequence_group_ && sequence_group_->size() > 1 && options.aux_loss > 0) {
    // f_e over the whole sequences: every part's assignments (the parts are equal).
    at::Tensor total = counts.to(scores.device(), at::kDouble);
    comm::on_lane(sequence_group_)->allreduce(total)->wait();
    share = total.to(scores.options()) / static_cast<double>(N * K * sequence_group_->size());
  }
  const at::Tensor per_token =
      options.score == "softmax" ? scores : scores / scores.sum(-1, /*keepdim=*/true);
  stats_.aux_loss = static_cast<double>(E) * (share * per_token.mean(0)).sum();
  stats_.z_loss = logits.logsumexp(-1).pow(2).mean();

  // Dispatch: assignments sorted by expert, token order kept within each; the capacity keeps
  // each expert's first ones.
  const at::Tensor order = std::get<1>(at::sort(flat_expert, /*stable=*/true, 0, false));
  int64_t capacity = N * K;
  if (options.capacity_factor > 0) {
    capacity = static_cast<int64_t>(
        std::ceil(options.capacity_factor * static_cast<double>(N * K) / static_cast<double>(E)));
  }
  std::vector<int64_t> taken(E);
  std::vector<at::Tensor> kept;
  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    taken[e] = std::min(stats_.load[e], capacity);
    stats_.dropped += stats_.load[e] - taken[e];
    if (taken[e] > 0) kept.push_back(order.narrow(0, begin, taken[e]));
    begin += stats_.load[e];
  }
  const at::Tensor slots = stats_.dropped == 0 ? order
                           : kept.empty()      ? order.narrow(0, 0, 0)
                                               : at::cat(kept);
  const at::Tensor token_of = at::div(slots, K, "floor");
  const at::Tensor slot_weight = weights.reshape({-1}).index_select(0, slots);
  const at::Tensor sent = x.index_select(0, token_of);  // [M, W], by expert

  const at::Tensor returned = compute_experts(sent, taken);
  at::Tensor out = at::zeros_like(x).index_add(0, token_of, returned * slot_weight.unsqueeze(1));
  if (at::GradMode::is_enabled()) {
    if (step_.load.empty()) step_.load.assign(E, 0);
    for (int64_t e = 0; e < E; ++e) step_.load[e] += stats_.load[e];
    step_.dropped += stats_.dropped;
    step_.tokens += N;
    step_.forwards += 1;
    step_.aux_loss += stats_.aux_loss.item<double>();
  }
  if (options.shared_experts > 0) out = out + expert_swiglu(x, shared_gate, shared_up, shared_down);
  if (backward_scale_ > 0 && at::GradMode::is_enabled() &&
      (options.aux_loss > 0 || options.z_loss > 0)) {
    at::Tensor side = at::zeros({}, stats_.aux_loss.options());
    if (options.aux_loss > 0) side = side + options.aux_loss * stats_.aux_loss;
    if (options.z_loss > 0) side = side + options.z_loss * stats_.z_loss;
    taken_in_backward_ += side.item<double>();
    out = AddLossInBackward::apply(out, side, backward_scale_);
  }
  return out.reshape(input.sizes());
}

// The rows `sent` (sorted by expert, taken[e] for expert e, from this rank's tokens) through
// their experts, on the experts' ranks: the results in the same order.
at::Tensor MoeImpl::compute_experts(const at::Tensor& sent, const std::vector<int64_t>& taken) {
  const int P = expert_ranks_;
  const int64_t E = options.experts, L = local_experts();
  std::vector<int64_t> send_rows(P, 0), recv_rows(P, 0);
  std::vector<int64_t> local_counts = taken;  // [source rank][local expert]: rows received
  for (int64_t e = 0; e < E; ++e) send_rows[e / L] += taken[e];
  if (P > 1) {
    const at::Tensor mine = at::tensor(taken, at::kLong);
    const at::Tensor theirs = at::empty({P * L}, at::kLong);
    trace::Span span("comm", "all_to_all counts");
    comm::on_lane(expert_parallel_)->all_to_all(theirs, mine)->wait();
    local_counts.assign(theirs.data_ptr<int64_t>(), theirs.data_ptr<int64_t>() + P * L);
  }
  for (int r = 0; r < P; ++r) {
    for (int64_t l = 0; l < L; ++l) recv_rows[r] += local_counts[r * L + l];
  }
  const at::Tensor received = tensor::all_to_all_rows(sent, expert_parallel_, send_rows, recv_rows);
  // The received rows come by source rank, each source's by expert: regroup them by expert
  // (each expert's rows from every rank in rank order: one process's token order).
  std::vector<int64_t> expert_rows = taken;
  at::Tensor grouped_index;
  if (P > 1) {
    std::vector<int64_t> source_at(P * L), grouped_order;
    int64_t offset = 0;
    for (int64_t i = 0; i < P * L; ++i) {
      source_at[i] = offset;
      offset += local_counts[i];
    }
    expert_rows.assign(L, 0);
    for (int64_t l = 0; l < L; ++l) {
      for (int r = 0; r < P; ++r) {
        for (int64_t j = 0; j < local_counts[r * L + l]; ++j)
          grouped_order.push_back(source_at[r * L + l] + j);
        expert_rows[l] += local_counts[r * L + l];
      }
    }
    grouped_index = at::tensor(grouped_order, at::kLong).to(sent.device());
  }
  const at::Tensor grouped = P > 1 ? received.index_select(0, grouped_index) : received;
  std::vector<at::Tensor> computed;
  int64_t row = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (expert_rows[l] > 0) {
      computed.push_back(
          expert_swiglu(grouped.narrow(0, row, expert_rows[l]), gate[l], up[l], down[l]));
    }
    row += expert_rows[l];
  }
  // With none to compute, the (empty) result still depends on the experts and the received
  // rows, so that every rank runs the reverse exchange's backward (its peers wait for it).
  at::Tensor result = computed.empty()       ? grouped + gate.reshape({-1}).narrow(0, 0, 1) * 0
                      : computed.size() == 1 ? computed[0]
                                             : at::cat(computed);
  if (P > 1) {
    const at::Tensor back =
        at::empty_like(grouped_index)
            .index_copy_(0, grouped_index,
                         at::arange(grouped_index.numel(), grouped_index.options()));
    result = result.index_select(0, back);  // by source rank again
  }
  return tensor::all_to_all_rows(result, expert_parallel_, recv_rows, send_rows);
}

MoeStepCounts MoeImpl::take_step_counts() {
  MoeStepCounts counts = std::move(step_);
  step_ = MoeStepCounts{};
  if (counts.load.empty()) counts.load.assign(options.experts, 0);
  return counts;
}

void MoeImpl::update_bias(const std::vector<int64_t>& load, double rate) {
  DTRAIN_CHECK(static_cast<int64_t>(load.size()) == options.experts, "moe: ", load.size(),
               " loads for ", options.experts, " experts");
  torch::NoGradGuard no_grad;
  const at::Tensor l = at::tensor(load, at::kDouble);
  expert_bias.add_((rate * (l.mean() - l).sign()).to(expert_bias.dtype()));
}

}  // namespace dtrain::nn
