// The runner of a strategy that drives its own loop (Sandblaster L-BFGS: a coordinator hands
// out work units): it hands the strategy the data, the loss and callbacks, and on rank 0 turns
// each iteration the strategy reports into metrics, progress, evaluations and checkpoints.
#include "dtrain/common/Error.h"
#include "dtrain/parallel/Loops.h"
#include "train/runners/Run.h"

namespace dtrain::train::runners {

namespace {

/// Iterations of a strategy that runs its own loop without --max-steps.
constexpr int64_t kDrivenIterations = 100;

class DrivenRunner : public Runner {
 public:
  // Its iterations are its steps: --max-steps of them, else kDrivenIterations.
  int64_t plan_steps(int64_t, const TrainerOptions& options) const override {
    return options.max_steps > 0 ? options.max_steps : kDrivenIterations;
  }

  void run(Run& run) override {
    const TrainerOptions& o = run.options;
    parallel::DrivenLoop& loop = parallel::as_driven(run.strategy);
    parallel::LoopContext context;
    context.train = &run.train;
    context.loss = run.loss;
    context.max_iterations = std::max<int64_t>(0, run.last_step - run.start_step);
    context.chunk = o.eval_batch_size > 0 ? o.eval_batch_size : 256;
    context.slowdown = run.world.rank() == o.slowdown_rank ? o.slowdown_factor : 1.0;
    context.slowdown_spin = o.slowdown_spin;
    context.weight_decay = run.weight_decay;
    context.stall_ms = run.world.timeout().count();
    context.on_iteration = [&run](const parallel::IterationReport& iteration) {
      on_iteration(run, iteration);
    };
    // A simulated failure (DTRAIN_SIMULATE_FAILURE=RANK:N) fires after the rank's N-th unit of
    // work, computed and sent but not yet reported.
    context.on_work = [&run](int64_t done) { run.failure.maybe_fire(done); };
    const int64_t iterations = loop.run_loop(context);
    if (run.leader) {
      if (o.progress) run.progress.finish_epoch("");
      run.finish_alone(loop.run_metrics(), run.start_step + iterations, 0);
    }
    run.result.global_batch = run.train.size();  // every iteration uses the whole set
  }

 private:
  static void on_iteration(Run& run, const parallel::IterationReport& iteration) {
    const TrainerOptions& o = run.options;
    const int64_t reached = run.start_step + iteration.iteration;
    run.train_seconds += iteration.seconds;
    run.samples += iteration.evaluations * run.train.size();
    run.result.losses.push_back(iteration.loss);
    run.result.steps = reached;
    run.report.reached(reached);
    const double throughput = run.samples / std::max(run.train_seconds, 1e-9);
    MetricRecord record{{"event", std::string("step")},
                        {"step", reached},
                        {"epoch", int64_t{0}},
                        {"loss", iteration.loss},
                        {"step_ms", iteration.seconds * 1e3},
                        {"samples_per_s", throughput}};
    if (iteration.grad_norm >= 0) record["grad_norm"] = iteration.grad_norm;
    for (const auto& [key, value] : iteration.metrics) record[key] = value;
    run.metrics.write(record);
    if (run.callbacks != nullptr) {
      StepEvent event;
      event.step = reached;
      event.total_steps = run.total_steps;
      event.loss = iteration.loss;
      event.seconds = iteration.seconds;
      event.samples_per_second = throughput;
      event.grad_norm = iteration.grad_norm;
      event.metrics = iteration.metrics;
      run.step_done(event);
    }
    if (o.progress) {
      const double eta = (run.last_step - reached) * run.train_seconds /
                         std::max<int64_t>(1, reached - run.start_step);
      ProgressLine line;
      line.unit = "iteration";
      line.done = reached;
      line.total = run.total_steps;
      line.loss = iteration.loss;
      line.samples_per_s = throughput;
      line.step_ms = iteration.seconds * 1e3;
      line.eta_s = eta;
      run.progress.update(line);
    }
    const bool eval_due =
        run.validation != nullptr && o.eval_every > 0 && reached % o.eval_every == 0;
    if (eval_due && o.defer_eval) {
      run.snapshot(reached, 0);
    } else if (eval_due) {
      run.evaluate_and_record(reached, std::nullopt, true);
      if (o.progress) {
        run.progress.note(concat("iteration ", reached, ": ",
                                 describe_eval_as(*run.result.validation, o.token_loss)));
      }
    }
    if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 && reached % o.checkpoint_every == 0) {
      run.save(reached, 0, true);
    }
  }
};

}  // namespace

std::unique_ptr<Runner> make_driven_runner() { return std::make_unique<DrivenRunner>(); }

}  // namespace dtrain::train::runners
