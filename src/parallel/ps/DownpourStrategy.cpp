#include "parallel/ps/DownpourStrategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include <cstdio>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/ps.pb.h"

namespace dtrain::parallel::ps {

namespace {

int64_t newest(const std::vector<int64_t>& versions) {
  return versions.empty() ? 0 : *std::max_element(versions.begin(), versions.end());
}

int64_t oldest(const std::vector<int64_t>& versions) {
  return versions.empty() ? 0 : *std::min_element(versions.begin(), versions.end());
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Lines about lost updates: the first few of each kind, then a note that the rest are counted.
constexpr int64_t kLoggedLosses = 5;
void log_loss(int rank, int64_t count, const std::string& what) {
  if (count > kLoggedLosses) return;
  std::fprintf(stderr, "downpour worker %d: %s%s\n", rank, what.c_str(),
               count == kLoggedLosses ? " (further ones are counted in the metrics)" : "");
}

void check_options(const DownpourOptions& o) {
  DTRAIN_CHECK_INPUT(o.n_fetch >= 1, "--n-fetch must be at least 1 (got ", o.n_fetch, ")");
  DTRAIN_CHECK_INPUT(o.n_push >= 1, "--n-push must be at least 1 (got ", o.n_push, ")");
  DTRAIN_CHECK_INPUT(o.max_staleness >= -1,
                     "--max-staleness must be -1 (no cap) or at least 0 "
                     "(got ",
                     o.max_staleness, ")");
}

void declare_flags(FlagSet& flags, DownpourOptions& o) {
  flags.add("--n-fetch", o.n_fetch,
            "--strategy downpour: fetch fresh parameters every N steps (in the background)");
  flags.add("--n-push", o.n_push,
            "--strategy downpour: push the gradients accumulated over N steps (in the "
            "background)");
  flags.add("--max-staleness", o.max_staleness,
            "--strategy downpour: a worker whose parameters are more than this many server "
            "versions old waits for a fresh pull (-1: no cap)");
}

}  // namespace

StrategyInfo downpour_strategy() {
  StrategyInfo info = replica_strategy(
      "downpour", "Downpour SGD: asynchronous workers against parameter-server shards",
      Loop::kAsynchronous, option_group<DownpourOptions>("downpour", declare_flags, check_options),
      make_from_options<DownpourStrategy>);
  info.server_optimizer = true;  // the shards apply the updates
  info.cost.traffic = StepCost::Traffic::kParameterServer;
  info.cost.parameter_copies = 2;  // the model and the pulls' landing buffer
  info.cost.gradient_copies = 3;   // .grad, the accumulation and the push in flight
  return info;
}

DownpourStrategy::DownpourStrategy(StrategyOptions options)
    : ReplicaStrategy(std::move(options)), downpour_(options_.of<DownpourOptions>()) {
  check_options(downpour_);
}

DownpourStrategy::~DownpourStrategy() {
  try {
    stop();
  } catch (...) {
    // A failed push at teardown was already reported by the step or finish() that saw it.
  }
}

void DownpourStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  setup_replica(std::move(model), make_optimizer, std::move(grid));
  accumulated_ = at::zeros({numel_}, dtype_);
}

std::chrono::milliseconds DownpourStrategy::wait_limit() const {
  return 3 * std::chrono::milliseconds(ps_.rpc_timeout_ms + ps_.retry_ms);
}

void DownpourStrategy::start() {
  // The first worker's parameters (its initialization, or a checkpoint it loaded) become the
  // shards' unless they already hold some (another worker was first, or a restarted shard
  // resumed its own checkpoint); every worker then trains from the shards' values.
  client_->initialize(flat_parameters());
  incoming_ = at::empty({numel_}, dtype_);
  versions_ = client_->pull(incoming_);
  set_parameters(incoming_);
  newest_version_ = newest(versions_);
  started_ = true;
  thread_ = std::thread([this] { background(); });
}

void DownpourStrategy::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DownpourStrategy::background() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] {
      return push_pending_ || (pull_requested_ && !pull_landed_) || stopping_ || error_;
    });
    if (error_) return;
    try {
      if (push_pending_) {  // pushes first: a pull requested after a push includes it
        const at::Tensor gradient = outgoing_;
        const std::vector<int64_t> versions = outgoing_versions_;
        const bool last = outgoing_last_;
        lock.unlock();
        trace::Span span("comm", "ps push");
        const PushResult result = client_->push(gradient, versions, last);
        lock.lock();
        push_pending_ = false;
        ++pushes_done_;
        for (const std::string& why : result.refused) {
          if (why.empty()) continue;
          log_loss(grid_->world()->rank(), ++refused_pushes_,
                   concat(why, "; that update is lost there, training goes on"));
        }
        newest_version_ = std::max(newest_version_, newest(result.versions));
        last_staleness_ = newest(result.staleness);
        last_lr_ = result.lr.empty() ? 0.0 : result.lr[0];
      } else if (pull_requested_ && !pull_landed_) {
        const int64_t covers = pushes_done_;
        pull_requested_ = false;
        lock.unlock();
        trace::Span span("comm", "ps pull");
        const std::vector<int64_t> versions = client_->pull(incoming_);
        lock.lock();
        incoming_versions_ = versions;
        incoming_covers_ = covers;
        pull_landed_ = true;
        newest_version_ = std::max(newest_version_, newest(versions));
      } else if (stopping_) {
        return;
      }
    } catch (...) {
      if (!lock.owns_lock()) lock.lock();
      error_ = std::current_exception();
    }
    changed_.notify_all();
  }
}

