// Point-to-point transfers between members of a group that share a machine, through rings in
// shared memory (/dev/shm) instead of the backend: the sending thread copies the bytes into the
// ring and goes on, the receiving thread copies them out when it needs them. No transport
// thread sits between the two, so a transfer does not wait for one to be scheduled on a busy
// core (with one compute thread per core, Gloo's 2-6 ms per hop was the pipeline's largest
// overhead on two cores; BENCHMARKS.md). Used by the pipeline's StageLink; peers on other
// machines keep using the Communicator.
//
// One ring per ordered pair (sender, receiver) that was asked for. A message is a header (tag,
// bytes) followed by its payload, streamed through the ring, so a message larger than the ring
// still passes. The receiver reads messages in order and keeps those with other tags until
// asked for them. Waits use a futex on the shared ring with the group's timeout, and check
// every 200 ms that the peer process is still alive, so a dead peer is an error within a
// second, not a hang.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm {

class SharedMemoryChannel {
 public:
  /// Collective over `group`: every member passes the same `pairs` (sender, receiver) of group
  /// ranks. Rings are made for the pairs whose ends can map the same file (the same machine);
  /// connected() says which. `ring_bytes`: each ring's capacity, allocated and mapped up front
  /// (a message larger than the ring streams through it).
  SharedMemoryChannel(const CommunicatorPtr& group, const std::vector<std::pair<int, int>>& pairs,
                      int64_t ring_bytes = int64_t{16} << 20);
  ~SharedMemoryChannel();
  SharedMemoryChannel(const SharedMemoryChannel&) = delete;
  SharedMemoryChannel& operator=(const SharedMemoryChannel&) = delete;

  /// Whether messages from `src` to `dst` (group ranks) go through shared memory.
  bool connected(int src, int dst) const;

  /// Copies `tensor` (contiguous) into the ring to `dst`; returns once it is all in (blocks
  /// only while the ring is full). `what` names the message in errors.
  void send(int dst, int64_t tag, const at::Tensor& tensor, const std::string& what);
  /// The next message from `src` with `tag`, as `sizes`/`dtype` (its byte count must match).
  at::Tensor recv(int src, int64_t tag, at::IntArrayRef sizes, at::ScalarType dtype,
                  const std::string& what);
  /// The next message from `src` with `tag`, as raw bytes (any length).
  at::Tensor recv_bytes(int src, int64_t tag, const std::string& what);

  struct Ring;

 private:
  Ring* ring(int src, int dst) const;
  at::Tensor take(int src, int64_t tag, const std::string& what);
  std::string describe(const std::string& what, int peer) const;

  CommunicatorPtr group_;
  std::map<std::pair<int, int>, std::unique_ptr<Ring>> rings_;
  std::vector<int64_t> pids_;
  // Messages read ahead of the one asked for, by (src, tag), oldest first.
  std::map<std::pair<int, int64_t>, std::vector<at::Tensor>> stash_;
};

}  // namespace dtrain::comm
