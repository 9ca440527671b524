// What every runner shares: the run's outputs, evaluation records, deferred evaluations, the
// finiteness guard, the end of an asynchronous run, and the choice of runner.
#include "train/runners/Run.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/ft/Replicas.h"

namespace dtrain::train::runners {

std::unique_ptr<Runner> make_runner(parallel::Loop loop) {
  switch (loop) {
    case parallel::Loop::kSteps:
      return make_step_runner();
    case parallel::Loop::kAsynchronous:
      return make_asynchronous_runner();
    case parallel::Loop::kDriven:
      return make_driven_runner();
  }
  DTRAIN_THROW(Error, "unknown loop kind ", static_cast<int>(loop));
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

data::Batch to_device(const data::Batch& batch, c10::Device device) {
  return {dtrain::to_device(batch.inputs, device), dtrain::to_device(batch.targets, device)};
}

std::string describe_eval_as(const EvalResult& eval, bool tokens) {
  char text[96];
  if (tokens) {
    std::snprintf(text, sizeof(text), "val %.4f nats/token (%.3f bits), next-token acc %.1f%%",
                  eval.loss, eval.loss / std::log(2.0), eval.accuracy * 100);
  } else {
    std::snprintf(text, sizeof(text), "val acc %.2f%%", eval.accuracy * 100);
  }
  return text;
}

ProgressReport::ProgressReport(const char* path, int64_t start) : start_(start) {
  if (path != nullptr && *path != '\0') fd_ = ::open(path, O_WRONLY | O_CLOEXEC);
  reached(start);
}

void ProgressReport::open(const char* path) {
  if (fd_ >= 0 || path == nullptr || *path == '\0') return;
  fd_ = ::open(path, O_WRONLY | O_CLOEXEC);
}

ProgressReport::~ProgressReport() {
  if (fd_ >= 0) ::close(fd_);
}

void ProgressReport::reached(int64_t step) {
  if (fd_ < 0) return;
  char line[64];
  const int n = std::snprintf(line, sizeof(line), "%20lld %20lld\n", static_cast<long long>(start_),
                              static_cast<long long>(step));
  if (::pwrite(fd_, line, n, 0) != n) {
    ::close(fd_);
    fd_ = -1;
  }
}

SimulatedFailure SimulatedFailure::from_env(int my_rank) {
  SimulatedFailure f;
  if (const char* slow = std::getenv("DTRAIN_SIMULATE_SLOW_STEP_MS")) {
    f.slow_ms = std::max(0, std::atoi(slow));
  }
  const char* spec = std::getenv("DTRAIN_SIMULATE_FAILURE");
  if (spec == nullptr || *spec == '\0') return f;
  long long rank = -1, step = -1, attempts = -1;
  // RANK '*': every rank (every replica failing at once).
  const bool every = spec[0] == '*';
  const int fields = every ? 1 + std::sscanf(spec + 1, ":%lld:%lld", &step, &attempts)
                           : std::sscanf(spec, "%lld:%lld:%lld", &rank, &step, &attempts);
  if (every) rank = my_rank;
  const std::string text = spec;
  f.node = text.size() > 5 && text.compare(text.size() - 5, 5, ":node") == 0;
  f.stop = text.size() > 5 && text.compare(text.size() - 5, 5, ":stop") == 0;
  f.stop_in_store = text.size() > 14 && text.compare(text.size() - 14, 14, ":stop-in-store") == 0;
  f.stop = f.stop || f.stop_in_store;
  f.input = text.size() > 6 && text.compare(text.size() - 6, 6, ":input") == 0;
  f.in_checkpoint = text.size() > 11 && text.compare(text.size() - 11, 11, ":checkpoint") == 0;
  DTRAIN_CHECK_INPUT(fields >= 2 && rank >= 0 && step >= 1, "DTRAIN_SIMULATE_FAILURE='", spec,
                     "' is not RANK:STEP[:ATTEMPTS][:node|:stop|:stop-in-store|:checkpoint|"
                     ":input] (RANK * for every rank)");
  const char* restart = std::getenv("DTRAIN_RESTART_COUNT");
  const long long attempt = restart ? std::atoll(restart) : 0;
  f.rank = static_cast<int>(rank);
  f.step = step;
  f.armed = rank == my_rank && (fields < 3 || attempt < attempts);
  return f;
}

void SimulatedFailure::maybe_fire_in_checkpoint(int64_t reached) const {
  if (!armed || !in_checkpoint || reached != step) return;
  std::fprintf(stderr, "dtrain: DTRAIN_SIMULATE_FAILURE: rank %d kills itself in step %lld's "
               "checkpoint\n", rank, static_cast<long long>(step));
  std::fflush(stderr);
  ::raise(SIGKILL);
}

void SimulatedFailure::begin_store_request() {
  const char* host = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (host == nullptr || port == nullptr) return;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host, port, &hints, &found) != 0 || found == nullptr) return;
  const int fd = ::socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    const unsigned char first = 0;  // a query's type, its key never following
    (void)!::write(fd, &first, 1);  // the socket stays open: the process stops with it
  }
  ::freeaddrinfo(found);
}