void DownpourStrategy::rethrow_background_error() {
  if (error_) std::rethrow_exception(error_);
}

bool DownpourStrategy::apply_landed_pull(std::unique_lock<std::mutex>& lock) {
  (void)lock;
  if (!pull_landed_) return false;
  set_parameters(incoming_);
  versions_ = incoming_versions_;
  pushes_reflected_ = incoming_covers_;
  pull_landed_ = false;
  changed_.notify_all();
  return true;
}

void DownpourStrategy::pull_now(std::unique_lock<std::mutex>& lock, const char* why) {
  // Bounded: each round is at most a push and a pull, each within its deadline and retries.
  const auto limit = wait_limit();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const int64_t wanted = pushes_issued_;
  while (true) {
    if (apply_landed_pull(lock) && pushes_reflected_ >= wanted) return;
    pull_requested_ = true;
    changed_.notify_all();
    const bool landed = changed_.wait_until(lock, deadline, [&] { return pull_landed_ || error_; });
    rethrow_background_error();
    DTRAIN_CHECK_T(TimeoutError, landed, "downpour worker ", grid_->world()->rank(),
                   ": a pull for ", why, " did not land within ", limit.count(), " ms");
  }
}

void DownpourStrategy::queue_push(std::unique_lock<std::mutex>& lock, bool last) {
  // One push in flight at a time: the next waits for the previous (bounded by its deadline).
  const auto limit = wait_limit();
  const bool free = changed_.wait_for(lock, limit, [&] { return !push_pending_ || error_; });
  rethrow_background_error();
  DTRAIN_CHECK_T(TimeoutError, free, "downpour worker ", grid_->world()->rank(),
                 ": the previous push did not finish within ", limit.count(), " ms");
  std::swap(outgoing_, accumulated_);
  if (!accumulated_.defined()) accumulated_ = at::empty({numel_}, dtype_);
  accumulated_.zero_();
  outgoing_versions_ = accumulated_versions_;
  outgoing_last_ = last;
  push_pending_ = true;
  ++pushes_issued_;
  steps_accumulated_ = 0;
  changed_.notify_all();
}

