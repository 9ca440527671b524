#include "parallel/ps/SandblasterStrategy.h"

#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/rpc/Security.h"
#include "common/Straggler.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/ps/Sandblaster.h"
#include "dtrain/sandblaster.grpc.pb.h"

namespace dtrain::parallel::ps {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool loopback(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

void check_options(const SandblasterOptions& o) {
  DTRAIN_CHECK_INPUT(o.work_units >= 0 && o.work_units <= (1 << 20),
                     "--work-units must be 0 (10 per worker) to 1048576, got ", o.work_units);
  DTRAIN_CHECK_INPUT(o.history >= 1 && o.history <= 100,
                     "--lbfgs-history must be 1 to 100 pairs, got ", o.history);
  DTRAIN_CHECK_INPUT(o.unit_sizing == "tapered" || o.unit_sizing == "uniform",
                     "--work-unit-sizing '", o.unit_sizing, "': tapered or uniform");
}

void declare_flags(FlagSet& flags, SandblasterOptions& o) {
  flags.add("--work-units", o.work_units,
            "--strategy sandblaster: work units each evaluation of the loss is cut into, handed "
            "out to workers as they ask (0: 10 per worker)");
  flags.add_negated("--no-backup-tasks", o.backup_tasks,
                    "--strategy sandblaster: no backup copies of the units still running near an "
                    "evaluation's end (a straggler then sets the pace)");
  flags.add("--work-unit-sizing", o.unit_sizing,
            "--strategy sandblaster: tapered (the last 2 x workers units a half and a quarter of "
            "the others' size: an evaluation ends on small units) or uniform");
  flags.add("--lbfgs-history", o.history,
            "--strategy sandblaster: L-BFGS history pairs (kept on the shards)");
}

}  // namespace

StrategyInfo sandblaster_strategy() {
  return replica_strategy(
      "sandblaster", "Sandblaster L-BFGS: a coordinator hands out work units over the shards",
      Loop::kDriven, option_group<SandblasterOptions>("sandblaster", declare_flags, check_options),
      make_from_options<SandblasterStrategy>);
}

SandblasterStrategy::SandblasterStrategy(StrategyOptions options)
    : ReplicaStrategy(std::move(options)), sb_(options_.of<SandblasterOptions>()) {
  check_options(sb_);
}

SandblasterStrategy::~SandblasterStrategy() = default;

void SandblasterStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                                std::shared_ptr<comm::ProcessGrid> grid) {
  setup_replica(std::move(model), make_optimizer, std::move(grid));
  rank_ = grid_->world()->rank();
  workers_ = grid_->world()->size();
  units_ = sb_.work_units > 0 ? sb_.work_units : 10 * int64_t{workers_};
  // Rank 0 hosts the coordinator; the others learn its address (one collective, at the start).
  std::string address;
  if (rank_ == 0) {
    const char* master = std::getenv("MASTER_ADDR");
    const std::string host = master != nullptr ? master : "";
    const bool local = workers_ == 1 || loopback(host);
    WorkQueueOptions queue;
    queue.backup_tasks = sb_.backup_tasks;
    queue.tapered_units = sb_.unit_sizing == "tapered";
    queue.workers = workers_;
    queue_ = std::make_unique<WorkQueue>(queue);
    WorkCoordinatorOptions server;
    server.listen = local ? "127.0.0.1:0" : "0.0.0.0:0";
    server.auth_token = ps_.auth_token;
    server_ = host_work_queue(*queue_, server);
    address = concat(local ? std::string("127.0.0.1") : host, ":", server_->port());
  }
  coordinator_address_ = comm::allgather_strings(*grid_->world(), address)[0];
}

std::string SandblasterStrategy::layout() const {
  return concat("sandblaster: L-BFGS (history ", sb_.history, ") over ", ps_.addresses.size(),
                " parameter-server shard", ps_.addresses.size() == 1 ? "" : "s", ", ", workers_,
                " worker", workers_ == 1 ? "" : "s", ", ", units_,
                " work units per evaluation, backup tasks ", sb_.backup_tasks ? "on" : "off",
                "; coordinator at ", coordinator_address_);
}