void SimulatedFailure::maybe_fire(int64_t reached) const {
  if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
  if (armed && input && reached == step) {
    DTRAIN_THROW(InputError, "DTRAIN_SIMULATE_FAILURE: rank ", rank, " met bad input at step ",
                 step);
  }
  if (armed && !in_checkpoint && reached == step) {
    std::fprintf(stderr, "dtrain: DTRAIN_SIMULATE_FAILURE: rank %d %s at step %lld\n", rank,
                 stop   ? "stops itself"
                 : node ? "kills its launcher and itself"
                        : "kills itself",
                 static_cast<long long>(step));
    std::fflush(stderr);
    if (stop) {
      // :stop-in-store: it stops halfway through a request to the rendezvous store (the first
      // byte of one sent, the rest never): what a machine that freezes while its heartbeat
      // thread talks to the store leaves behind.
      if (stop_in_store) begin_store_request();
      ::raise(SIGSTOP);
      return;  // continued: as a machine that hung for a while
    }
    if (node) ::kill(::getppid(), SIGKILL);
    ::raise(SIGKILL);
  }
}

Run::Run(const TrainerOptions& options, parallel::Strategy& strategy, comm::Communicator& world,
         const data::TensorDataset& train, const data::TensorDataset* validation,
         int64_t start_step, int64_t steps_per_epoch)
    : options(options),
      strategy(strategy),
      world(world),
      train(train),
      validation(validation),
      // (A replacement of rank 0 under --fault-tolerance replicas does not lead: the replica
      // that led meanwhile goes on leading.)
      leader(parallel::ft::replaceable(strategy) != nullptr
                 ? parallel::ft::replaceable(strategy)->leads()
                 : world.rank() == 0),
      start_step(start_step),
      steps_per_epoch(steps_per_epoch),
      report(leader ? std::getenv("DTRAIN_PROGRESS_FILE") : nullptr, start_step),
      failure(SimulatedFailure::from_env(world.rank())),
      metrics(leader ? options.metrics_file : "", start_step > 0,
              leader ? options.tensorboard_dir : ""),
      progress(stdout, ProgressBar::is_terminal(stdout), options.log_every) {
  result.start_step = start_step;
  result.steps = start_step;
  // The run's configuration for TensorBoard's text plugin (what `dtrain train` recorded).
  for (const char* key : {"config", "plan"}) {
    const auto found = options.checkpoint_extras.find(key);
    if (found != options.checkpoint_extras.end() && !found->second.empty()) {
      metrics.text(key, "```\n" + found->second + "\n```");
    }
  }
}

void Run::take_lead() {
  if (leader) return;
  leader = true;
  metrics = MetricsWriter(options.metrics_file, true, options.tensorboard_dir);
  report.open(std::getenv("DTRAIN_PROGRESS_FILE"));
}

