// The step loops. Synchronous: every rank makes each step together (one collective for the
// loss), evaluates and checkpoints together. Asynchronous (parameter-server workers): each
// worker runs through its own share of the data as fast as it can, with no per-step
// collective; the run ends when all of them together have made the worker steps of the
// synchronous run (steps x replicas), however they were shared out, and rank 0 alone evaluates
// and checkpoints. Either way the next step's batches are read on a thread of their own while
// the current step trains (one step ahead; pinned for a CUDA device), so a step waits for data
// only when reading a step's batches takes longer than training it (a "data" span in --trace).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <future>
#include <iterator>

#include "common/Straggler.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Loops.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "dtrain/train/Stop.h"
#include "train/runners/Run.h"

namespace dtrain::train::runners {

namespace {

// The signals a stop is voted by, in precedence order: a rank's vote is a 1 at its signal's
// place after the loss (element 0) in the tensor the ranks sum. Any other request (a library's
// request_stop) counts as SIGTERM; SIGUSR2 is the launcher's forwarded request.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
constexpr int64_t kVoteSize = 1 + std::size(kStopSignals);

void set_stop_vote(at::Tensor& agreed) {
  const int signal = stop_requested();
  if (signal == 0) return;
  int64_t place = 2;  // SIGTERM
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (kStopSignals[i] == signal) place = 1 + static_cast<int64_t>(i);
  }
  agreed.data_ptr<double>()[place] = 1.0;
}

// The signal the ranks agreed to stop on, after the allreduce (a sum) of their votes; 0: none.
int agreed_stop(const at::Tensor& agreed) {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    if (agreed.data_ptr<double>()[1 + i] > 0) return kStopSignals[i];
  }
  return 0;
}

/// After a synchronous step: the loss every rank reports and the stop on request the ranks
/// agree on (0: none). `async` or `outlive`: this rank's own loss and stop.
int agree_after_step(Run& run, parallel::StepResult& result, int64_t step, bool async,
                     bool outlive) {
  // The loss every rank reports is the mean over the ranks of its step group (the world,
  // unless the strategy names a group); the sum is non-finite when any rank's is, so they
  // agree on stopping. (Asynchronous workers report their own.)
  // A stop on request (dtrain/train/Stop.h) rides on the same allreduce when the step group
  // is the world: every rank stops after the same step. A strategy whose steps agree within a
  // smaller group (DiLoCo's islands, a flush-free pipeline's stage) asks the world every
  // Strategy::stop_check_every() steps instead. Asynchronous workers and replicas that outlive
  // each other stop by themselves (under --fault-tolerance replicas only the replica told stops).
  int stop_signal = 0;
  if (!async && !outlive) {
    const comm::CommunicatorPtr step_group = run.strategy.step_group();
    comm::Communicator& group = step_group ? *step_group : run.world;
    bool agree_here = &group == &run.world || group.size() == run.world.size();
    at::Tensor agreed = at::zeros({kVoteSize}, at::kDouble);
    agreed.data_ptr<double>()[0] = result.loss;
    if (agree_here) set_stop_vote(agreed);
    group.allreduce(agreed)->wait();
    result.loss = agreed.data_ptr<double>()[0] / group.size();
    if (!agree_here && (step + 1) % std::max<int64_t>(1, run.strategy.stop_check_every()) == 0) {
      agreed.zero_();
      set_stop_vote(agreed);
      run.world.allreduce(agreed)->wait();
      agree_here = true;
    }
    if (agree_here) stop_signal = agreed_stop(agreed);
  } else if (const int signal = stop_requested(); signal != 0) {
    stop_signal = std::find(std::begin(kStopSignals), std::end(kStopSignals), signal) !=
                          std::end(kStopSignals)
                      ? signal
                      : SIGTERM;
  }
  return stop_signal;
}

/// What a step's metrics record and progress line say of it.
struct StepFigures {
  int64_t step = 0, reached = 0, epoch = 0, in_epoch = 0, wire_bytes = 0;
  double lr = 0, seconds = 0, throughput = 0;
  double tokens_per_s = 0, model_flops_per_s = 0, mfu = -1;
  bool async = false, done = false;
};

