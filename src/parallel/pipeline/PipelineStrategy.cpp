#include "parallel/pipeline/PipelineStrategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <unordered_set>

#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/memory/ActivationCheckpoint.h"
#include "dtrain/nn/DeferredInit.h"
#include "dtrain/nn/Moe.h"
#include "dtrain/nn/WeightGrad.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"
#include "parallel/StrategySupport.h"
#include "parallel/pipeline/StageLink.h"

namespace dtrain::parallel::pipeline {

namespace {

using Clock = std::chrono::steady_clock;

// Forward + backward seconds of each model stage on `input` (median of `repeats` after one
// warm-up), each stage fed the previous one's output.
std::vector<double> time_stages(const std::vector<Stage>& stages, at::Tensor input, int repeats) {
  std::vector<double> seconds;
  for (const auto& stage : stages) {
    std::vector<double> runs;
    at::Tensor output;
    for (int r = 0; r <= repeats; ++r) {
      at::Tensor x = input.is_floating_point() ? input.detach().requires_grad_(true) : input;
      const auto start = Clock::now();
      at::Tensor y = stage.forward(x);
      if (y.requires_grad()) y.backward(at::ones_like(y));
      if (r > 0) runs.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      output = y.detach();
    }
    std::nth_element(runs.begin(), runs.begin() + runs.size() / 2, runs.end());
    seconds.push_back(runs[runs.size() / 2]);
    input = output;
  }
  for (const auto& stage : stages) {
    for (const auto& module : stage.modules) module->zero_grad();
  }
  return seconds;
}

}  // namespace

PipelineStrategy::PipelineStrategy(StrategyOptions options)
    : options_(std::move(options)),
      pipe_(options_.of<PipelineOptions>()),
      kind_(schedule_info(pipe_.schedule).name),
      chunks_per_rank_(chunks_of(kind_, pipe_.virtual_stages)) {
  check_options(pipe_);
  zero1_ = pipe_.data_parallel == "zero1";
  reducer_options_from(options_);  // validate early
  precision_ = precision::parse_precision(options_.precision);
  device_ = parse_device(options_.device);
  precision::check_supported(precision_, device_);
  DTRAIN_CHECK_INPUT(!zero1_ || precision_ != precision::Precision::Bf16,
                     "zero1 keeps fp32 master weights; use --precision bf16-mixed, not bf16");
  scaler_ = make_loss_scaler(options_, precision_);
  flush_free_ = pipe_.sync == "2bw" || pipe_.sync == "eager" || pipe_.sync == "async";
  DTRAIN_CHECK_INPUT(!precision::has_master_weights(precision_) || !flush_free_,
                     "--precision bf16-master keeps one fp32 master copy of the weights: not with "
                     "--pipeline-sync ",
                     pipe_.sync, "'s weight versions (use flush, or bf16-mixed)");
  async_ = pipe_.sync == "async";
  eager_ = pipe_.sync == "eager";
  predict_ = pipe_.sync == "2bw" && pipe_.weight_prediction == "extrapolate";
  // Each stage updates when its own backwards of a step are done, at a different time on each
  // stage: a check over all stages before an update would stall the pipeline it overlaps.
  DTRAIN_CHECK_INPUT(!flush_free_ || options_.max_grad_norm <= 0, "--pipeline-sync ", pipe_.sync,
                     " updates each stage on its own: global-norm clipping "
                     "(--max-grad-norm) needs every stage's gradients at once; leave it out");
  DTRAIN_CHECK_INPUT(!flush_free_ || !scaler_, "--pipeline-sync ", pipe_.sync,
                     " updates each stage on its own: dynamic loss scaling needs a check over "
                     "every stage; use --precision fp32, bf16-mixed or bf16");
}

PipelineStrategy::~PipelineStrategy() = default;

void PipelineStrategy::broadcast_replica_state() {
  if (grid_->dp_size() == 1) return;
  torch::NoGradGuard no_grad;
  std::vector<comm::WorkPtr> works;
  // A block of experts goes to the ranks holding the same experts.
  for (size_t k = 0; k < parameters_.size(); ++k) {
    const comm::CommunicatorPtr& group = expert_[k] ? grid_->edp() : grid_->dp();
    if (group->size() > 1) works.push_back(group->broadcast(parameters_[k], {0}));
  }
  for (auto& [name, b] : local_buffers()) works.push_back(grid_->dp()->broadcast(b, {0}));
  comm::wait_all(works);
}

void PipelineStrategy::prepare(const data::Batch& example) { example_ = example; }

std::vector<double> PipelineStrategy::stage_costs() {
  if (pipe_.balance == "time") {
    DTRAIN_CHECK(example_.inputs.defined(),
                 "--pipeline-balance time needs an example batch (Strategy::prepare)");
    // Every rank measures the whole model; rank 0's numbers are used so all agree.
    at::Tensor input = example_.inputs;
    if (precision_ == precision::Precision::Bf16 && input.is_floating_point()) {
      input = input.to(at::kBFloat16);
    }
    std::vector<double> seconds;
    {
      precision::AutocastScope autocast(precision_, device_.type());
      seconds = time_stages(model_.stages, input, 3);
    }
    at::Tensor agreed = at::tensor(seconds, at::kDouble);
    agreement_group().broadcast(agreed, {0})->wait();
    return std::vector<double>(agreed.data_ptr<double>(),
                               agreed.data_ptr<double>() + agreed.numel());
  }
  std::vector<double> costs;
  for (const auto& stage : model_.stages) {
    double count = 0;
    for (const auto& module : stage.modules) {
      for (const auto& p : module->parameters()) count += static_cast<double>(p.numel());
    }
    costs.push_back(count);
  }
  // Tensor-parallel ranks can hold blocks of unequal size (a vocabulary that does not divide):
  // world rank 0's counts are used so every rank places the stages alike.
  at::Tensor agreed = at::tensor(costs, at::kDouble);
  agreement_group().broadcast(agreed, {0})->wait();
  return std::vector<double>(agreed.data_ptr<double>(), agreed.data_ptr<double>() + agreed.numel());
}

void PipelineStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  model_ = std::move(model);
  grid_ = std::move(grid);
  DTRAIN_CHECK_INPUT(!model_.stages.empty(),
                     "pipeline parallelism needs a model described as stages (Model::stages: "
                     "sequential_model() or the Zoo's models)");
  const int ranks = grid_->pp_size();
  const int virtual_stages = ranks * chunks_per_rank_;
  if (grid_->replicated_stages()) {
    check_stage_replicas(pipe_, grid_->stage_replicas(), grid_->tp_size(), 0);
  }
  const int n = static_cast<int>(model_.stages.size());
  DTRAIN_CHECK_INPUT(!schedule_info(kind_).interleaves || ranks >= 2, "the ", kind_,
                     " schedule needs at least 2 pipeline ranks");
  DTRAIN_CHECK_INPUT(n >= virtual_stages, "the model has ", n, " stage", n == 1 ? "" : "s",
                     ", fewer than the ", virtual_stages, chunks_per_rank_ > 1 ? " virtual" : "",
                     " pipeline stages asked for (", ranks, " ranks",
                     chunks_per_rank_ > 1 ? concat(" x ", chunks_per_rank_, " chunks") : "",
                     "; each needs at least one)");
  // A model of placeholders (nn/DeferredInit.h): this rank draws only its own stages' parameters
  // below, the others stay without memory. Timing the stages runs the whole model: built whole.
  if (model_.deferred && model_.deferred->pending() && pipe_.balance == "time") {
    model_.deferred->materialize_all();
  }
  const bool built_alone = model_.deferred && model_.deferred->pending();
  if (precision_ == precision::Precision::Bf16) {
    nn::module_to(*model_.module, at::TensorOptions().dtype(at::kBFloat16));
  }
  tp_ = tensor_parallel_layout(*model_.module, *grid_);
  for (const auto& module : model_.module->modules()) {
    if (auto* layer = dynamic_cast<nn::MoeImpl*>(module.get())) moe_layers_.push_back(layer);
  }
  DTRAIN_CHECK_INPUT(moe_layers_.empty() || !flush_free_, "--pipeline-sync ", pipe_.sync,
                     " with a mixture of experts: not built yet (use flush)");
  // The last stage's loss cannot add the balance losses of layers on other stages: each layer
  // adds its own in its backward.
  for (auto* layer : moe_layers_) layer->set_losses_in_backward(1.0);
  // DualPipe-V's pairs: the backward thread's all-to-alls on a group of their own.
  if (schedule_info(kind_).overlaps) grid_->add_lanes();
  costs_ = stage_costs();
  const std::string& balance = pipe_.balance;
  partition_ = balance == "params" || balance == "time"
                   ? balanced_partition(costs_, virtual_stages, grid_->stage_replicas())
                   : partition_from_counts(balance, n, virtual_stages);