StepResult SandblasterStrategy::train_step(const std::vector<data::Batch>&, const LossFn&) {
  DTRAIN_THROW(Error,
               "--strategy sandblaster runs its own loop (work units handed out by its "
               "coordinator), not the Trainer's steps");
}

void SandblasterStrategy::pull_into_model() {
  at::Tensor flat = at::empty({numel_}, dtype_);
  client_->pull(flat);
  set_parameters(flat);
}

double SandblasterStrategy::compute_unit(const LoopContext& context, int64_t round, int64_t unit,
                                         int64_t begin, int64_t end) {
  std::lock_guard<std::recursive_mutex> lock(model_mutex_);
  if (model_round_ != round) {  // the parameters of this evaluation, once per round
    pull_into_model();
    model_round_ = round;
  }
  // Evaluation mode: the objective L-BFGS minimizes must be a deterministic function of the
  // parameters (no dropout draws).
  model_.module->eval();
  for (auto& p : parameters_) p.mutable_grad() = at::Tensor();
  const data::TensorDataset& train = *context.train;
  const int64_t n = train.size();
  double loss = 0.0;
  for (int64_t b = begin; b < end; b += context.chunk) {
    const int64_t e = std::min(end, b + context.chunk);
    const data::Batch batch = train.slice(b, e);
    // The unit's share of the mean loss over the whole training set.
    at::Tensor share = context.loss(model_(batch.inputs), batch.targets) *
                       (static_cast<double>(e - b) / static_cast<double>(n));
    share.backward();
    loss += share.item<double>();
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters_) {
    grads.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, dtype_));
  }
  pushes_ignored_ += client_->accumulate(at::cat(grads), "g", round, unit);
  return loss;
}

void SandblasterStrategy::work(const LoopContext& context) {
  comm::rpc::RpcSecurity security;  // the coordinator serves plaintext (with the shards' token)
  auto stub = dtrain::sandblaster::WorkCoordinator::NewStub(
      grpc::CreateChannel(coordinator_address_, comm::rpc::channel_credentials(security)));
  const auto rpc_timeout = std::chrono::milliseconds(ps_.rpc_timeout_ms);
  constexpr int64_t kWaitMs = 1000;
  auto call = [&](const char* name, const std::function<grpc::Status(grpc::ClientContext&)>& f) {
    // Unreachable (restarting, or not listening yet) is retried with back-off in the window.
    const auto give_up = Clock::now() + std::chrono::milliseconds(ps_.retry_ms);
    auto pause = std::chrono::milliseconds(50);
    while (true) {
      grpc::ClientContext rpc;
      comm::rpc::add_token(rpc, ps_.auth_token);
      rpc.set_deadline(std::chrono::system_clock::now() + rpc_timeout +
                       std::chrono::milliseconds(kWaitMs));
      const grpc::Status status = f(rpc);
      if (status.ok()) return;
      const bool retry =
          status.error_code() == grpc::StatusCode::UNAVAILABLE && Clock::now() + pause < give_up;
      if (!retry) {
        DTRAIN_THROW(CommError, "Sandblaster worker ", rank_, ": ", name, " to the coordinator at ",
                     coordinator_address_, " failed: ", status.error_message(), " (",
                     static_cast<int>(status.error_code()), ")");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(2000));
    }
  };
  while (true) {
    dtrain::sandblaster::WorkRequest request;
    request.set_worker(rank_);
    request.set_examples(context.train->size());
    request.set_wait_ms(kWaitMs);
    dtrain::sandblaster::WorkReply reply;
    call("GetWork", [&](grpc::ClientContext& rpc) { return stub->GetWork(&rpc, request, &reply); });
    if (reply.kind() == dtrain::sandblaster::WorkReply::DONE) {
      DTRAIN_CHECK(reply.reason().empty() || rank_ == 0, "Sandblaster worker ", rank_,
                   ": the coordinator stopped the run: ", reply.reason());
      return;
    }
    if (reply.kind() != dtrain::sandblaster::WorkReply::UNIT) continue;
    DTRAIN_CHECK(reply.units() >= 1 && reply.unit() >= 0 && reply.unit() < reply.units() &&
                     reply.begin() >= 0 && reply.begin() < reply.end() &&
                     reply.end() <= context.train->size(),
                 "Sandblaster worker ", rank_, ": the coordinator sent unit ", reply.unit(), " of ",
                 reply.units(), " over examples [", reply.begin(), ", ", reply.end(), ") of ",
                 context.train->size());
    const auto start = Clock::now();
    const double loss =
        compute_unit(context, reply.round(), reply.unit(), reply.begin(), reply.end());
    if (context.slowdown > 1.0) {
      straggle((context.slowdown - 1.0) * seconds_since(start), context.slowdown_spin);
    }
    if (context.on_work) context.on_work(units_done_ + 1);
    dtrain::sandblaster::UnitResult result;
    result.set_worker(rank_);
    result.set_round(reply.round());
    result.set_unit(reply.unit());
    result.set_loss(loss);
    result.set_seconds(seconds_since(start));
    dtrain::sandblaster::FinishReply finished;
    call("Finish", [&](grpc::ClientContext& rpc) { return stub->Finish(&rpc, result, &finished); });
    ++units_done_;
  }
}