void language_rates(const TrainerOptions& o, const std::vector<data::Batch>& batches,
                    int world_size, StepFigures& f) {
  // A language model's tokens per second, its model FLOP/s where its FLOPs per token are
  // known, and its MFU where the device's peak is given too.
  if (o.token_loss && !batches.empty()) {
    const at::Tensor& window = batches[0].inputs.defined() ? batches[0].inputs : batches[0].targets;
    if (window.defined() && window.dim() >= 1) f.tokens_per_s = f.throughput * window.size(-1);
    f.model_flops_per_s = f.tokens_per_s * o.flops_per_token;
    if (f.model_flops_per_s > 0 && o.peak_tflops > 0) {
      f.mfu = f.model_flops_per_s / (o.peak_tflops * 1e12 * world_size);
    }
  }
}

/// The leader's record of a step in the metrics file (every --log-every steps, the last, and an
/// asynchronous worker's step at which the servers' budget ran out) and its progress line.
void write_step(Run& run, const parallel::StepResult& result, const StepFigures& f) {
  const TrainerOptions& o = run.options;
  // An asynchronous leader also records the step at which the servers' budget ran out (it
  // may make fewer steps than --log-every when the other workers are faster).
  const int64_t step = f.step;
  if ((step + 1) % o.log_every == 0 || step + 1 == run.total_steps || f.done) {
    MetricRecord record{
        {"event", std::string("step")}, {"step", f.reached}, {"epoch", f.epoch},
        {"loss", result.loss},          {"lr", f.lr},        {"step_ms", f.seconds * 1e3},
        {"samples_per_s", f.throughput}};
    // Wall-clock time (Unix seconds): when the step ended, comparable across restarts.
    record["time"] =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (result.grad_norm >= 0) record["grad_norm"] = result.grad_norm;
    if (f.tokens_per_s > 0) record["tokens_per_s"] = f.tokens_per_s;
    if (f.model_flops_per_s > 0) record["model_tflops"] = f.model_flops_per_s / 1e12;
    if (f.mfu >= 0) record["mfu"] = f.mfu;
    if (f.async) record["worker_step"] = step + 1;
    // What this rank sent in the step's collectives (ring estimate; p2p as sent).
    if (run.world.size() > 1 && !f.async) record["wire_bytes"] = f.wire_bytes;
    for (const auto& [key, value] : result.metrics) record[key] = value;
    run.metrics.write(record);
  }
  if (o.progress) {
    ProgressLine line;
    line.done = f.reached;
    line.total = run.total_steps;  // --max-steps when it cuts the epochs short
    line.epoch = f.epoch;
    line.epochs = run.train.presampled()
                      ? 1
                      : (run.total_steps + run.steps_per_epoch - 1) / run.steps_per_epoch;
    line.epoch_end = f.in_epoch + 1 == run.steps_per_epoch;
    line.loss = result.loss;
    line.lr = f.lr;
    line.samples_per_s = f.throughput;
    line.tokens_per_s = f.tokens_per_s;
    line.model_flops_per_s = f.model_flops_per_s;
    line.mfu = f.mfu;
    line.step_ms = f.seconds * 1e3;
    line.eta_s = (run.total_steps - f.reached) * run.train_seconds /
                 std::max<int64_t>(1, f.reached - run.start_step);
    line.peak_bytes = peak_resident_bytes();
    run.progress.update(line);
  }
}

class StepRunner : public Runner {
 public:
  void run(Run& run) override;

 protected:
  /// The asynchronous worker (nullptr: synchronous steps).
  virtual parallel::AsynchronousWorker* worker(Run&) { return nullptr; }
  /// After the loop (the asynchronous workers' end).
  virtual void finish(Run&) {}

 private:
  /// The micro-batches of `step`, on the CPU (pinned for a CUDA device): the epoch's order is
  /// read when it changes. Called for one step at a time, on the reading thread.
  std::vector<data::Batch> read_step(Run& run, int64_t step);

  std::unique_ptr<data::DistributedSampler> sampler_;
  std::vector<int64_t> order_;
  int64_t order_epoch_ = -1;
};

