// A parameter-server shard as a gRPC service (dtrain/ps.proto): `dtrain ps serve` runs one, and
// tests start them in-process. Every request is checked before it touches the shard: a
// malformed one (or a gradient holding NaN or Inf) gets INVALID_ARGUMENT naming the field (the
// worker and first bad element) and changes nothing, counted per worker in Describe; with a
// token, a call without it gets UNAUTHENTICATED. With a checkpoint directory the shard saves its
// slice and optimizer state every interval (atomically) and at shutdown, and resumes from it when
// started again.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dtrain/services/ps/ParameterShard.h"

namespace grpc {
class Server;
}

namespace dtrain::services::ps {

struct ShardServerOptions {
  /// host:port to listen on (port 0: any free port, see ShardServer::port()).
  std::string listen = "127.0.0.1:0";
  int shard = 0;
  int shards = 1;
  ShardOptimizer optimizer;
  /// "" = no checkpoints. The file is DIR/shard-I-of-N.pt.
  std::string checkpoint_dir;
  /// Seconds between checkpoints (only when the version moved).
  double checkpoint_interval_s = 30;
  /// Token every call must carry ("" = none); TLS certificate and key ("" = plaintext).
  std::string auth_token;
  std::string tls_cert, tls_key;
  /// Worker ids run from 0 to max_workers - 1 (a bound on what the shard records per worker).
  int max_workers = 65536;
};

/// DIR/shard-I-of-N.pt.
std::string shard_checkpoint_file(const std::string& dir, int shard, int shards);

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
  /// The version resumed from the checkpoint at start (-1: started empty).
  int64_t resumed_version() const { return resumed_version_; }
  /// Saves the checkpoint now (if there is a directory and parameters); returns its version.
  int64_t save_checkpoint();
  /// Stops accepting calls, ends those in flight and saves a last checkpoint.
  void shutdown();
  /// Blocks until shutdown().
  void wait();

 private:
  ShardServerOptions options_;
  std::unique_ptr<ShardService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  int64_t resumed_version_ = -1;
  std::mutex save_mutex_;  // one save at a time
  int64_t saved_version_ = -1;
  std::mutex saver_mutex_;
  std::condition_variable saver_wake_;
  bool stopping_ = false;
  std::thread saver_;
};

}  // namespace dtrain::services::ps