  std::unordered_map<const void*, std::string> name_of;
  for (const auto& item : model_.module->named_parameters()) {
    name_of[item.value().unsafeGetTensorImpl()] = item.key();
  }
  const int me = grid_->coordinates().pp;
  std::unordered_set<const void*> seen;
  for (int c = 0; c < chunks_per_rank_; ++c) {
    Chunk chunk;
    chunk.virtual_stage = stage_of(spec(), c, me);
    chunk.stages.assign(model_.stages.begin() + partition_.first(chunk.virtual_stage),
                        model_.stages.begin() + partition_.end(chunk.virtual_stage));
    for (const auto& stage : chunk.stages) {
      for (const auto& module : stage.modules) {
        for (const auto& p : module->parameters()) {
          if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
          chunk.parameters.push_back(parameters_.size());
          parameters_.push_back(p);
          const auto it = name_of.find(p.unsafeGetTensorImpl());
          names_.push_back(it == name_of.end() ? std::string("?") : it->second);
        }
      }
    }
    chunks_.push_back(std::move(chunk));
  }
  expert_ = tp_.expert_flags(names_);
  for (size_t k = 0; k < parameters_.size(); ++k) {
    (expert_[k] ? expert_params_ : dense_).push_back(parameters_[k]);
    (expert_[k] ? expert_names_ : dense_names_).push_back(names_[k]);
  }
  // Every stage starts from world rank 0's model, as DDP's replicas do (the first pipeline
  // rank's copy, then each stage's first replica's). Drawn from their names and the seed, the
  // stages' values are the same on every rank already: each rank draws its own.
  if (built_alone) model_.deferred->materialize(parameters_);
  if (grid_->pp_size() > 1 && !built_alone) {
    torch::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& p : model_.module->parameters()) works.push_back(grid_->pp()->broadcast(p, {0}));
    for (auto& b : model_.module->buffers()) works.push_back(grid_->pp()->broadcast(b, {0}));
    comm::wait_all(works);
  }
  broadcast_replica_state();
  // bf16-master: this rank's parameters keep their fp32 values as master weights; the model
  // computes in bf16 from here on.
  const std::vector<at::Tensor> initial_master =
      keep_master_weights(*model_.module, parameters_, precision_);
  if (zero1_ && !parameters_.empty()) {
    // The shards follow each chunk's Reducer's buckets (each bucket's all-gather balanced); the
    // experts get shards of their own over the ranks holding the same experts.
    const parallel::ddp::ReducerOptions bucketing = reducer_options_from(options_);
    std::vector<size_t> dense_index(parameters_.size(), 0);  // into dense_
    for (size_t k = 0, dense = 0; k < parameters_.size(); ++k) {
      if (!expert_[k]) dense_index[k] = dense++;
    }
    std::vector<std::vector<size_t>> buckets;
    for (auto& chunk : chunks_) {
      for (size_t k : chunk.parameters) {
        if (!expert_[k]) chunk.dense.push_back(dense_index[k]);
      }
      const auto [params, names] = chunk_parameters(chunk, /*dense=*/true);
      for (auto group : parallel::ddp::bucket_groups(params, names, bucketing)) {
        for (size_t& k : group) k = chunk.dense[k];
        buckets.push_back(std::move(group));
      }
    }
    shards_ = parallel::zero::FlatShards(dense_, buckets, grid_->dp_size(), grid_->coordinates().dp,
                                         "pipeline zero1");
    if (!expert_params_.empty()) {
      expert_shards_ = parallel::zero::FlatShards(
          expert_params_, parallel::ddp::bucket_groups(expert_params_, expert_names_, bucketing),
          grid_->edp()->size(), grid_->edp()->rank(), "pipeline zero1 (experts)");
    }
    if (!initial_master.empty()) {  // (the experts' masters in their own shards)
      std::vector<at::Tensor> dense_master, expert_master;
      for (size_t k = 0; k < parameters_.size(); ++k) {
        (expert_[k] ? expert_master : dense_master).push_back(initial_master[k]);
      }
      shards_.make_master(at::kFloat, dense_master);
      if (!expert_params_.empty()) expert_shards_.make_master(at::kFloat, expert_master);
    }
    overlap_gather_ = options_.of<parallel::zero::ZeroOverlapOptions>().param_gather;
    // Megatron's distributed optimizer: each chunk's buckets reduce-scattered into this rank's
    // gradient shard at the chunk's last backward (where that can be; else allreduced).
    scatter_ = !flush_free_ && !grid_->replicated_stages() && reduces_over_data_parallel() &&
               parallel::zero::reduce_scatters_gradients(options_, tp_,
                                                         /*partial_summed_first=*/true);
    if (scatter_) {
      shard_grad_ =
          at::zeros({shards_.shard_numel()},
                    parameters_.front().options().dtype(
                        shards_.has_master() ? at::kFloat : parameters_.front().scalar_type()));
      shards_.alias_shard_gradient(shard_grad_);
    }
    for (auto& chunk : chunks_) chunk.gather_until = shards_.buckets_needed(chunk.stages, dense_);
    optimizer_ = make_optimizer(shard_pieces());
  } else if (flush_free_) {
    setup_versions();
    optimizer_ = make_optimizer(optimized_);
  } else if (!initial_master.empty()) {
    master_ = initial_master;
    for (auto& m : master_) m.requires_grad_(true);
    optimizer_ = make_optimizer(master_);
  } else {
    optimizer_ = make_optimizer(parameters_);
  }
  parallel::ddp::ReducerOptions reducer_options = reducer_options_from(options_);
  // bf16-master: gradients accumulate and are reduced in fp32.
  if (precision::has_master_weights(precision_)) reducer_options.grad_dtype = at::kFloat;
  // Replicated stages: each replica's gradients are its micro-batches' share of the step's mean.
  reducer_options.average = !grid_->replicated_stages();
  for (const auto& chunk : chunks_) {
    // (Experts' gradients are reduced over their own group after the schedule.)
    const auto [params, names] = chunk_parameters(chunk, /*dense=*/true);
    parallel::ddp::ReducerOptions options = reducer_options;
    if (scatter_ && !params.empty()) {  // the chunk's buckets are a run of the shard layout's
      const auto& layout = shards_.layout();
      const auto& first = layout.buckets[layout.bucket_of[chunk.dense.front()]];
      const auto& last = layout.buckets[layout.bucket_of[chunk.dense.back()]];
      options.shard_numel = last.shard_offset + last.part - first.shard_offset;
      options.shard_grad = shard_grad_.narrow(0, first.shard_offset, options.shard_numel);
      // Sequence parallelism's LayerNorm gradients: summed over the TP group before the
      // reduce-scatter, as each is ready.
      if (!tp_.partial.empty() && tp_.size > 1) {
        options.partial = tp_.partial_flags(names);
        options.partial_group = tp_.group;
        partial_in_reducers_ = true;
      }
    }
    reducers_.push_back(
        params.empty() || !reduces_over_data_parallel()
            ? nullptr
            : std::make_unique<parallel::ddp::Reducer>(params, names, grid_->dp(), options));
  }
  std::vector<std::vector<int>> stage_ranks(virtual_stages);
  for (int s = 0; s < virtual_stages; ++s) {
    const int stage = rank_of(spec(), s);
    const int replicas = grid_->replicated_stages() ? grid_->stage_replicas()[stage] : 1;
    for (int k = 0; k < replicas; ++k) stage_ranks[s].push_back(grid_->pp_rank_of(stage, k));
  }
  link_ = std::make_unique<StageLink>(grid_->pp(), std::move(stage_ranks),
                                      pipe_.transport == "auto", device_);
}