void SandblasterStrategy::coordinate(const LoopContext& context) {
  LbfgsOptions options;
  options.history = sb_.history;
  options.max_iterations = static_cast<int>(std::max<int64_t>(1, context.max_iterations));
  options.weight_decay = context.weight_decay;
  LbfgsCoordinator lbfgs(*client_, options);
  const auto stall = std::chrono::milliseconds(context.stall_ms);
  const auto start = Clock::now();
  auto last = Clock::now();
  double callbacks = 0;
  int64_t last_evaluations = 0;
  const LbfgsResult result = lbfgs.run(
      [&](int64_t round) {
        queue_->open(round, units_);
        return queue_->wait_round(stall);
      },
      [&](const LbfgsResult& r) {
        IterationReport report;
        report.iteration = r.iterations;
        report.loss = r.loss;
        report.grad_norm = r.grad_norm;
        report.seconds = seconds_since(last);
        report.evaluations = r.evaluations - last_evaluations;
        last_evaluations = r.evaluations;
        const WorkStats stats = queue_->stats();
        report.metrics["evaluations"] = static_cast<double>(r.evaluations);
        report.metrics["units_issued"] = static_cast<double>(stats.issued);
        report.metrics["backups_issued"] = static_cast<double>(stats.backups);
        report.metrics["backups_won"] = static_cast<double>(stats.backups_won);
        report.metrics["units_reissued"] = static_cast<double>(stats.reissued);
        iterations_ = r.iterations;
        if (context.on_iteration) {
          const auto callback_start = Clock::now();
          std::lock_guard<std::recursive_mutex> lock(model_mutex_);
          pull_into_model();
          model_round_ = 0;
          context.on_iteration(report);
          callbacks += seconds_since(callback_start);
        }
        last = Clock::now();
      });
  iterations_ = result.iterations;
  evaluations_ = result.evaluations;
  stop_reason_ = result.stop_reason;
  const double busy = seconds_since(start) - callbacks;
  seconds_per_iteration_ = busy / std::max(1, result.iterations);
  seconds_per_evaluation_ = busy / std::max(1, result.evaluations);
}

