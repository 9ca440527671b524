// Sandblaster's coordinator over the network: the gRPC WorkCoordinator service
// (dtrain/sandblaster.proto) in front of the network-free parallel::ps::WorkQueue. It installs
// itself as the library's WorkQueueHost when the library loads, so Sandblaster's rank 0 serves
// its queue without the parallel layer knowing gRPC's server side.
#pragma once

#include <memory>

#include "dtrain/parallel/ps/WorkQueue.h"

namespace grpc {
class Server;
}

namespace dtrain::services::ps {

class WorkCoordinatorService;

class WorkCoordinatorServer final : public parallel::ps::WorkQueueHost {
 public:
  WorkCoordinatorServer(parallel::ps::WorkQueue& queue,
                        const parallel::ps::WorkCoordinatorOptions& options);
  ~WorkCoordinatorServer() override;
  WorkCoordinatorServer(const WorkCoordinatorServer&) = delete;
  WorkCoordinatorServer& operator=(const WorkCoordinatorServer&) = delete;
  int port() const override { return port_; }
  void shutdown() override;

 private:
  std::unique_ptr<WorkCoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace dtrain::services::ps