std::vector<data::Batch> StepRunner::read_step(Run& run, int64_t step) {
  const TrainerOptions& o = run.options;
  const int64_t epoch = step / run.steps_per_epoch;
  const int64_t in_epoch = step % run.steps_per_epoch;
  if (epoch != order_epoch_) {
    sampler_->set_epoch(epoch);
    run.train.set_epoch(epoch);
    order_ = sampler_->indices();
    order_epoch_ = epoch;
  }
  const bool pin = run.device.is_cuda();
  auto pinned = [pin](const at::Tensor& t) {
    return pin && t.defined() && !t.is_pinned() ? t.pin_memory() : t;
  };
  std::vector<data::Batch> batches;
  for (int64_t m = 0; m < o.accumulation_steps; ++m) {
    const int64_t begin = in_epoch * run.local_step_batch + m * o.batch_size;
    const std::vector<int64_t> indices(order_.begin() + begin,
                                       order_.begin() + begin + o.batch_size);
    if (run.needs.inputs) {
      const data::Batch batch = run.train.get(indices);
      batches.push_back({pinned(batch.inputs), pinned(batch.targets)});
    } else if (run.needs.targets) {
      batches.push_back({at::Tensor(), pinned(run.train.get_targets(indices))});
    } else {
      batches.emplace_back();
    }
  }
  return batches;
}

