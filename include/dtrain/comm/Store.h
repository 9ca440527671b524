// The job's key-value store (the rendezvous store): a TCP server hosted by one process, the
// others its clients. Ranks find each other through it; launchers share heartbeats, failures
// and restarts in it. Every call is bounded by the store's timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace dtrain::comm {

class Store {
 public:
  struct Options {
    std::string host = "127.0.0.1";
    int port = 29500;
    /// Host the store (listening on every interface) as well as using it.
    bool is_server = false;
    /// Bound of connecting and of every call (get waits for its key this long).
    std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  };

  /// Hosts or connects; CommError naming host:port when that fails within the timeout.
  explicit Store(const Options& options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(const std::string& key, const std::string& value);
  /// Waits up to the timeout for the key.
  std::string get(const std::string& key);
  /// Adds `delta` to the integer at `key` (0 if absent) and returns the sum; add(key, 0) reads.
  int64_t add(const std::string& key, int64_t delta);
  /// Whether the key exists (does not wait).
  bool check(const std::string& key);
  /// Sets `key` to `value` unless it already has a value; returns the value it holds after.
  std::string set_if_absent(const std::string& key, const std::string& value);

  const Options& options() const { return options_; }
  /// "host:port", for messages.
  std::string address() const;
  /// The underlying c10d store (an intrusive_ptr<c10d::Store>), for backends in src/comm.
  void* native() const;

 private:
  struct Impl;
  Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::comm
