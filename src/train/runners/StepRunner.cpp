// The step loops. Synchronous: every rank makes each step together (one
// collective for the loss), evaluates and checkpoints together. Asynchronous
// (parameter-server workers): each worker runs through its own share of the
// data as fast as it can, with no per-step collective; the run ends when all of
// them together have made the worker steps of the synchronous run (steps x
// replicas), however they were shared out, and rank 0 alone evaluates and
// checkpoints.
#include <ATen/ATen.h>

#include <cmath>

#include "common/Straggler.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Loops.h"
#include "train/runners/Run.h"

namespace dtrain::train::runners {

namespace {

class StepRunner : public Runner {
public:
  void run(Run &run) override;

protected:
  /// The asynchronous worker (nullptr: synchronous steps).
  virtual parallel::AsynchronousWorker *worker(Run &) { return nullptr; }
  /// After the loop (the asynchronous workers' end).
  virtual void finish(Run &) {}

private:
  std::vector<data::Batch> micro_batches(Run &run, int64_t in_epoch) const;

  std::vector<int64_t> order_;
};

std::vector<data::Batch> StepRunner::micro_batches(Run &run,
                                                   int64_t in_epoch) const {
  const TrainerOptions &o = run.options;
  std::vector<data::Batch> batches;
  for (int64_t m = 0; m < o.accumulation_steps; ++m) {
    const int64_t begin = in_epoch * run.local_step_batch + m * o.batch_size;
    const std::vector<int64_t> indices(order_.begin() + begin,
                                       order_.begin() + begin + o.batch_size);
    if (run.needs.inputs) {
      batches.push_back(to_device(run.train.get(indices), run.device));
    } else if (run.needs.targets) {
      batches.push_back(to_device(
          {at::Tensor(), run.train.get_targets(indices)}, run.device));
    } else {
      batches.emplace_back();
    }
  }
  return batches;
}

void StepRunner::run(Run &run) {
  const TrainerOptions &o = run.options;
  parallel::AsynchronousWorker *async = worker(run);
  data::DistributedSampler sampler(run.train.size(), run.dp_size, run.dp_rank,
                                   {!run.train.presampled(), o.seed, true});
  // One worker left alone would make all the asynchronous steps: that bounds
  // its loop.
  const int64_t loop_end =
      async ? run.start_step + (run.last_step - run.start_step) * run.dp_size
            : run.last_step;
  auto reached_step = [&](int64_t local) {
    return async ? run.start_step + async->global_steps() / run.dp_size : local;
  };
  const comm::CommunicatorPtr step_group = run.strategy.step_group();
  int64_t order_epoch = -1;
  for (int64_t step = run.start_step; step < loop_end; ++step) {
    const int64_t epoch = step / run.steps_per_epoch;
    const int64_t in_epoch = step % run.steps_per_epoch;
    if (epoch != order_epoch) {
      sampler.set_epoch(epoch);
      run.train.set_epoch(epoch);
      order_ = sampler.indices();
      order_epoch = epoch;
    }
    const double lr = run.schedule->at(step);
    optim::set_learning_rate(run.strategy.optimizer(), lr);
    const std::vector<data::Batch> batches = micro_batches(run, in_epoch);
    trace::Span step_span("step", concat("step ", step + 1));
    const auto step_start = Clock::now();
    const int64_t wire_before = run.world.wire_bytes();
    parallel::StepResult result = run.strategy.train_step(batches, run.loss);
    if (!async && step + 1 == run.total_steps)
      run.strategy.finish_training(result);
    const int64_t wire_bytes = run.world.wire_bytes() - wire_before;
    // The loss every rank reports is the mean over the ranks of its step group
    // (the world, unless the strategy names a group); the sum is non-finite
    // when any rank's is, so they agree on stopping. (Asynchronous workers
    // report their own.)
    if (!async) {
      at::Tensor loss_sum = at::tensor({result.loss}, at::kDouble);
      comm::Communicator &group = step_group ? *step_group : run.world;
      group.allreduce(loss_sum)->wait();
      result.loss = loss_sum.item<double>() / group.size();
    }
    const int64_t reached = reached_step(step + 1);
    const bool done = async && reached >= run.last_step;
    if (run.world.rank() == o.slowdown_rank && o.slowdown_factor > 1.0) {
      straggle((o.slowdown_factor - 1.0) * seconds_since(step_start),
               o.slowdown_spin);
    }
    const double step_seconds = seconds_since(step_start);
    run.check_finite(result, step + 1);
    run.train_seconds += step_seconds;
    run.samples += result.samples * (async ? 1 : run.dp_size);
    run.result.losses.push_back(result.loss);
    run.result.steps = reached;
    run.report.reached(reached);
    const double throughput = run.samples / std::max(run.train_seconds, 1e-9);

    // An asynchronous leader also records the step at which the servers' budget
    // ran out (it may make fewer steps than --log-every when the other workers
    // are faster).
    if (run.leader && ((step + 1) % o.log_every == 0 ||
                       step + 1 == run.total_steps || done)) {
      MetricRecord record{{"event", std::string("step")},
                          {"step", reached},
                          {"epoch", epoch},
                          {"loss", result.loss},
                          {"lr", lr},
                          {"step_ms", step_seconds * 1e3},
                          {"samples_per_s", throughput}};
      if (result.grad_norm >= 0)
        record["grad_norm"] = result.grad_norm;
      if (async)
        record["worker_step"] = step + 1;
      // What this rank sent in the step's collectives (ring estimate; p2p as
      // sent).
      if (run.world.size() > 1 && !async)
        record["wire_bytes"] = wire_bytes;
      for (const auto &[key, value] : result.metrics)
        record[key] = value;
      run.metrics.write(record);
    }
    if (run.leader && o.progress) {
      const double eta = (run.total_steps - step - 1) * run.train_seconds /
                         (step + 1 - run.start_step);
      run.progress.update(epoch, run.train.presampled() ? 1 : o.epochs,
                          in_epoch + 1, run.steps_per_epoch, result.loss,
                          throughput, eta);
    }
    const bool epoch_end =
        in_epoch + 1 == run.steps_per_epoch || step + 1 == run.total_steps;
    const bool halting = async ? done : step + 1 == run.last_step;
    const bool eval_due = o.eval_every > 0 && (step + 1) % o.eval_every == 0;
    // Asynchronous: rank 0 alone evaluates and checkpoints; the final ones come
    // after the loop.
    const bool here = !async || (run.leader && !halting);
    if ((epoch_end || eval_due) && run.validation != nullptr) {
      if (o.defer_eval) {
        if (run.leader && (!async || !halting))
          run.snapshot(reached, epoch);
      } else if (here) {
        run.evaluate_and_record(reached, epoch, async != nullptr);
        if (run.leader && o.progress && !epoch_end) {
          run.progress.note(
              concat("step ", step + 1, ": ",
                     describe_eval_as(*run.result.validation, o.token_loss)));
        }
      }
    }
    if (run.leader && o.progress && epoch_end) {
      run.progress.finish_epoch(
          run.result.validation
              ? describe_eval_as(*run.result.validation, o.token_loss)
              : "");
    }
    const bool periodic =
        o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0;
    if (!o.checkpoint_dir.empty() && (periodic || epoch_end || halting) &&
        run.nonfinite_steps == 0 && here) {
      trace::Span checkpoint_span("checkpoint", concat("checkpoint ", reached));
      run.save(reached, epoch, async != nullptr);
    }
    run.failure.maybe_fire(step + 1);
    if (done)
      break;
  }
  finish(run);
}

class AsynchronousRunner : public StepRunner {
protected:
  parallel::AsynchronousWorker *worker(Run &run) override {
    return &parallel::as_asynchronous(run.strategy);
  }
  // Every worker sends what it holds and leaves (no collective: a worker that
  // died must not stop the others); rank 0 waits for the others' last updates,
  // then takes the newest parameters for the final evaluation and checkpoint.
  void finish(Run &run) override {
    parallel::AsynchronousWorker &async =
        parallel::as_asynchronous(run.strategy);
    async.finish();
    if (!run.leader)
      return;
    const std::string missing = async.await_workers();
    if (!missing.empty())
      std::fprintf(stderr, "%s\n", missing.c_str());
    const int64_t steps = run.start_step + async.global_steps() / run.dp_size;
    run.finish_alone(async.run_metrics(), steps,
                     steps / std::max<int64_t>(1, run.steps_per_epoch));
  }
};

} // namespace

std::unique_ptr<Runner> make_step_runner() {
  return std::make_unique<StepRunner>();
}
std::unique_ptr<Runner> make_asynchronous_runner() {
  return std::make_unique<AsynchronousRunner>();
}

} // namespace dtrain::train::runners
