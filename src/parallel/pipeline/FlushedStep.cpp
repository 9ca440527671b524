// The pipeline's flushed step (GPipe, 1F1B, interleaved, zero bubble; replicated stages): this
// rank's actions of the schedule run in order, activations and gradients crossing StageLink,
// each chunk's gradients reduced over its DP group during its last backward (or W), then one
// synchronous update. PipeDream's flush-free steps are PipeDream.cpp's.
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/WeightGrad.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/pipeline/StageLink.h"

namespace dtrain::parallel::pipeline {

/// What a flushed step's actions share: its micro-batches and loss, the deferred weight
/// gradients of a split backward, each (chunk, micro-batch)'s kept input and output (or loss),
/// the peaks the step reports, and its result.
struct PipelineStrategy::FlushedStep {
  FlushedStep(const std::vector<data::Batch>& batches, const LossFn& loss_fn)
      : micro_batches(batches), loss(loss_fn), count(static_cast<int>(batches.size())) {}
  const std::vector<data::Batch>& micro_batches;
  const LossFn& loss;
  int count = 0;
  bool split = false;
  /// Per chunk: the index of its last backward (or W) among the actions.
  std::vector<size_t> last_backward;
  std::map<std::pair<int, int>, nn::DeferredWeightGrads> deferred;
  int64_t peak_deferred_bytes = 0, deferred_bytes = 0;
  size_t peak_pending = 0;
  std::map<std::pair<int, int>, std::pair<at::Tensor, at::Tensor>> kept;
  size_t peak_kept = 0;
  double loss_sum = 0;
  /// A mixture of experts' balance losses: the gradient each layer gives them (the loss's).
  double moe_scale = 0;
  StepResult result;
  /// Guards the maps above while an overlapped pair's two threads run (DualPipe-V).
  std::mutex mutex;
};

StepResult PipelineStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                        const LossFn& loss) {
  DTRAIN_CHECK(!micro_batches.empty(), "train_step needs at least one micro-batch");
  if (flush_free_) return train_step_pipedream(micro_batches, loss);
  model_.module->train();
  FlushedStep step(micro_batches, loss);
  const auto actions = my_actions(step.count);
  // Split backward (zero bubble): B computes the chunk input's gradient (and the gradients of
  // parameters outside nn::linear layers, kept until W), W the linear layers' weight gradients,
  // from the inputs and output gradients B left (nn/WeightGrad.h), accumulating all of the
  // micro-batch's parameter gradients into .grad at once.
  step.split = splits_backward(kind_);
  // Each chunk's gradients are reduced over DP during its last backward (or W) of the step.
  const Action::Kind accumulates = step.split ? Action::Weight : Action::Backward;
  step.last_backward.assign(chunks_.size(), actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].kind == accumulates) step.last_backward[actions[i].chunk] = i;
  }
  for (auto& reducer : reducers_) {
    if (!reducer) continue;
    reducer->zero_grad();
    reducer->set_sync(false);
  }
  if (!reduces_over_data_parallel()) {
    for (auto& p : parameters_) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }
  for (auto& p : expert_params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  // The balance losses of the MoE layers on this rank's stages, scaled as the loss is.
  step.moe_scale = (scaler_ ? scaler_->scale_value() : 1.0) / step.count;
  scale_moe_losses(step.moe_scale);
  gather_wait_s_ = 0.0;
  // Receives are posted ahead of the actions that need them, so that Gloo moves the bytes while
  // this rank computes: one action ahead under GPipe and 1F1B (each posted buffer is memory the
  // stage holds, and 1F1B's point is to hold little); 2V actions ahead when interleaved, whose
  // twice as frequent and half as large transfers otherwise wait for the peer's transport thread
  // to be scheduled on a busy core (measured: bubble 14.7% -> 9.6% at M = 8 on 2 cores).
  const size_t receive_window = chunks_per_rank_ > 1 ? 2 * chunks_per_rank_ : 1;
  auto post_ahead = [&](const Action& a) {
    const Chunk& chunk = chunks_[a.chunk];
    const int s = chunk.virtual_stage;
    if (a.kind == Action::Forward && !first_virtual(chunk)) {
      link_->post_recv(StageLink::Activation, s - 1, a.micro_batch);
    }
    if (a.kind == Action::Backward && !last_virtual(chunk)) {
      link_->post_recv(StageLink::Gradient, s, a.micro_batch);
    }
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    for (size_t k = i + 1; k < std::min(actions.size(), i + 1 + receive_window); ++k) {
      post_ahead(actions[k]);
    }
    const Action& a = actions[i];
    if (a.overlapped) {
      const size_t group = run_pair(step, actions, i);
      for (size_t k = i; k < i + group; ++k) {
        if (observer_) observer_(actions[k]);
      }
      i += group - 1;
      continue;
    }
    if (a.kind == Action::Forward) {
      run_forward(step, a);
    } else if (a.kind == Action::Weight) {
      run_weight(step, a, i);
    } else {
      run_backward(step, a, i);
    }
    if (observer_) observer_(a);
  }
  return finish_flushed_step(step);
}