StepResult DownpourStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                        const LossFn& loss) {
  if (!started_) start();
  StepResult result;
  std::unique_lock<std::mutex> lock(mutex_);
  rethrow_background_error();
  apply_landed_pull(lock);
  double wait_ms = 0.0;
  if (downpour_.max_staleness >= 0) {
    // How far behind the shards the model is: the newest version seen, or at least this
    // worker's own pushes not yet in its parameters.
    const int64_t mine = oldest(versions_);
    const int64_t server = std::max(newest_version_, mine + (pushes_issued_ - pushes_reflected_));
    if (server - mine > downpour_.max_staleness) {
      const auto wait_start = std::chrono::steady_clock::now();
      pull_now(lock, "--max-staleness");
      wait_ms = ms_since(wait_start);
    }
  }
  const std::vector<int64_t> computed_on = versions_;
  lock.unlock();

  const auto compute_start = std::chrono::steady_clock::now();
  for (auto& p : parameters_) p.mutable_grad() = at::Tensor();
  const auto count = static_cast<double>(micro_batches.size());
  for (const auto& batch : micro_batches) {
    trace::Span span("compute", "forward+backward");
    at::Tensor l = loss(model_(batch.inputs), batch.targets);
    result.loss += l.item<double>() / count;
    result.samples += batch.inputs.size(0);
    (l / count).backward();
  }
  if (options_.max_grad_norm > 0) {
    result.grad_norm = torch::nn::utils::clip_grad_norm_(parameters_, options_.max_grad_norm);
  }
  // A gradient holding NaN or Inf would poison the shared model for every worker (the shards
  // refuse it too): this step's is left out, said and counted.
  std::string nonfinite;
  {
    int64_t offset = 0;
    for (const auto& p : parameters_) {
      if (p.grad().defined() && nonfinite.empty())
        nonfinite = check_finite(p.grad().reshape({-1}), offset);
      offset += p.numel();
    }
  }
  if (!nonfinite.empty()) {
    log_loss(grid_->world()->rank(), ++skipped_steps_,
             concat("step ", steps_done_ + 1, "'s ", nonfinite, "; its update is skipped"));
  } else {
    torch::NoGradGuard no_grad;
    int64_t offset = 0;
    for (const auto& p : parameters_) {
      if (p.grad().defined()) {
        accumulated_.slice(0, offset, offset + p.numel()).add_(p.grad().reshape({-1}));
      }
      offset += p.numel();
    }
  }
  if (nonfinite.empty() && steps_accumulated_++ == 0) accumulated_versions_ = computed_on;
  step_seconds_ +=
      (ms_since(compute_start) / 1e3 - step_seconds_) / static_cast<double>(++steps_done_);
  ++steps_since_fetch_;

  lock.lock();
  if (steps_accumulated_ >= downpour_.n_push) {
    const auto wait_start = std::chrono::steady_clock::now();
    queue_push(lock);
    wait_ms += ms_since(wait_start);
  }
  if (steps_since_fetch_ >= downpour_.n_fetch) {
    pull_requested_ = true;
    steps_since_fetch_ = 0;
  }
  changed_.notify_all();
  result.metrics["ps_version"] = static_cast<double>(newest_version_);
  result.metrics["staleness"] = static_cast<double>(last_staleness_);
  result.metrics["param_age"] = static_cast<double>(newest_version_ - oldest(computed_on));
  result.metrics["ps_wait_ms"] = wait_ms;
  result.metrics["ps_lr"] = last_lr_;
  result.metrics["ps_lost_updates"] = static_cast<double>(client_->lost_updates());
  result.metrics["ps_skipped_steps"] = static_cast<double>(skipped_steps_);
  result.metrics["ps_refused_pushes"] = static_cast<double>(refused_pushes_);
  return result;
}

int64_t DownpourStrategy::global_steps() const {
  // The shards' count, plus this worker's steps they have not counted yet (pushes in flight,
  // the accumulation): the worker's own steps are never missed, others' may be late.
  std::lock_guard<std::mutex> lock(mutex_);
  return (newest_version_ + pushes_issued_ - pushes_done_) * downpour_.n_push + steps_accumulated_;
}

void DownpourStrategy::finish() {
  if (!started_) return;
  std::unique_lock<std::mutex> lock(mutex_);
  rethrow_background_error();
  // The last, partial accumulation, marked as this worker's final push so that rank 0 knows
  // it is done (with nothing to push, a Done call says so once the pushes are in).
  const bool pending = steps_accumulated_ > 0;
  if (pending) queue_push(lock, true);
  pull_now(lock, "the end of training");
  if (!pending) {
    lock.unlock();
    client_->done();
  }
}

