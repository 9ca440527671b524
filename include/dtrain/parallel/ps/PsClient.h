// A worker's connection to all parameter-server shards: learns each shard's range, initializes
// them (the first worker's parameters win), and pulls or pushes the whole flat parameter vector
// as one call per shard, the shards in parallel. Every RPC has a deadline; a shard that cannot
// be reached is retried with back-off for a while (it may be restarting), and a shard that
// restarted from its checkpoint is noticed and the updates it lost are reported; a shard that
// fails otherwise, never answers or stays away is an error naming its address and the RPC.
#pragma once

#include <ATen/core/Tensor.h>

#include "dtrain/parallel/ps/ShardProtocol.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain::ps {
class ShardInfo;
}
namespace grpc {
class ClientContext;
class Status;
}  // namespace grpc

namespace dtrain::parallel::ps {

struct PsClientOptions {
  /// Deadline of every RPC.
  std::chrono::milliseconds rpc_timeout{30000};
  /// Largest chunk of a streamed tensor, in bytes.
  int64_t chunk_bytes = int64_t{1} << 20;
  /// Who this worker is (metrics, errors).
  int worker = 0;
  /// How long a shard that cannot be reached (connection refused: restarting?) is retried,
  /// with back-off from 50 ms to 2 s, before it is an error.
  std::chrono::milliseconds retry_window{60000};
  /// Token for every call ("" = none), and TLS: connect with TLS, trusting `tls_ca` ("" = the
  /// system's roots).
  std::string auth_token;
  bool tls = false;
  std::string tls_ca;
};

/// A shard that restarted: it resumed its checkpoint at `resumed_version`, but this worker had
/// seen it at `seen_version`, so at least `lost` updates are gone.
struct ShardRestart {
  std::string address;
  int shard = 0;
  int64_t resumed_version = 0;
  int64_t seen_version = 0;
  int64_t lost = 0;
};

struct PushResult {
  /// Per shard: its version after the update, and the update's staleness there.
  std::vector<int64_t> versions;
  std::vector<int64_t> staleness;
  /// The learning rate each shard applied.
  std::vector<double> lr;
  /// Per shard: "" when it applied the update, else why it refused it for a gradient holding
  /// NaN or Inf (the shard changed nothing; its version and staleness above are 0). Every other
  /// refusal throws.
  std::vector<std::string> refused;
  bool any_refused() const;
};

class PsClient {
 public:
  /// `addresses`: one "host:port" per shard, in shard order (checked against what each says).
  PsClient(std::vector<std::string> addresses, PsClientOptions options = {});
  ~PsClient();

  int shards() const { return static_cast<int>(addresses_.size()); }
  /// Sets every uninitialized shard to its range of `flat` (float32 or float64: the dtype of
  /// every later pull and push; InputError if shards initialized before hold another). Returns
  /// true when this call initialized all of them, false if some already were (pull to get their
  /// values).
  bool initialize(const at::Tensor& flat);
  /// Fills `flat` (the shards' dtype, the model's size) from all shards; returns each shard's
  /// version.
  std::vector<int64_t> pull(const at::Tensor& flat);
  /// Pushes `gradient` (the shards' dtype, the model's size), each shard's range computed at
  /// `versions`
  /// (`last`: this worker's final push).
  PushResult push(const at::Tensor& gradient, const std::vector<int64_t>& versions,
                  bool last = false);
  /// Adds `gradient` (the shards' dtype, the model's size) into the named vector on every shard;
  /// keyed by a work unit (`round` > 0, see ParameterShard::accumulate), returns the shards that
  /// ignored it (another copy of the unit was first there, or the round is over).
  int accumulate(const at::Tensor& gradient, const std::string& vector, int64_t round = 0,
                 int64_t unit = 0);
  /// Runs vector commands on every shard (in parallel); returns each Dot summed over shards.
  std::vector<double> vector_ops(const std::vector<VectorOp>& ops);
  /// Tells every shard this worker has stopped (when its last push carried no gradient).
  void done();
  /// Every shard's description now (traffic, staleness histogram, workers).
  std::vector<dtrain::ps::ShardInfo> describe();
  const std::vector<std::string>& addresses() const { return addresses_; }
  /// Called (from the calling thread) when a shard is found to have restarted.
  void on_restart(std::function<void(const ShardRestart&)> callback) {
    on_restart_ = std::move(callback);
  }
  /// Updates lost to shard restarts so far (sum over the restarts noticed).
  int64_t lost_updates() const;

 private:
  struct Shard;
  void describe_all();
  /// Runs `call` (one RPC attempt on shard i) until it succeeds, retrying unreachable shards
  /// with back-off within the retry window; after a retry, checks whether the shard restarted.
  using Call = std::function<grpc::Status(Shard&, grpc::ClientContext&)>;
  void with_retry(int i, const char* rpc_name, const Call& call);
  void check_restart(Shard& s);
  std::vector<std::string> addresses_;
  PsClientOptions options_;
  std::vector<std::unique_ptr<Shard>> shards_;
  int64_t total_ = -1;
  std::function<void(const ShardRestart&)> on_restart_;
  mutable std::mutex restart_mutex_;
  int64_t lost_updates_ = 0;
};

}  // namespace dtrain::parallel::ps