std::string PipelineStrategy::action_label(const Action& a) const {
  return concat(a.micro_batch, chunks_per_rank_ > 1 ? concat(".", a.chunk) : "");
}

void PipelineStrategy::run_forward(FlushedStep& step, const Action& a) {
  const at::Tensor y = compute_forward(step, a, forward_input(a, step.micro_batches));
  if (y.defined()) send_forward(a, y);
}

at::Tensor PipelineStrategy::forward_input(const Action& a,
                                           const std::vector<data::Batch>& micro_batches) {
  const Chunk& chunk = chunks_[a.chunk];
  if (first_virtual(chunk)) return model_input(micro_batches[a.micro_batch].inputs);
  trace::Span wait("recv", "activation " + action_label(a));
  at::Tensor x = link_->recv(StageLink::Activation, chunk.virtual_stage - 1, a.micro_batch);
  x.requires_grad_(true);
  return x;
}

at::Tensor PipelineStrategy::compute_forward(FlushedStep& step, const Action& a,
                                             const at::Tensor& x) {
  const Chunk& chunk = chunks_[a.chunk];
  const data::Batch& batch = step.micro_batches[a.micro_batch];
  trace::Span span("forward", "F" + action_label(a));
  at::Tensor y;
  {
    precision::AutocastScope autocast(precision_, device_.type());
    nn::DeferredWeightGrads* store = nullptr;
    if (step.split) {
      std::lock_guard<std::mutex> lock(step.mutex);
      store = &step.deferred[{a.chunk, a.micro_batch}];  // (a map's elements stay put)
    }
    nn::WeightGradDeferral defer(store);
    show_inputs(chunk, batch.inputs, false);
    y = run_chunk(chunk, x);
    if (last_virtual(chunk)) {
      // bf16-master: the loss in fp32 from bf16 outputs.
      if (precision::has_master_weights(precision_) && y.scalar_type() == at::kBFloat16)
        y = y.to(at::kFloat);
      y = step.loss(y, batch.targets) / step.count;
    }
  }
  std::lock_guard<std::mutex> lock(step.mutex);
  if (first_virtual(chunk)) step.result.samples += x.size(0);
  if (last_virtual(chunk)) {
    step.loss_sum += y.item<double>();
    step.kept[{a.chunk, a.micro_batch}] = {x, scaler_ ? scaler_->scale(y) : y};
    y = at::Tensor();  // nothing to send
  } else {
    step.kept[{a.chunk, a.micro_batch}] = {x, y};
    y = y.detach();
  }
  step.peak_kept = std::max(step.peak_kept, step.kept.size());
  return y;
}

void PipelineStrategy::send_forward(const Action& a, const at::Tensor& y) {
  trace::Span send("send", "activation " + action_label(a));
  link_->send(StageLink::Activation, chunks_[a.chunk].virtual_stage, a.micro_batch, y);
}

void PipelineStrategy::run_weight(FlushedStep& step, const Action& a, size_t i) {
  const Chunk& chunk = chunks_[a.chunk];
  const int s = chunk.virtual_stage;
  const std::string label = action_label(a);
  trace::Span span("weight", "W" + label);
  std::unique_lock<std::mutex> lock(step.mutex);
  auto node = step.deferred.extract({a.chunk, a.micro_batch});
  step.deferred_bytes -= node.empty() ? 0 : node.mapped().bytes();
  lock.unlock();
  DTRAIN_CHECK(!node.empty(), "pipeline stage ", s, ": W of micro-batch ", a.micro_batch,
               " before its forward");
  parallel::ddp::Reducer* reducer = reducers_[a.chunk].get();
  if (reducer && i == step.last_backward[a.chunk]) {
    reducer->set_sync(true);
    reducer->prepare_for_backward();
  }
  node.mapped().compute();
}

