// PipeDream's pipelines without a flush on top of the pipeline strategy: 1F1B whose steps
// follow one another without draining, each micro-batch computing forward and backward on one
// weight version (weight stashing). --pipeline-sync async: the original PipeDream (Narayanan et
// al., SOSP'19), an update after every micro-batch's backward; --pipeline-sync 2bw:
// PipeDream-2BW (Narayanan et al., ICML'21), two versions per stage, W(t + 1) = W(t) - lr *
// grad f(W(t - 1)); --pipeline-sync eager: 2bw's pipeline with each stage's update taken where
// its 1F1B schedule next needs the weights (so every micro-batch computes on the newest), only
// the gradients of the step's micro-batches backwarded after it one step stale.
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

namespace {
constexpr const char* kStashFolder = "/pipedream-2bw";
// --weight-prediction extrapolate: the prediction for the batch after the next, made already.
constexpr const char* kNextStashFolder = "/pipedream-2bw-next";
// eager: the gradients the next update takes that the last step's late micro-batches left.
constexpr const char* kPendingFolder = "/pipedream-eager";
}

void PipelineStrategy::setup_versions() {
  DTRAIN_CHECK_INPUT(chunks_per_rank_ == 1, "--pipeline-sync ", pipe_.sync,
                     " runs one chunk per rank");
  // A checkpoint holds the late gradients as each TP rank has them: not where they are partial
  // sums the next update would add up over the TP group.
  DTRAIN_CHECK_INPUT(!eager_ || (tp_.partial.empty() && !tp_.has_shared_blocks()),
                     "--pipeline-sync eager with tensor parallelism: not with --sequence-parallel, "
                     "--qk-norm or key/value heads shared by several TP ranks (use 2bw)");
  versions_.clear();
  restored_gradients_.clear();
  spare_.clear();
  optimized_.clear();
  std::vector<at::Tensor> first;
  for (const auto& p : parameters_) {
    first.push_back(p.data());  // W(0) is the parameters' own storage
    optimized_.push_back(p.data().requires_grad_(true));
  }
  versions_[0] = std::move(first);
  newest_ = 0;
  current_version_ = 0;
  batches_ = 0;
  in_flight_.clear();
}

int64_t PipelineStrategy::version_for(int64_t batch) const {
  if (async_ || eager_) return newest_;
  // Batches 0 and 1 compute on W(0): no step was taken yet to extrapolate (nor after a
  // checkpoint without the prediction: the version before the newest, as 2bw's rule).
  if (predict_ && batch >= 2 && versions_.count(predicted(batch))) return predicted(batch);
  return std::max<int64_t>(batch - 1, 0);
}

void PipelineStrategy::use_version(int64_t n) {
  if (n == current_version_) return;
  const auto it = versions_.find(n);
  DTRAIN_CHECK(it != versions_.end(), "pipeline ", pipe_.sync, ": weight version ", n,
               " is not kept");
  for (size_t k = 0; k < parameters_.size(); ++k) parameters_[k].set_data(it->second[k]);
  current_version_ = n;
}

StepResult PipelineStrategy::train_step_pipedream(const std::vector<data::Batch>& micro_batches,
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
  // The learning rate the run set for this step applies to this batch's updates, which may run
  // in the next step.
  batch_lr_[batch] = optim::learning_rate(*optimizer_);
  if (batch == 0) {
    for (auto& reducer : reducers_) {
      if (reducer) reducer->zero_grad();
    }
    // eager, resumed: the late micro-batches' gradients the checkpoint held join this step's.
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < restored_gradients_.size(); ++k) {
      at::Tensor& grad = parameters_[k].mutable_grad();
      if (grad.defined()) {
        grad.add_(restored_gradients_[k]);
      } else {
        grad = restored_gradients_[k].clone();
      }
    }
    restored_gradients_.clear();
  }
  StepResult result;
  double loss_sum = 0;
  size_t peak_kept = in_flight_.size();
  size_t peak_versions = versions_.size();
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
    f.version = version_for(batch);
    f.micro_batch = i;
    f.count = count;
    f.inputs = data.inputs;
    f.link = static_cast<int>(batch % 2) * count + i;
    const std::string label = std::to_string(i);
    if (first_virtual(chunk)) {
      f.x = model_input(data.inputs);
    } else {
      trace::Span wait("recv", "activation " + label);
      f.x = link_->recv(StageLink::Activation, s - 1, f.link);
      f.x.requires_grad_(true);
    }
    {
      trace::Span span("forward", "F" + label);
      result.samples += f.x.size(0);
      use_version(f.version);
      {
        precision::AutocastScope autocast(precision_, device_.type());
        show_inputs(chunk, data.inputs, false);
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
    if (version_observer_) version_observer_({Action::Forward, i, 0}, f.version);
    in_flight_.push_back(std::move(f));
    peak_kept = std::max(peak_kept, in_flight_.size());
    if (observer_) observer_({Action::Forward, i, 0});
    if (i >= unpaired) backward_pipedream();
    peak_versions = std::max(peak_versions, versions_.size());
  }
  // No flush: the sends of this step's last gradients complete when the previous stage takes
  // them, early in its next step (StageLink releases them as they complete).
  result.metrics["peak_live_micro_batches"] = static_cast<double>(peak_kept);
  result.metrics["in_flight_micro_batches"] = static_cast<double>(in_flight_.size());
  result.metrics["weight_versions"] = static_cast<double>(peak_versions);
  result.metrics["step_skipped"] = 0.0;
  if (!reporting) reporting = grid_->pp()->broadcast(reported, {ranks - 1});
  reporting->wait();
  result.loss = reported.item<double>();
  return result;
}