void StepRunner::run(Run& run) {
  const TrainerOptions& o = run.options;
  parallel::AsynchronousWorker* async = worker(run);
  sampler_ = std::make_unique<data::DistributedSampler>(
      run.train.size(), run.dp_size, run.dp_rank,
      data::SamplerOptions{!run.train.presampled(), o.seed, true});
  order_epoch_ = -1;
  // One worker left alone would make all the asynchronous steps: that bounds its loop.
  const int64_t loop_end =
      async ? run.start_step + (run.last_step - run.start_step) * run.dp_size : run.last_step;
  auto reached_step = [&](int64_t local) {
    return async ? run.start_step + async->global_steps() / run.dp_size : local;
  };
  // Replicas that outlive each other: the strategy's loss is already the mean over the replicas
  // present, and the leading replica (rank 0's until it fails; its tensor-parallel group)
  // evaluates and checkpoints alone (no collective a failure could break); replicas that shard
  // the state between them checkpoint together.
  const bool outlive = run.strategy.survives_replica_failures();
  parallel::ft::ReplaceableReplicas* const replicas = parallel::ft::replaceable(run.strategy);
  const bool alone = async != nullptr || outlive;
  // The next step's batches, read while this one trains.
  std::future<std::vector<data::Batch>> ahead;
  auto read_ahead = [this, &run](int64_t step) {
    return std::async(std::launch::async, [this, &run, step] { return read_step(run, step); });
  };
  if (run.start_step < loop_end) ahead = read_ahead(run.start_step);
  for (int64_t step = run.start_step; step < loop_end; ++step) {
    const int64_t epoch = step / run.steps_per_epoch;
    const int64_t in_epoch = step % run.steps_per_epoch;
    const double lr = run.schedule->at(step);
    optim::set_learning_rate(run.strategy.optimizer(), lr);
    std::vector<data::Batch> batches;
    {
      trace::Span data_span("data", concat("waiting for step ", step + 1, "'s batches"));
      batches = ahead.get();
    }
    if (step + 1 < loop_end) ahead = read_ahead(step + 1);
    for (data::Batch& batch : batches) batch = to_device(batch, run.device);
    trace::Span step_span("step", concat("step ", step + 1));
    const auto step_start = Clock::now();
    const int64_t wire_before = run.world.wire_bytes();
    parallel::StepResult result = run.strategy.train_step(batches, run.loss);
    if (run.experts) run.experts->after_step(result.metrics);
    // The replica that led failed in this step: this rank writes the outputs from now on.
    if (outlive && replicas != nullptr && replicas->leads()) run.take_lead();
    if (!async && step + 1 == run.total_steps) run.strategy.finish_training(result);
    const int64_t wire_bytes = run.world.wire_bytes() - wire_before;
    const int stop_signal = agree_after_step(run, result, step, async != nullptr, outlive);
    const int64_t reached = reached_step(step + 1);
    const bool done = async && (reached >= run.last_step || stop_signal != 0);
    if (run.world.rank() == o.slowdown_rank && o.slowdown_factor > 1.0) {
      straggle((o.slowdown_factor - 1.0) * seconds_since(step_start), o.slowdown_spin);
    }
    const double step_seconds = seconds_since(step_start);
    run.check_finite(result, step + 1);
    run.train_seconds += step_seconds;
    run.samples += result.samples * (async ? 1 : run.dp_size);
    run.result.losses.push_back(result.loss);
    run.result.steps = reached;
    run.report.reached(reached);
    const double throughput = run.samples / std::max(run.train_seconds, 1e-9);
    StepFigures f;
    f.step = step, f.reached = reached, f.epoch = epoch, f.in_epoch = in_epoch;
    f.lr = lr, f.seconds = step_seconds, f.throughput = throughput, f.wire_bytes = wire_bytes;
    f.async = async != nullptr, f.done = done;
    language_rates(o, batches, run.world.size(), f);
    if (run.callbacks != nullptr) {
      StepEvent event;
      event.step = reached;
      event.total_steps = run.total_steps;
      event.epoch = epoch;
      event.loss = result.loss;
      event.lr = lr;
      event.seconds = step_seconds;
      event.samples_per_second = throughput;
      event.grad_norm = result.grad_norm;
      event.metrics = result.metrics;
      run.step_done(event);
    }

    if (run.leader) write_step(run, result, f);
    const bool epoch_end = in_epoch + 1 == run.steps_per_epoch || step + 1 == run.total_steps;
    const bool halting = async ? done : step + 1 == run.last_step || stop_signal != 0;
    const bool eval_due = o.eval_every > 0 && (step + 1) % o.eval_every == 0;
    // Asynchronous: rank 0 alone evaluates and checkpoints; the final ones come after the loop.
    const bool here = async      ? run.leader && !halting
                      : !outlive ? true
                                 : replicas != nullptr && replicas->in_leading_replica();
    if ((epoch_end || eval_due) && run.validation != nullptr) {
      if (o.defer_eval) {
        if (run.leader && (!async || !halting)) run.snapshot(reached, epoch);
      } else if (here) {
        run.evaluate_and_record(reached, epoch, alone);
        if (run.leader && o.progress && !epoch_end) {
          run.progress.note(concat("step ", step + 1, ": ",
                                   describe_eval_as(*run.result.validation, o.token_loss)));
        }
      }
    }
    if (run.leader && o.progress && epoch_end) {
      run.progress.finish_epoch(
          run.result.validation ? describe_eval_as(*run.result.validation, o.token_loss) : "");
    }
    const bool periodic = o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0;
    // Replicas that checkpoint together do not when one of them stops on request alone.
    const bool saves = here || (replicas != nullptr && replicas->checkpoints_in_every_replica() &&
                                !(outlive && stop_signal != 0));
    if (!o.checkpoint_dir.empty() && (periodic || epoch_end || halting) &&
        run.nonfinite_steps == 0 && saves) {
      trace::Span checkpoint_span("checkpoint", concat("checkpoint ", reached));
      run.save(reached, epoch, alone);
    }
    run.failure.maybe_fire(step + 1);
    // Replacements the step admitted take part from the next one (live recovery).
    if (stop_signal != 0) {
      run.result.stopped_by = stop_signal;
      if (!async) break;
    }
    if (replicas) replicas->admit_waiting(reached);
    if (done) break;
  }
  // A replica stopped on request leaves; the others may go on.
  if (replicas && run.leader && run.result.stopped_by == 0) replicas->close_admissions();
  finish(run);
}

class AsynchronousRunner : public StepRunner {
 protected:
  parallel::AsynchronousWorker* worker(Run& run) override {
    return &parallel::as_asynchronous(run.strategy);
  }
  // Every worker sends what it holds and leaves (no collective: a worker that died must not
  // stop the others); rank 0 waits for the others' last updates, then takes the newest
  // parameters for the final evaluation and checkpoint.
  void finish(Run& run) override {
    parallel::AsynchronousWorker& async = parallel::as_asynchronous(run.strategy);
    async.finish();
    if (!run.leader) return;
    const std::string missing = async.await_workers();
    if (!missing.empty()) std::fprintf(stderr, "%s\n", missing.c_str());
    const int64_t steps = run.start_step + async.global_steps() / run.dp_size;
    run.finish_alone(async.run_metrics(), steps, steps / std::max<int64_t>(1, run.steps_per_epoch));
  }
};

}  // namespace

std::unique_ptr<Runner> make_step_runner() { return std::make_unique<StepRunner>(); }
std::unique_ptr<Runner> make_asynchronous_runner() {
  return std::make_unique<AsynchronousRunner>();
}

}  // namespace dtrain::train::runners