DataNeeds PipelineStrategy::data_needs() const {
  // (Every stage's where the model's stages see the inputs: packed sequences' documents.)
  DataNeeds needs{static_cast<bool>(model_.see_inputs), false};
  for (const auto& chunk : chunks_) {
    needs.inputs = needs.inputs || first_virtual(chunk);
    needs.targets = needs.targets || last_virtual(chunk);
  }
  return needs;
}

std::string PipelineStrategy::layout() const {
  const std::vector<double> share = shares(partition_, costs_);
  const bool timed = pipe_.balance == "time";
  std::string text =
      concat("pipeline: ", grid_->pp_size(), " stage", grid_->pp_size() == 1 ? "" : "s");
  if (chunks_per_rank_ > 1) text += concat(" x ", chunks_per_rank_, " chunks");
  if (grid_->replicated_stages()) {
    text += " replicated";
    for (size_t s = 0; s < grid_->stage_replicas().size(); ++s) {
      text += concat(s ? "," : " ", grid_->stage_replicas()[s]);
    }
    text += concat(" times (", pipe_.data_parallel, "), schedule ");
  } else {
    text += concat(" x ", grid_->dp_size(), " ", pipe_.data_parallel, " replica",
                   grid_->dp_size() == 1 ? "" : "s", ", schedule ");
  }
  text += concat(kind_, "; split by ",
                 timed                       ? "measured time"
                 : pipe_.balance == "params" ? "parameters"
                                             : "hand",
                 ":");
  for (int v = 0; v < partition_.ranks(); ++v) {
    const int first = partition_.first(v), last = partition_.end(v) - 1;
    text += concat(v ? "," : "", " ",
                   chunks_per_rank_ > 1         ? "virtual stage "
                   : grid_->replicated_stages() ? "stage "
                                                : "rank ",
                   v, " (model stages ", first, first == last ? "" : concat("-", last), ") ");
    char percent[16];
    std::snprintf(percent, sizeof(percent), "%.1f%%", 100.0 * share[v]);
    text += percent;
  }
  const double largest = *std::max_element(share.begin(), share.end());
  char imbalance[64];
  std::snprintf(imbalance, sizeof(imbalance), "; largest / even share %.2f",
                largest * partition_.ranks());
  return text + imbalance;
}

