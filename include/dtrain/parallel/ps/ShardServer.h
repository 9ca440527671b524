// A parameter-server shard as a gRPC service (dtrain/ps.proto): `dtrain ps serve` runs one, and
// tests start them in-process. Every request is checked before it touches the shard: a
// malformed one gets INVALID_ARGUMENT naming the field and changes nothing.
#pragma once

#include <memory>
#include <string>

#include "dtrain/parallel/ps/ParameterShard.h"

namespace grpc {
class Server;
}

namespace dtrain::parallel::ps {

struct ShardServerOptions {
  /// host:port to listen on (port 0: any free port, see ShardServer::port()).
  std::string listen = "127.0.0.1:0";
  int shard = 0;
  int shards = 1;
  ShardOptimizer optimizer;
};

class ShardService;

class ShardServer {
 public:
  /// Starts serving (InputError if the address cannot be bound).
  explicit ShardServer(const ShardServerOptions& options);
  ~ShardServer();
  ShardServer(const ShardServer&) = delete;
  ShardServer& operator=(const ShardServer&) = delete;

  /// The bound port.
  int port() const { return port_; }
  /// "host:port" clients can dial.
  std::string address() const;
  const ParameterShard& shard() const;
  /// Stops accepting calls and ends those in flight.
  void shutdown();
  /// Blocks until shutdown().
  void wait();

 private:
  ShardServerOptions options_;
  std::unique_ptr<ShardService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace dtrain::parallel::ps
