// PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
// ICML'21) on top of the pipeline strategy: 1F1B without a flush between steps, two weight
// versions per stage, W(t + 1) = W(t) - lr * grad f(W(t - 1)).
//
// How the versions are held: each parameter's tensor (the one the model's forward reads and
// autograd saves) is pointed with set_data() at the buffer of the version the micro-batch at
// hand computes on, before its forward and again before its backward; whatever a forward saved
// of the weights (the parameter itself, views, casts) then reads that version's values, and no
// buffer is written while a micro-batch that computed on it is in flight. The optimizer owns
// tensors of its own (its state stays keyed to them) pointed at the buffer it writes.
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/optim/Optimizers.h"
#include "parallel/StrategySupport.h"
#include "parallel/pipeline/PipelineStrategy.h"
#include "parallel/pipeline/StageLink.h"

namespace dtrain::parallel::pipeline {

void PipelineStrategy::setup_2bw() {
  DTRAIN_CHECK_INPUT(chunks_per_rank_ == 1, "--pipeline-sync 2bw runs one chunk per rank");
  versions_[0].clear();
  versions_[1].clear();
  optimized_.clear();
  for (const auto& p : parameters_) {
    versions_[0].push_back(p.data());  // W(0) is the parameters' own storage
    optimized_.push_back(p.data().requires_grad_(true));
  }
  current_version_ = 0;
  batches_ = 0;
  in_flight_.clear();
}

void PipelineStrategy::use_version(int64_t n) {
  const int parity = static_cast<int>(n % 2);
  if (parity == current_version_) return;
  DTRAIN_CHECK(versions_[parity].size() == parameters_.size(), "pipeline 2bw: weight version ", n,
               " does not exist yet");
  for (size_t k = 0; k < parameters_.size(); ++k) parameters_[k].set_data(versions_[parity][k]);
  current_version_ = parity;
}

StepResult PipelineStrategy::train_step_2bw(const std::vector<data::Batch>& micro_batches,
                                            const LossFn& loss) {
  model_.module->train();
  const int ranks = grid_->pp_size();
  const int me = grid_->coordinates().pp;
  const int count = static_cast<int>(micro_batches.size());
  validate(spec(count));  // 1F1B: M >= P
  const Chunk& chunk = chunks_.front();
  const int s = chunk.virtual_stage;
  const int warmup = ranks - me - 1;
  const int64_t batch = batches_++;
  // The learning rate the run set for this step applies to this batch's update, which runs in
  // the next step on every rank but the last.
  batch_lr_[batch] = optim::learning_rate(*optimizer_);
  if (batch == 0) {
    for (auto& reducer : reducers_) {
      if (reducer) reducer->zero_grad();
    }
  }
  StepResult result;
  double loss_sum = 0;
  size_t peak_kept = in_flight_.size();
  // The step's loss leaves the last stage as soon as its last forward has it: the other stages
  // take it at their step's end, waiting for that forward only, not for the backwards and the
  // update the last stage still runs (a reduction at every rank's step end would hold each
  // stage back to the last one's end: a flush by another name).
  at::Tensor reported = at::zeros({1}, at::kDouble);
  comm::WorkPtr reporting;
  // With nothing in flight (the first step, or after a flush) the warm-up forwards come first;
  // otherwise every forward is followed by the oldest in-flight micro-batch's backward.
  const int unpaired = in_flight_.empty() ? warmup : 0;
  for (int i = 0; i < count; ++i) {
    const data::Batch& data = micro_batches[i];
    InFlight f;
    f.batch = batch;
    f.micro_batch = i;
    f.count = count;
    f.link = static_cast<int>(batch % 2) * count + i;
    const std::string label = std::to_string(i);
    if (first_virtual(chunk)) {
      f.x = precision_ == precision::Precision::Bf16 && data.inputs.is_floating_point()
                ? data.inputs.to(at::kBFloat16)
                : data.inputs;
    } else {
      trace::Span wait("recv", "activation " + label);
      f.x = link_->recv(StageLink::Activation, s - 1, f.link);
      f.x.requires_grad_(true);
    }
    {
      trace::Span span("forward", "F" + label);
      result.samples += f.x.size(0);
      use_version(std::max<int64_t>(batch - 1, 0));
      {
        precision::AutocastScope autocast(precision_, device_.type());
        f.y = run_chunk(chunk, f.x);
        if (last_virtual(chunk)) f.y = loss(f.y, data.targets) / count;
      }
      if (last_virtual(chunk)) {
        loss_sum += f.y.item<double>();
        if (i == count - 1) {
          reported.fill_(loss_sum);
          reporting = grid_->pp()->broadcast(reported, {ranks - 1});
        }
      } else {
        trace::Span send("send", "activation " + label);
        link_->send(StageLink::Activation, s, f.link, f.y.detach());
      }
    }
    in_flight_.push_back(std::move(f));
    peak_kept = std::max(peak_kept, in_flight_.size());
    if (observer_) observer_({Action::Forward, i, 0});
    if (i >= unpaired) backward_2bw();
  }
  // No flush: the sends of this step's last gradients complete when the previous stage takes
  // them, early in its next step (StageLink releases them as they complete).
  result.metrics["peak_live_micro_batches"] = static_cast<double>(peak_kept);
  result.metrics["in_flight_micro_batches"] = static_cast<double>(in_flight_.size());
  result.metrics["weight_versions"] = versions_[1].empty() ? 1.0 : 2.0;
  result.metrics["step_skipped"] = 0.0;
  if (!reporting) reporting = grid_->pp()->broadcast(reported, {ranks - 1});
  reporting->wait();
  result.loss = reported.item<double>();
  return result;
}

void PipelineStrategy::backward_2bw() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  const Chunk& chunk = chunks_.front();
  const int s = chunk.virtual_stage;
  const std::string label = std::to_string(f.micro_batch);
  const bool last_of_batch = f.micro_batch == f.count - 1;
  at::Tensor upstream;
  if (!last_virtual(chunk)) {
    trace::Span wait("recv", "gradient " + label);
    upstream = link_->recv(StageLink::Gradient, s, f.link);
  }
  {
    trace::Span span("backward", "B" + label);
    use_version(std::max<int64_t>(f.batch - 1, 0));
    parallel::ddp::Reducer* reducer = reducers_.front().get();
    if (reducer) {
      reducer->set_sync(last_of_batch);
      if (last_of_batch) reducer->prepare_for_backward();
    }
    if (!f.y.requires_grad()) {
      // Nothing before this point needs a gradient (a first stage without parameters).
    } else if (last_virtual(chunk)) {
      f.y.backward();
    } else {
      f.y.backward(upstream);
    }
    if (!first_virtual(chunk)) {
      at::Tensor g = f.x.grad();
      if (!g.defined()) g = at::zeros_like(f.x);
      trace::Span send("send", "gradient " + label);
      link_->send(StageLink::Gradient, s - 1, f.link, g);
    }
  }
  if (observer_) observer_({Action::Backward, f.micro_batch, 0});
  if (last_of_batch) update_2bw(f.batch);
}