void PipelineStrategy::backward_pipedream() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  const Chunk& chunk = chunks_.front();
  const int s = chunk.virtual_stage;
  const std::string label = std::to_string(f.micro_batch);
  // 2bw updates after a batch's last micro-batch, async after every one, eager before the late
  // ones' backwards (their gradients stay for the next update).
  const bool updates = async_ || f.micro_batch == f.count - 1 - late_micro_batches();
  at::Tensor upstream;
  if (!last_virtual(chunk)) {
    trace::Span wait("recv", "gradient " + label);
    upstream = link_->recv(StageLink::Gradient, s, f.link);
  }
  {
    trace::Span span("backward", "B" + label);
    use_version(f.version);
    parallel::ddp::Reducer* reducer = reducers_.front().get();
    if (reducer) {
      reducer->set_sync(updates);
      if (updates) reducer->prepare_for_backward();
    }
    show_inputs(chunk, f.inputs, true);
    backward_and_send(chunk, f.x, f.y, upstream, f.link, label);
  }
  if (version_observer_) version_observer_({Action::Backward, f.micro_batch, 0}, f.version);
  if (observer_) observer_({Action::Backward, f.micro_batch, 0});
  if (updates) update_pipedream(f.batch);
  if (f.micro_batch == f.count - 1) batch_lr_.erase(f.batch);
}

void PipelineStrategy::update_pipedream(int64_t batch) {
  trace::Span span("optimizer", "step");
  for (auto& reducer : reducers_) {
    if (reducer) reducer->finalize();
  }
  tp_.sum_partial_gradients(parameters_, names_);
  // W(newest + 1) = W(newest) - step(the gradients), into a buffer no micro-batch in flight
  // reads (2bw: the one batch - 1's micro-batches read, batch being its last user).
  release_versions();
  const auto& from = versions_.at(newest_);
  std::vector<at::Tensor> to;
  if (!spare_.empty()) {
    to = std::move(spare_.back());
    spare_.pop_back();
  }
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
  const auto lr = batch_lr_.find(batch);
  if (lr != batch_lr_.end()) optim::set_learning_rate(*optimizer_, lr->second);
  optimizer_->step();
  optim::set_learning_rate(*optimizer_, now);
  for (auto& o : optimized_) o.mutable_grad().reset();
  for (auto& reducer : reducers_) {
    if (reducer) reducer->zero_grad();
  }
  if (predict_) {
    // The next batch to start, newest + 2 (newest + 1's forwards run now), computes on
    // W(newest + 1) moved on by the step just taken: 2 W(newest + 1) - W(newest), an estimate
    // of W(newest + 2), the weights its gradient updates. Made now, while both are here.
    std::vector<at::Tensor> guess;
    if (!spare_.empty()) {
      guess = std::move(spare_.back());
      spare_.pop_back();
    }
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < to.size(); ++k) {
      if (guess.size() <= k) guess.push_back(at::empty_like(to[k]));
      at::sub_out(guess[k], to[k], from[k]);
      guess[k].add_(to[k]);
    }
    versions_[predicted(newest_ + 2)] = std::move(guess);
  }
  versions_[++newest_] = std::move(to);
  if (async_) release_versions();  // the version before, if no micro-batch in flight reads it
}

int PipelineStrategy::late_micro_batches() const {
  return eager_ ? grid_->pp_size() - grid_->coordinates().pp - 1 : 0;
}

void PipelineStrategy::release_versions() {
  // Kept: the newest (under 2bw, the next batch's or the source of the next update) and every
  // version a micro-batch in flight computed on.
  for (auto it = versions_.begin(); it != versions_.end();) {
    const int64_t n = it->first;
    // (--weight-prediction: also the predictions for the batches not started yet.)
    const bool kept = n == newest_ || (predict_ && n >= predicted(batches_)) ||
                      std::any_of(in_flight_.begin(), in_flight_.end(),
                                  [n](const InFlight& f) { return f.version == n; });
    if (kept) {
      ++it;
    } else {
      spare_.push_back(std::move(it->second));
      it = versions_.erase(it);
    }
  }
}