std::string DownpourStrategy::await_workers() {
  if (!started_) return "";
  // A worker is done when its final push has reached every shard. One that has pushed nothing
  // for a while is taken for gone (killed, its machine lost): waiting for it ends after
  // max(2 s, 20 steps' compute) of quiet, at most the RPC deadline.
  const double quiet_s =
      std::min(std::max(2.0, 20.0 * step_seconds_ * downpour_.n_push), ps_.rpc_timeout_ms / 1e3);
  const auto deadline = std::chrono::steady_clock::now() + wait_limit();
  std::string missing;
  while (true) {
    std::map<int, std::pair<int, double>> seen;  // worker -> (shards it finished on, quiet s)
    const auto infos = client_->describe();
    for (const auto& info : infos) {
      for (const auto& w : info.workers()) {
        if (w.pushes() == 0 && !w.finished()) continue;  // only refused pushes: never took part
        auto& entry = seen[w.worker()];
        entry.first += w.finished() ? 1 : 0;
        entry.second = std::max(entry.second, w.last_push_age_s());
      }
    }
    bool waiting = false;
    missing.clear();
    for (const auto& [worker, entry] : seen) {
      if (entry.first == client_->shards()) continue;
      if (entry.second < quiet_s) {
        waiting = true;
      } else {
        missing += concat(missing.empty() ? "" : ", ", worker, " (quiet for ",
                          static_cast<int>(entry.second), " s)");
      }
    }
    if (!waiting || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::unique_lock<std::mutex> lock(mutex_);
  rethrow_background_error();
  pull_now(lock, "the final model");
  if (missing.empty()) return "";
  return concat("downpour: worker(s) ", missing,
                " stopped pushing without finishing (gone?); the "
                "final model holds every update the shards received");
}

std::map<std::string, double> DownpourStrategy::run_metrics() {
  std::map<std::string, double> m;
  if (!started_) return m;
  const auto infos = client_->describe();
  std::vector<int64_t> histogram;
  std::map<int, int64_t> pushes;
  for (size_t i = 0; i < infos.size(); ++i) {
    const auto& info = infos[i];
    const double up = std::max(info.uptime_s(), 1e-9);
    const std::string shard = concat("shard", i, "_");
    m[shard + "pushes_per_s"] = info.pushes() / up;
    m[shard + "pulls_per_s"] = info.pulls() / up;
    m[shard + "mb_in_per_s"] = info.bytes_in() / up / 1e6;
    m[shard + "mb_out_per_s"] = info.bytes_out() / up / 1e6;
    m[shard + "version"] = static_cast<double>(info.version());
    if (histogram.empty()) histogram.assign(info.staleness_histogram_size(), 0);
    for (int b = 0; b < info.staleness_histogram_size() && b < static_cast<int>(histogram.size());
         ++b) {
      histogram[b] += info.staleness_histogram(b);
    }
    if (i == 0) {
      for (const auto& w : info.workers()) pushes[w.worker()] = w.pushes();
    }
  }
  // Staleness per push, over all shards' counts (each push counts once per shard).
  for (size_t b = 0; b < histogram.size(); ++b) {
    if (histogram[b] == 0) continue;
    const bool rest = b + 1 == histogram.size();
    m[concat("staleness_", b, rest ? "_or_more" : "")] =
        static_cast<double>(histogram[b]) / static_cast<double>(infos.size());
  }
  for (const auto& [worker, count] : pushes) {
    m[concat("worker", worker, "_pushes")] = static_cast<double>(count);
  }
  m["lost_updates"] = static_cast<double>(client_->lost_updates());
  int64_t refused = 0;
  for (const auto& info : infos) refused += info.refused_pushes();
  m["refused_pushes"] = static_cast<double>(refused);
  return m;
}

void DownpourStrategy::save(const std::string& directory) {
  if (started_) {
    std::unique_lock<std::mutex> lock(mutex_);
    rethrow_background_error();
    pull_now(lock, "a checkpoint");
  }
  write_replica(directory);
}

MemoryReport DownpourStrategy::memory_report() const {
  MemoryReport report;
  const auto item = static_cast<int64_t>(c10::elementSize(dtype_));
  report.parameter_bytes = numel_ * item * 2;  // the model and the landing buffer of pulls
  report.gradient_bytes = numel_ * item * 3;   // .grad, the accumulation and the push in flight
  report.optimizer_bytes = 0;                  // on the shards
  return report;
}

}  // namespace dtrain::parallel::ps