void PipelineStrategy::update_2bw(int64_t batch) {
  trace::Span span("optimizer", "step");
  for (auto& reducer : reducers_) {
    if (reducer) reducer->finalize();
  }
  tp_.sum_partial_gradients(parameters_, names_);
  // W(batch + 1) = W(batch) - step(gradient of batch, computed on W(batch - 1)), into the
  // buffer of W(batch - 1): batch was its last user on this rank.
  const auto& from = versions_[batch % 2];
  auto& to = versions_[(batch + 1) % 2];
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < parameters_.size(); ++k) {
      if (to.size() <= k) to.push_back(at::empty_like(from[k]));
      to[k].copy_(from[k]);
      optimized_[k].set_data(to[k]);
      optimized_[k].mutable_grad() = parameters_[k].grad();
    }
  }
  const double now = optim::learning_rate(*optimizer_);
  const auto lr = batch_lr_.extract(batch);
  if (!lr.empty()) optim::set_learning_rate(*optimizer_, lr.mapped());
  optimizer_->step();
  optim::set_learning_rate(*optimizer_, now);
  for (auto& o : optimized_) o.mutable_grad().reset();
  for (auto& reducer : reducers_) {
    if (reducer) reducer->zero_grad();
  }
}

void PipelineStrategy::flush() {
  if (!two_bw_) return;
  while (!in_flight_.empty()) backward_2bw();
  link_->finish_sends();
  use_version(batches_);  // the newest
}

namespace {
constexpr const char* kStashFolder = "/pipedream-2bw";
}

void PipelineStrategy::save_2bw_stash(const std::string& directory, int writer, int writers) {
  // After a flush W(batches_) is the newest; the next batch computes on W(batches_ - 1).
  const auto& stash = batches_ >= 1 && versions_[(batches_ - 1) % 2].size() == parameters_.size()
                          ? versions_[(batches_ - 1) % 2]
                          : versions_[batches_ % 2];
  std::error_code ignored;
  std::filesystem::create_directories(directory + kStashFolder, ignored);
  write_state_shard(directory + kStashFolder, writer, writers,
                    tp_.for_writing(whole_pieces(names_, stash)), nullptr, {});
}

void PipelineStrategy::load_2bw_stash(const std::string& directory) {
  // The loaded values are in the parameters' current buffers: they become W(1), the stash (or
  // a copy of them) W(0), and the next batch is batch 1: it computes on W(0), the one after on
  // W(1), and the first update writes W(2) = W(1) - step(gradient on W(0)).
  in_flight_.clear();
  std::vector<at::Tensor> newest, stash;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) {
      newest.push_back(p.data().clone());
      stash.push_back(p.data().clone());
    }
  }
  if (std::filesystem::exists(directory + kStashFolder)) {
    read_state_shards(directory + kStashFolder, tp_.for_reading(whole_pieces(names_, stash)),
                      nullptr, {}, nullptr);
  }
  versions_[0] = std::move(stash);
  versions_[1] = std::move(newest);
  current_version_ = -1;
  use_version(1);
  batches_ = 1;
  for (auto& reducer : reducers_) {
    if (reducer) reducer->zero_grad();
  }
}

comm::CommunicatorPtr PipelineStrategy::step_group() const {
  return two_bw_ ? grid_->dp() : nullptr;
}

void PipelineStrategy::finish_training(StepResult& last) {
  flush();
  if (two_bw_) last.metrics["in_flight_micro_batches"] = 0.0;
}

}  // namespace dtrain::parallel::pipeline