void Run::evaluate_and_record(int64_t step, std::optional<int64_t> epoch, bool alone) {
  result.validation = evaluate(alone);
  if (callbacks != nullptr && callbacks->on_evaluation) {
    callbacks->on_evaluation(step, *result.validation);
  }
  if (!leader) return;
  MetricRecord record{
      {"event", std::string("eval")},        {"step", step},
      {"seconds", seconds_since(start)},     {"train_seconds", train_seconds},
      {"val_loss", result.validation->loss}, {"val_accuracy", result.validation->accuracy}};
  if (epoch) record["epoch"] = *epoch;
  if (options.token_loss) record["val_bits_per_token"] = result.validation->loss / std::log(2.0);
  metrics.write(record);
}

std::vector<at::Tensor> Run::model_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& p : strategy.model().module->parameters()) out.push_back(p.detach());
  for (const auto& b : strategy.model().module->buffers()) out.push_back(b.detach());
  return out;
}

void Run::snapshot(int64_t step, int64_t epoch) {
  std::vector<at::Tensor> copy;
  for (const auto& t : model_tensors()) copy.push_back(t.clone());
  snapshots_.push_back({step, epoch, seconds_since(start), train_seconds, std::move(copy)});
}

void Run::evaluate_snapshots() {
  if (!leader || snapshots_.empty()) return;
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> now = model_tensors();
  std::vector<at::Tensor> final_state;
  for (const auto& t : now) final_state.push_back(t.clone());
  auto restore = [&](const std::vector<at::Tensor>& state) {
    for (size_t i = 0; i < now.size(); ++i) now[i].copy_(state[i]);
  };
  std::optional<EvalResult> last;
  for (const Snapshot& snapshot : snapshots_) {
    restore(snapshot.state);
    last = evaluate(true);
    metrics.write({{"event", std::string("eval")},
                   {"step", snapshot.step},
                   {"epoch", snapshot.epoch},
                   {"seconds", snapshot.seconds},
                   {"train_seconds", snapshot.train_seconds},
                   {"deferred", int64_t{1}},
                   {"val_loss", last->loss},
                   {"val_accuracy", last->accuracy}});
  }
  restore(final_state);
  if (!result.validation) result.validation = last;
}

void Run::check_finite(const parallel::StepResult& step, int64_t step_number) {
  const auto skipped = step.metrics.find("step_skipped");
  const bool finite =
      std::isfinite(step.loss) && (step.grad_norm < 0 || std::isfinite(step.grad_norm));
  if (!finite && !(skipped != step.metrics.end() && skipped->second > 0)) {
    ++nonfinite_steps;
  } else if (finite) {
    nonfinite_steps = 0;
  }
  if (options.max_nonfinite_steps == 0 || nonfinite_steps < options.max_nonfinite_steps) return;
  if (leader && options.progress) progress.finish_epoch("stopped");
  DTRAIN_THROW(
      Error, "training diverged: the loss (", step.loss, ")",
      step.grad_norm >= 0 ? concat(" or gradient norm (", step.grad_norm, ")") : std::string(),
      " was not finite for ", nonfinite_steps, " consecutive steps, the last at step ", step_number,
      " (limit --max-nonfinite-steps ", options.max_nonfinite_steps,
      "); no checkpoint was written since; try a lower --lr, --max-grad-norm or "
      "--precision fp32");
}

void Run::finish_alone(const std::map<std::string, double>& run_metrics, int64_t steps,
                       int64_t epoch) {
  MetricRecord record{{"event", std::string("strategy")}};
  for (const auto& [key, value] : run_metrics) record[key] = value;
  if (record.size() > 1) metrics.write(record);
  result.steps = steps;
  report.reached(steps);
  if (validation != nullptr) {
    evaluate_and_record(steps, std::nullopt, true);
    if (options.progress) {
      progress.note(describe_eval_as(*result.validation, options.token_loss));
    }
  }
  if (!options.checkpoint_dir.empty() && nonfinite_steps == 0) save(steps, epoch, true);
}

}  // namespace dtrain::train::runners