void PipelineStrategy::flush() {
  if (!flush_free_) return;
  while (!in_flight_.empty()) backward_pipedream();
  link_->finish_sends();
  use_version(newest_);
}

void PipelineStrategy::save_pipedream_stash(const std::string& directory, int writer, int writers) {
  // After a flush the next batch computes on W(newest - 1) (kept: the one before the newest),
  // or under --weight-prediction on the prediction made for it; the one after it too.
  auto save = [&](const char* folder, int64_t version) {
    const auto it = versions_.find(version);
    const auto& stash = it != versions_.end() ? it->second : versions_.at(newest_);
    std::error_code ignored;
    std::filesystem::create_directories(directory + folder, ignored);
    write_state_shard(directory + folder, writer, writers,
                      tp_.for_writing(whole_pieces(names_, stash)), nullptr, {});
  };
  save(kStashFolder, version_for(batches_));
  if (predict_ && versions_.count(predicted(batches_ + 1))) {
    save(kNextStashFolder, predicted(batches_ + 1));
  }
}

void PipelineStrategy::save_pending_gradients(const std::string& directory, bool writes, int writer,
                                              int writers) {
  // After the flush the late micro-batches' gradients are in the gradient buffers (the last
  // stage has none: it updates after its last backward). Each replica holds its own: their sum
  // is what the next update's reduction would have summed.
  std::vector<at::Tensor> pending;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) {
      pending.push_back(p.grad().defined() ? p.grad().detach().clone() : at::zeros_like(p));
    }
  }
  if (grid_->dp_size() > 1) {
    std::vector<comm::WorkPtr> works;
    for (auto& t : pending) works.push_back(grid_->dp()->allreduce(t));
    comm::wait_all(works);
  }
  if (!writes) return;
  std::error_code ignored;
  std::filesystem::create_directories(directory + kPendingFolder, ignored);
  write_state_shard(directory + kPendingFolder, writer, writers,
                    tp_.for_writing(whole_pieces(names_, pending)), nullptr, {});
}

void PipelineStrategy::load_pipedream_versions(const std::string& directory) {
  // The loaded values are in the parameters' current buffers: they become the newest version.
  // Under 2bw the stash (or a copy of the newest) becomes the version before, and the next
  // batch is batch 1: it computes on W(0), the one after on W(1), and the first update writes
  // W(2) = W(1) - step(gradient on W(0)). Under async every micro-batch takes the newest.
  in_flight_.clear();
  batch_lr_.clear();
  std::vector<at::Tensor> newest, stash;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters_) newest.push_back(p.data().clone());
  }
  versions_.clear();
  spare_.clear();
  current_version_ = -1;
  restored_gradients_.clear();
  if (async_ || eager_) {
    versions_[0] = std::move(newest);
    newest_ = 0;
    batches_ = 0;
    // eager: the first replica of each stage adds the late gradients the checkpoint summed
    // over the replicas to its first step's (a checkpoint without them: another sync's).
    if (eager_ && grid_->coordinates().dp == 0 &&
        std::filesystem::exists(directory + kPendingFolder)) {
      for (const auto& t : versions_[0]) restored_gradients_.push_back(at::zeros_like(t));
      read_state_shards(directory + kPendingFolder,
                        tp_.for_reading(whole_pieces(names_, restored_gradients_)), nullptr, {},
                        nullptr);
    }
  } else {
    for (const auto& t : newest) stash.push_back(t.clone());
    if (std::filesystem::exists(directory + kStashFolder)) {
      read_state_shards(directory + kStashFolder, tp_.for_reading(whole_pieces(names_, stash)),
                        nullptr, {}, nullptr);
    }
    if (predict_ && std::filesystem::exists(directory + kNextStashFolder)) {
      // Batch 2 computes on the prediction the run had made for its batch after the next.
      std::vector<at::Tensor> next;
      for (const auto& t : newest) next.push_back(t.clone());
      read_state_shards(directory + kNextStashFolder, tp_.for_reading(whole_pieces(names_, next)),
                        nullptr, {}, nullptr);
      versions_[predicted(2)] = std::move(next);
    }
    versions_[0] = std::move(stash);
    versions_[1] = std::move(newest);
    newest_ = 1;
    batches_ = 1;
  }
  use_version(newest_);
  for (auto& reducer : reducers_) {
    if (reducer) reducer->zero_grad();
  }
}

comm::CommunicatorPtr PipelineStrategy::step_group() const {
  return flush_free_ ? grid_->dp() : nullptr;
}

void PipelineStrategy::finish_training(StepResult& last) {
  flush();
  if (flush_free_) last.metrics["in_flight_micro_batches"] = 0.0;
}

}  // namespace dtrain::parallel::pipeline