at::Tensor PipelineStrategy::model_input(const at::Tensor& inputs) const {
  const auto dtype = precision::parameter_dtype(precision_);
  return dtype != at::kFloat && inputs.is_floating_point() ? inputs.to(dtype) : inputs;
}

void PipelineStrategy::show_inputs(const Chunk& chunk, const at::Tensor& inputs,
                                   bool backward) const {
  if (!model_.see_inputs) return;
  if (backward ? std::none_of(chunk.stages.begin(), chunk.stages.end(),
                              [](const Stage& stage) { return stage.checkpoint; })
               : first_virtual(chunk)) {
    return;  // nothing recomputed; the embedding works them out itself
  }
  model_.see_inputs(model_input(inputs));
}

const std::vector<at::Tensor>& PipelineStrategy::expert_master_gradients() {
  torch::NoGradGuard no_grad;
  expert_holders_.clear();
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (!expert_[k]) continue;
    at::Tensor& p = parameters_[k];
    const at::Tensor& grad = p.grad();
    expert_holders_.push_back(
        gradient_holder(master_.empty() ? at::Tensor() : master_[k],
                        grad.defined() ? grad.to(at::kFloat)
                                       : at::zeros(p.sizes(), p.options().dtype(at::kFloat))));
    p.mutable_grad().reset();
  }
  return expert_holders_;
}