void PipelineStrategy::run_backward(FlushedStep& step, const Action& a, size_t i) {
  const at::Tensor g = compute_backward(step, a, i, backward_input(a));
  if (g.defined()) send_backward(a, g);
}

at::Tensor PipelineStrategy::backward_input(const Action& a) {
  const Chunk& chunk = chunks_[a.chunk];
  if (last_virtual(chunk)) return at::Tensor();
  trace::Span wait("recv", "gradient " + action_label(a));
  return link_->recv(StageLink::Gradient, chunk.virtual_stage, a.micro_batch);
}

at::Tensor PipelineStrategy::compute_backward(FlushedStep& step, const Action& a, size_t i,
                                              const at::Tensor& upstream) {
  const Chunk& chunk = chunks_[a.chunk];
  const int s = chunk.virtual_stage;
  trace::Span span("backward", "B" + action_label(a));
  std::unique_lock<std::mutex> lock(step.mutex);
  auto node = step.kept.extract({a.chunk, a.micro_batch});
  DTRAIN_CHECK(!node.empty(), "pipeline stage ", s, ": backward of micro-batch ", a.micro_batch,
               " before its forward");
  nn::DeferredWeightGrads* w = step.split ? &step.deferred.at({a.chunk, a.micro_batch}) : nullptr;
  lock.unlock();
  auto [x, y] = node.mapped();
  parallel::ddp::Reducer* reducer = reducers_[a.chunk].get();
  if (reducer && i == step.last_backward[a.chunk]) {
    reducer->set_sync(true);
    reducer->prepare_for_backward();
  }
  show_inputs(chunk, step.micro_batches[a.micro_batch].inputs, true);
  at::Tensor g;
  if (step.split) {
    // B: the input's gradient now; the weights' (and the other parameters') wait for W.
    std::vector<at::Tensor> params;
    for (size_t k : chunk.parameters) params.push_back(parameters_[k]);
    g = w->backward_input(y, upstream, first_virtual(chunk) ? at::Tensor() : x, params);
    lock.lock();
    step.deferred_bytes += w->bytes();
    step.peak_deferred_bytes = std::max(step.peak_deferred_bytes, step.deferred_bytes);
    step.peak_pending = std::max(step.peak_pending, step.deferred.size() - step.kept.size());
    lock.unlock();
  } else {
    backward_chunk(chunk, y, upstream);
    if (!first_virtual(chunk)) g = x.grad();
  }
  if (first_virtual(chunk)) return at::Tensor();
  return g.defined() ? g : at::zeros_like(x);
}

void PipelineStrategy::send_backward(const Action& a, const at::Tensor& g) {
  trace::Span send("send", "gradient " + action_label(a));
  link_->send(StageLink::Gradient, chunks_[a.chunk].virtual_stage - 1, a.micro_batch, g);
}

