#include "dtrain/services/ps/WorkCoordinator.h"

#include <grpcpp/grpcpp.h>

#include <cmath>

#include "comm/rpc/Security.h"
#include "dtrain/common/Error.h"
#include "dtrain/sandblaster.grpc.pb.h"

namespace dtrain::services::ps {

// The gRPC face of the queue: requests are checked before they reach it.
class WorkCoordinatorService final : public dtrain::sandblaster::WorkCoordinator::Service {
 public:
  WorkCoordinatorService(parallel::ps::WorkQueue& queue, std::string token)
      : queue_(queue), token_(std::move(token)) {}

  grpc::Status GetWork(grpc::ServerContext* context,
                       const dtrain::sandblaster::WorkRequest* request,
                       dtrain::sandblaster::WorkReply* reply) override {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (request->worker() < 0)
      return invalid(concat("GetWork: field 'worker' is ", request->worker()));
    if (request->examples() <= 0) {
      return invalid(
          concat("GetWork: field 'examples' is ", request->examples(), " (must be > 0)"));
    }
    if (request->wait_ms() < 0 || request->wait_ms() > 5000) {
      return invalid(concat("GetWork: field 'wait_ms' is ", request->wait_ms(), " (0 to 5000)"));
    }
    if (std::string why = queue_.check_examples(request->worker(), request->examples());
        !why.empty()) {
      return {grpc::StatusCode::FAILED_PRECONDITION, "GetWork: " + why};
    }
    const parallel::ps::Assignment a =
        queue_.next(request->worker(), std::chrono::milliseconds(request->wait_ms()));
    reply->set_kind(a.kind == parallel::ps::Assignment::Unit ? dtrain::sandblaster::WorkReply::UNIT
                    : a.kind == parallel::ps::Assignment::Done
                        ? dtrain::sandblaster::WorkReply::DONE
                        : dtrain::sandblaster::WorkReply::WAIT);
    reply->set_round(a.round);
    reply->set_unit(a.unit);
    reply->set_units(a.units);
    reply->set_backup(a.backup);
    reply->set_begin(a.begin);
    reply->set_end(a.end);
    reply->set_reason(a.reason);
    return grpc::Status::OK;
  }

  grpc::Status Finish(grpc::ServerContext* context, const dtrain::sandblaster::UnitResult* request,
                      dtrain::sandblaster::FinishReply* reply) override {
    if (auto denied = comm::rpc::check_token(*context, token_); !denied.ok()) return denied;
    if (request->worker() < 0)
      return invalid(concat("Finish: field 'worker' is ", request->worker()));
    if (request->round() < 1) return invalid(concat("Finish: field 'round' is ", request->round()));
    if (request->unit() < 0 || request->unit() >= kMaxUnitsPerRound) {
      return invalid(concat("Finish: field 'unit' is ", request->unit()));
    }
    if (!std::isfinite(request->loss())) return invalid("Finish: field 'loss' is not finite");
    if (!(request->seconds() >= 0) || !std::isfinite(request->seconds())) {
      return invalid(concat("Finish: field 'seconds' is ", request->seconds()));
    }
    reply->set_counted(queue_.finish(request->worker(), request->round(), request->unit(),
                                     request->loss(), request->seconds()));
    return grpc::Status::OK;
  }

 private:
  static constexpr int64_t kMaxUnitsPerRound = int64_t{1} << 20;
  static grpc::Status invalid(const std::string& why) {
    return {grpc::StatusCode::INVALID_ARGUMENT, why};
  }
  parallel::ps::WorkQueue& queue_;
  std::string token_;
};

WorkCoordinatorServer::WorkCoordinatorServer(parallel::ps::WorkQueue& queue,
                                             const parallel::ps::WorkCoordinatorOptions& options)
    : service_(std::make_unique<WorkCoordinatorService>(queue, options.auth_token)) {
  server_ = comm::rpc::start_server("the Sandblaster coordinator", options.listen, options.tls_cert,
                                    options.tls_key, service_.get(), false, &port_);
}

WorkCoordinatorServer::~WorkCoordinatorServer() { shutdown(); }

void WorkCoordinatorServer::shutdown() {
  if (server_ && !stopped_)
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  stopped_ = true;
}

namespace {
// The library's work-queue host from the moment it loads.
const bool work_coordinator_installed = [] {
  parallel::ps::set_work_queue_host(
      [](parallel::ps::WorkQueue& queue, const parallel::ps::WorkCoordinatorOptions& options) {
        return std::unique_ptr<parallel::ps::WorkQueueHost>(
            std::make_unique<WorkCoordinatorServer>(queue, options));
      });
  return true;
}();
}  // namespace

}  // namespace dtrain::services::ps