std::vector<at::Tensor> PipelineStrategy::reduced_gradient_holders() const {
  if (!precision::has_master_weights(precision_) || scatter_) return parameters_;
  std::vector<at::Tensor> holders(parameters_.size());
  // (The experts' fp32 gradients: expert_master_gradients'.)
  for (size_t k = 0, e = 0; k < parameters_.size() && !expert_holders_.empty(); ++k) {
    if (expert_[k]) holders[k] = expert_holders_[e++];
  }
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (!reducers_[c]) continue;
    // (The chunk's Reducer holds its dense parameters, in the chunk's order.)
    size_t j = 0;
    for (const size_t k : chunks_[c].parameters) {
      if (expert_[k]) continue;
      holders[k] = gradient_holder(master_.empty() ? at::Tensor() : master_[k],
                                   reducers_[c]->main_grad(j++));
    }
  }
  return holders;
}

void PipelineStrategy::update_model_from_master() {
  if (shards_.has_master()) shards_.publish_master();
  if (expert_shards_.has_master()) expert_shards_.publish_master();
  copy_weights(master_, parameters_);
}

void PipelineStrategy::backward_chunk(const Chunk& chunk, const at::Tensor& y,
                                      const at::Tensor& upstream) {
  if (!y.requires_grad()) {
    // Nothing before this point needs a gradient (a first stage without parameters).
  } else if (last_virtual(chunk)) {
    y.backward();
  } else {
    y.backward(upstream);
  }
}