size_t PipelineStrategy::run_pair(FlushedStep& step, const std::vector<Action>& actions, size_t i) {
  const size_t extent = pair_extent(actions, i);
  const Action& f = actions[i];
  const Action& b = actions[i + 1];
  // Both inputs first (the peers send them before their own pairs), then the forward here and
  // the backward on a helper thread, whose collectives take the second lanes of the expert,
  // tensor-parallel and context groups; then both results.
  const at::Tensor x = forward_input(f, step.micro_batches);
  const at::Tensor upstream = backward_input(b);
  at::Tensor g;
  std::exception_ptr failed;
  trace::Recorder* recorder = trace::current();
  const auto lanes = grid_->lanes();
  std::thread helper([&] {
    trace::Adopt adopt(recorder, 1);
    comm::LaneScope lane(lanes);
    try {
      g = compute_backward(step, b, i + 1, upstream);
      if (extent == 3) run_weight(step, actions[i + 2], i + 2);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  at::Tensor y;
  try {
    y = compute_forward(step, f, x);
  } catch (...) {
    helper.join();
    throw;
  }
  helper.join();
  if (failed) std::rethrow_exception(failed);
  if (y.defined()) send_forward(f, y);
  if (g.defined()) send_backward(b, g);
  return extent;
}

StepResult PipelineStrategy::finish_flushed_step(FlushedStep& step) {
  StepResult& result = step.result;
  {
    trace::Span span("sync", "sends and gradient reduction");
    link_->finish_sends();
    for (auto& reducer : reducers_) {
      if (reducer) reducer->finalize();
    }
    // bf16-master: the experts' gradients in fp32 on their master weights (the model's bf16 ones
    // converted, as ddp converts them), summed and reduced in fp32 as the Reducers do the rest.
    const std::vector<at::Tensor> experts =
        !precision::has_master_weights(precision_) || expert_params_.empty()
            ? expert_params_
            : expert_master_gradients();
    if (!partial_in_reducers_) {
      tp_.sum_partial_gradients(reduced_gradient_holders(), names_);
    } else if (!experts.empty()) {  // (the Reducers summed the dense parameters')
      tp_.sum_partial_gradients(experts, expert_names_);
    }
    reduce_expert_gradients(experts, grid_->edp(), grid_->dp_size());
    // zero1: the experts' shard pieces take their part of the reduced gradients.
    if (zero1_ && !experts.empty()) {
      expert_shards_.alias_parameter_gradients(zero::FlatShards::gradients_of(experts));
    }
  }
  // This rank's share of the replica's loss: the last stage's, and each stage's balance losses.
  result.loss = step.loss_sum + scale_moe_losses(step.moe_scale) / step.count;
  reduce_over_replicas(result);
  bool skip = false;
  if (scaler_) {
    // Every stage and replica takes the same decision.
    skip = scaler_->unscale_and_check(scatter_ ? shard_pieces() : parameters_, grid_->world());
    scaler_->update(skip);
    result.metrics["loss_scale"] = scaler_->scale_value();
    result.metrics["skipped_steps"] = static_cast<double>(scaler_->skipped_steps());
  }
  result.metrics["step_skipped"] = skip ? 1.0 : 0.0;
  result.metrics["peak_live_micro_batches"] = static_cast<double>(step.peak_kept);
  if (step.split) {
    result.metrics["peak_pending_weight_grads"] = static_cast<double>(step.peak_pending);
    result.metrics["peak_deferred_mb"] = static_cast<double>(step.peak_deferred_bytes) / (1 << 20);
  }
  if (!skip) {
    trace::Span span("optimizer", "step");
    result.grad_norm = clip_gradients();
    if (zero1_ && !parameters_.empty()) {
      shards_.wait();  // (every chunk's forward waited for its buckets already)
      if (!scatter_) {
        std::vector<at::Tensor> dense;  // the holders of dense_'s reduced gradients
        const std::vector<at::Tensor> holders = reduced_gradient_holders();
        for (size_t k = 0; k < holders.size(); ++k) {
          if (!expert_[k]) dense.push_back(holders[k]);
        }
        shards_.alias_parameter_gradients(zero::FlatShards::gradients_of(dense));
      }
      optimizer_->step();
      update_model_from_master();
      if (overlap_gather_) {
        shards_.start_allgather(grid_->dp());
      } else {
        gather_wait_s_ += shards_.allgather(grid_->dp());
      }
      if (!expert_params_.empty()) gather_wait_s_ += expert_shards_.allgather(grid_->edp());
    } else {
      if (!master_.empty()) reduced_gradient_holders();  // points the master gradients
      optimizer_->step();
      update_model_from_master();
    }
  }

  // How long the step waited for zero1's parameter gathers (all of them after the update, or
  // what the forwards waited for).
  if (zero1_ && grid_->dp_size() > 1) {
    result.metrics["param_gather_wait_ms"] = gather_wait_s_ * 1e3;
  }
  // The loss lives on the last stage, the sample count on the first: every rank reports them.
  at::Tensor reported = at::tensor({result.loss, static_cast<double>(result.samples)}, at::kDouble);
  grid_->pp()->allreduce(reported)->wait();
  result.loss = reported[0].item<double>();
  result.samples = static_cast<int64_t>(reported[1].item<double>());
  return result;
}

std::vector<Action> PipelineStrategy::my_actions(int micro_batches) const {
  if (!grid_->replicated_stages()) {
    return build_schedule(spec(micro_batches), grid_->coordinates().pp);
  }
  const int replicas = grid_->dp_size();
  DTRAIN_CHECK_INPUT(micro_batches >= replicas, "--stage-replicas: stage ", grid_->coordinates().pp,
                     " has ", replicas, " replicas but the step has ", micro_batches,
                     " micro-batches (each replica needs one at least)");
  ScheduleSpec replicated = spec(micro_batches);
  replicated.replicas = grid_->stage_replicas();
  return build_slot_schedule(replicated,
                             grid_->pp_rank_of(grid_->coordinates().pp, grid_->coordinates().dp));
}

}  // namespace dtrain::parallel::pipeline
