// A worker's connection to all parameter-server shards: learns each shard's range, initializes
// them (the first worker's parameters win), and pulls or pushes the whole flat parameter vector
// as one call per shard, the shards in parallel. Every RPC has a deadline; a shard that fails
// or never answers is an error naming its address and the RPC.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::parallel::ps {

struct PsClientOptions {
  /// Deadline of every RPC.
  std::chrono::milliseconds rpc_timeout{30000};
  /// Largest chunk of a streamed tensor, in bytes.
  int64_t chunk_bytes = int64_t{1} << 20;
  /// Who this worker is (metrics, errors).
  int worker = 0;
};

struct PushResult {
  /// Per shard: its version after the update, and the update's staleness there.
  std::vector<int64_t> versions;
  std::vector<int64_t> staleness;
};

class PsClient {
 public:
  /// `addresses`: one "host:port" per shard, in shard order (checked against what each says).
  PsClient(std::vector<std::string> addresses, PsClientOptions options = {});
  ~PsClient();

  int shards() const { return static_cast<int>(addresses_.size()); }
  /// Sets every uninitialized shard to its range of `flat` (float32). Returns true when this
  /// call initialized all of them, false if some already were (pull to get their values).
  bool initialize(const at::Tensor& flat);
  /// Fills `flat` (float32, the model's size) from all shards; returns each shard's version.
  std::vector<int64_t> pull(const at::Tensor& flat);
  /// Pushes `gradient` (float32, the model's size), each shard's range computed at `versions`.
  PushResult push(const at::Tensor& gradient, const std::vector<int64_t>& versions);

 private:
  struct Shard;
  void describe_all();
  std::vector<std::string> addresses_;
  PsClientOptions options_;
  std::vector<std::unique_ptr<Shard>> shards_;
  int64_t total_ = -1;
};

}  // namespace dtrain::parallel::ps