void PipelineStrategy::backward_and_send(const Chunk& chunk, const at::Tensor& x,
                                         const at::Tensor& y, const at::Tensor& upstream, int link,
                                         const std::string& label) {
  backward_chunk(chunk, y, upstream);
  if (first_virtual(chunk)) return;
  at::Tensor g = x.grad();
  if (!g.defined()) g = at::zeros_like(x);
  trace::Span send("send", "gradient " + label);
  link_->send(StageLink::Gradient, chunk.virtual_stage - 1, link, g);
}

std::pair<std::vector<at::Tensor>, std::vector<std::string>> PipelineStrategy::chunk_parameters(
    const Chunk& chunk, bool dense) const {
  std::pair<std::vector<at::Tensor>, std::vector<std::string>> out;
  for (size_t k : chunk.parameters) {
    if (dense && expert_[k]) continue;
    out.first.push_back(parameters_[k]);
    out.second.push_back(names_[k]);
  }
  return out;
}

std::vector<at::Tensor> PipelineStrategy::shard_pieces() const {
  std::vector<at::Tensor> pieces = shards_.piece_tensors();
  for (auto& piece : expert_shards_.piece_tensors()) pieces.push_back(piece);
  return pieces;
}

std::vector<PieceRef> PipelineStrategy::shard_state_pieces() const {
  std::vector<PieceRef> pieces;
  if (parameters_.empty()) return pieces;
  pieces = shards_.state_pieces(dense_names_, dense_);
  for (auto& piece : expert_shards_.state_pieces(expert_names_, expert_params_)) {
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

double PipelineStrategy::scale_moe_losses(double scale) {
  double taken = 0.0;
  for (auto* layer : moe_layers_) {
    layer->set_losses_in_backward(scale);
    taken += layer->take_losses_in_backward();
  }
  return taken;
}

at::Tensor PipelineStrategy::run_chunk(const Chunk& chunk, const at::Tensor& input) const {
  at::Tensor x = input;
  for (size_t i = 0; i < chunk.stages.size(); ++i) {
    const Stage& stage = chunk.stages[i];
    // zero1 --overlap-param-gather: the update's gathers still running, waited bucket by bucket.
    if (shards_.gathering()) {
      gather_wait_s_ += shards_.wait(i < chunk.gather_until.size() ? chunk.gather_until[i] : -1);
    }
    if (stage.checkpoint && torch::GradMode::is_enabled()) {
      std::vector<at::Tensor> params;
      for (const auto& module : stage.modules) {
        for (const auto& p : module->parameters()) params.push_back(p);
      }
      x = memory::checkpoint(stage.forward, x, params, stage.generators);
    } else {
      x = stage.forward(x);
    }
  }
  return x;
}

double PipelineStrategy::clip_gradients() {
  if (options_.max_grad_norm <= 0) return -1.0;
  // Each stage's replicas hold equal (averaged) gradients: the norm sums over stages, and over
  // the tensor-parallel blocks (replicated parameters counted once).
  std::vector<bool> counted = tp_.counted(names_);
  if (grid_->coordinates().dp > 0 && grid_->replicated_stages()) {
    counted.assign(parameters_.size(), false);  // pp() holds every replica: count the first
  }
  if (scatter_) {  // each DP rank holds its shard of the stage's gradients (and of its experts')
    std::vector<std::string> names;
    for (const auto& piece : shards_.pieces()) names.push_back(dense_names_[piece.parameter]);
    for (const auto& piece : expert_shards_.pieces()) {
      names.push_back(expert_names_[piece.parameter]);
    }
    return clip_by_global_norm(shard_pieces(), {grid_->pp(), grid_->tp(), grid_->dp()},
                               options_.max_grad_norm, tp_.counted(names));
  }
  std::vector<comm::CommunicatorPtr> groups{grid_->pp(), grid_->tp()};
  if (grid_->ep_size() > 1) {
    // An expert group's ranks hold disjoint experts (in every stage: every rank sums over its
    // expert group, the stages' sums included) and the same dense parameters: those counted by
    // its first rank.
    for (size_t k = 0; k < counted.size(); ++k) {
      counted[k] = counted[k] && (expert_[k] || grid_->ep_rank() == 0);
    }
    groups.push_back(grid_->ep());
  }
  return clip_by_global_norm(reduced_gradient_holders(), groups, options_.max_grad_norm, counted);
}

at::Tensor PipelineStrategy::evaluate_forward(const at::Tensor& inputs) {
  flush();  // 2bw, eager, async: every stage evaluates its newest weights
  // Replicated stages: the first replica of each stage evaluates.
  if (grid_->replicated_stages() && grid_->coordinates().dp > 0) return {};
  at::Tensor output;
  for (const auto& chunk : chunks_) {
    const int s = chunk.virtual_stage;
    at::Tensor x;
    if (first_virtual(chunk)) {
      x = model_input(inputs);
    } else {
      x = link_->recv_any(s - 1);
    }
    show_inputs(chunk, inputs, false);
    at::Tensor y = run_chunk(chunk, x);
    if (last_virtual(chunk)) {
      // A bf16 model's output in fp32 for the loss and accuracy, as a DDP-family run's.
      output = y.scalar_type() == at::kBFloat16 ? y.to(at::kFloat) : y;
    } else {
      link_->send_any(s, y);
    }
  }
  return output;
}

NamedTensors PipelineStrategy::local_buffers() const {
  std::unordered_set<const void*> mine;
  for (const auto& chunk : chunks_) {
    for (const auto& stage : chunk.stages) {
      for (const auto& module : stage.modules) {
        for (const auto& b : module->buffers()) mine.insert(b.unsafeGetTensorImpl());
      }
    }
  }
  NamedTensors buffers;
  for (const auto& item : model_.module->named_buffers()) {
    if (mine.count(item.value().unsafeGetTensorImpl()))
      buffers.emplace_back(item.key(), item.value());
  }
  return buffers;
}

void PipelineStrategy::save(const std::string& directory) {
  shards_.wait();
  // The same files as DDP and ZeRO write (global parameter names), one set per stage and
  // tensor-parallel rank: a pipelined checkpoint loads into any pipeline size or data-parallel
  // strategy. Buffers and replicated parameters come from TP rank 0.
  const int stage = grid_->coordinates().pp;
  const int replica = grid_->coordinates().dp;
  const int writer = stage * tp_.size + tp_.rank;
  const int writers = grid_->pp_size() * tp_.size;
  const NamedTensors buffers =
      writes_stage_files() && tp_.rank == 0 ? local_buffers() : NamedTensors{};
  flush();  // 2bw, eager, async: a checkpoint is a step boundary, the newest weights in the
            // usual files
  if (pipe_.sync == "2bw" && replica == 0) save_pipedream_stash(directory, writer, writers);
  if (eager_) save_pending_gradients(directory, replica == 0, writer, writers);
  // Their optimizer state is keyed to the optimizer's own tensors: the files are written from
  // them, pointed at the newest version (where the parameters point after the flush).
  if (flush_free_) {
    for (size_t k = 0; k < parameters_.size(); ++k) optimized_[k].set_data(parameters_[k].data());
  }
  const std::vector<at::Tensor>& trained = flush_free_       ? optimized_
                                           : master_.empty() ? parameters_
                                                             : master_;
  if (zero1_) {
    write_state_shard(directory, writer * grid_->dp_size() + replica, writers * grid_->dp_size(),
                      tp_.for_writing(shard_state_pieces()), optimizer_.get(), buffers);
  } else if (grid_->ep_size() > 1) {
    // The stage's first expert group writes: a file per expert rank, its experts in each, the
    // rest (and the buffers) in its first rank's.
    if (grid_->edp()->rank() == 0) {
      const int ep = grid_->ep_size(), e = grid_->ep_rank();
      write_state_shard(directory, writer * ep + e, writers * ep,
                        tp_.for_expert_rank(tp_.for_writing(whole_pieces(names_, trained)), e),
                        optimizer_.get(), e == 0 ? buffers : NamedTensors{});
    }
  } else if (writes_stage_files()) {
    write_state_shard(directory, writer, writers, tp_.for_writing(whole_pieces(names_, trained)),
                      optimizer_.get(), buffers);
  }
  if (scaler_ && grid_->world()->rank() == 0) save_loss_scaler(*scaler_, directory);
}

void PipelineStrategy::load(const std::string& directory) {
  shards_.wait();  // a gather in flight would overwrite what the load puts in
  const NamedTensors buffers = local_buffers();
  if (flush_free_) {  // read into the optimizer's tensors, pointed at the parameters' buffers
    for (size_t k = 0; k < parameters_.size(); ++k) optimized_[k].set_data(parameters_[k].data());
  }
  const std::vector<PieceRef> values =
      tp_.for_reading(whole_pieces(names_, flush_free_ ? optimized_ : parameters_));
  const std::vector<PieceRef> states =
      zero1_ && !parameters_.empty() ? tp_.for_reading(shard_state_pieces())
      : !master_.empty()             ? tp_.for_reading(whole_pieces(names_, master_))
                                     : values;
  std::vector<PieceRef> filled = values;  // bf16-master: the master weights too
  if (precision::has_master_weights(precision_))
    filled.insert(filled.end(), states.begin(), states.end());
  read_state_shards(directory, filled, optimizer_.get(), states, &buffers);
  if (scaler_) load_loss_scaler(*scaler_, directory);
  if (flush_free_) load_pipedream_versions(directory);
}

void PipelineStrategy::load_values(const std::string& directory) {
  shards_.wait();
  const NamedTensors buffers = local_buffers();
  if (flush_free_) {
    for (size_t k = 0; k < parameters_.size(); ++k) optimized_[k].set_data(parameters_[k].data());
  }
  std::vector<PieceRef> filled =
      tp_.for_reading(whole_pieces(names_, flush_free_ ? optimized_ : parameters_));
  if (precision::has_master_weights(precision_)) {  // the master weights too, from the same file
    const std::vector<PieceRef> master = zero1_ && !parameters_.empty()
                                             ? tp_.for_reading(shard_state_pieces())
                                             : tp_.for_reading(whole_pieces(names_, master_));
    filled.insert(filled.end(), master.begin(), master.end());
  }
  read_state_shards(directory, filled, nullptr, {}, &buffers);
}

void PipelineStrategy::materialize() {
  shards_.wait();
  flush();
  torch::NoGradGuard no_grad;
  // Stages built alone: the other stages' parameters get their memory here, their values from
  // the stages' owners below.
  if (model_.deferred && model_.deferred->pending()) model_.deferred->materialize_all(false);
  std::unordered_set<const void*> seen;
  std::vector<comm::WorkPtr> works;
  auto share = [&](const at::Tensor& t, int owner) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) {
      works.push_back(grid_->pp()->broadcast(t, {owner}));
    }
  };
  for (int v = 0; v < partition_.ranks(); ++v) {
    for (int i = partition_.first(v); i < partition_.end(v); ++i) {
      for (const auto& module : model_.stages[i].modules) {
        const int owner = grid_->pp_rank_of(rank_of(spec(), v));
        for (const auto& p : module->parameters()) share(p, owner);
        for (const auto& b : module->buffers()) share(b, owner);
      }
    }
  }
  comm::wait_all(works);
}

MemoryReport PipelineStrategy::memory_report() const {
  MemoryReport report;
  for (const auto& p : parameters_) {
    report.parameter_bytes += p.numel() * p.element_size();
    report.gradient_bytes += p.numel() * gradient_element_size(p, precision_);
  }
  report.parameter_bytes += shards_.padding_bytes() + expert_shards_.padding_bytes();
  for (const auto& m : master_) report.optimizer_bytes += m.numel() * m.element_size();
  report.optimizer_bytes += shards_.master_bytes();
  // PipeDream's weight versions beside the newest.
  if (flush_free_) report.parameter_bytes *= static_cast<int64_t>(versions_.size());
  if (optimizer_) report.optimizer_bytes += optim::optimizer_state_bytes(*optimizer_);
  return report;
}

}  // namespace dtrain::parallel::pipeline