int64_t SandblasterStrategy::run_loop(const LoopContext& context) {
  DTRAIN_CHECK(context.train != nullptr && context.train->size() >= units_, "Sandblaster: ", units_,
               " work units need at least as many training examples (the set has ",
               context.train ? context.train->size() : 0, ")");
  // The first worker's parameters (its initialization or a loaded checkpoint) become the
  // shards' unless they hold some already.
  client_->initialize(flat_parameters());
  std::exception_ptr coordinator_error;
  std::thread coordinator;
  if (rank_ == 0) {
    coordinator = std::thread([&] {
      try {
        coordinate(context);
        queue_->close();
      } catch (const std::exception& e) {
        coordinator_error = std::current_exception();
        queue_->close(e.what());
      }
    });
  }
  std::exception_ptr worker_error;
  try {
    work(context);
  } catch (...) {
    worker_error = std::current_exception();
    if (rank_ == 0) queue_->close("rank 0's worker failed");
  }
  if (rank_ != 0) {
    if (worker_error) std::rethrow_exception(worker_error);
    return iterations_;
  }
  coordinator.join();
  if (coordinator_error) std::rethrow_exception(coordinator_error);
  if (worker_error) std::rethrow_exception(worker_error);
  // The other workers are told the run is over when they next ask; wait (bounded) for that so
  // none of them finds the coordinator gone.
  const auto limit = Clock::now() + std::chrono::seconds(10);
  while (!queue_->workers_not_told_done().empty() && Clock::now() < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const std::vector<int> silent = queue_->workers_not_told_done();
  if (!silent.empty()) {
    std::string who;
    for (int w : silent) who += concat(who.empty() ? "" : ", ", w);
    std::fprintf(stderr,
                 "sandblaster: worker%s %s did not come back for work before the end "
                 "(died or still computing a unit)\n",
                 silent.size() == 1 ? "" : "s", who.c_str());
  }
  server_->shutdown();
  std::printf("sandblaster: L-BFGS stopped after %lld iterations (%lld evaluations): %s\n",
              static_cast<long long>(iterations_), static_cast<long long>(evaluations_),
              stop_reason_.c_str());
  std::fflush(stdout);
  std::lock_guard<std::recursive_mutex> lock(model_mutex_);
  pull_into_model();
  model_round_ = 0;
  return iterations_;
}

std::map<std::string, double> SandblasterStrategy::run_metrics() {
  std::map<std::string, double> m;
  m["iterations"] = static_cast<double>(iterations_);
  m["evaluations"] = static_cast<double>(evaluations_);
  m["seconds_per_iteration"] = seconds_per_iteration_;
  m["seconds_per_evaluation"] = seconds_per_evaluation_;
  m["work_units"] = static_cast<double>(units_);
  if (queue_) {
    const WorkStats stats = queue_->stats();
    m["units_issued"] = static_cast<double>(stats.issued);
    m["backups_issued"] = static_cast<double>(stats.backups);
    m["backups_won"] = static_cast<double>(stats.backups_won);
    m["units_reissued"] = static_cast<double>(stats.reissued);
    m["late_reports"] = static_cast<double>(stats.late_reports);
    for (const auto& [worker, units] : stats.units_by_worker) {
      m[concat("worker", worker, "_units")] = static_cast<double>(units);
    }
  }
  m["rank0_pushes_ignored"] = static_cast<double>(pushes_ignored_);
  return m;
}

void SandblasterStrategy::save(const std::string& directory) {
  std::lock_guard<std::recursive_mutex> lock(model_mutex_);
  pull_into_model();
  model_round_ = 0;
  write_replica(directory);
}

MemoryReport SandblasterStrategy::memory_report() const {
  MemoryReport report;
  const auto item = static_cast<int64_t>(c10::elementSize(dtype_));
  report.parameter_bytes = numel_ * item * 2;  // the model and the pulled copy
  report.gradient_bytes = numel_ * item * 2;   // .grad and the flat push
  report.optimizer_bytes = 0;                  // the L-BFGS history lives on the shards
  return report;
}

}  // namespace dtrain::parallel::ps
