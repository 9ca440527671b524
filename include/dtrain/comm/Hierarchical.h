// Hierarchical allreduce for ranks spread over hosts behind a slow link (Horovod's hierarchical
// allreduce, NCCL's 2-D rings): the ranks of a host reduce-scatter among themselves (shared
// memory or loopback), each local rank allreduces its 1/L share with the same local rank of
// every other host, and the host allgathers the result. Each host sends the data across the
// slow link once, 2 (H-1)/H of it, instead of a flat ring's 2 (N-1)/N over N = H L ranks through
// every host boundary; and the slow link sees 2 (H-1) steps instead of 2 (N-1).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm {

class HierarchicalAllreduce {
 public:
  /// Collective over `comm`: members whose world rank / `ranks_per_host` are equal share a host
  /// (dtrain launch numbers each node's ranks consecutively). InputError when hosts would hold
  /// different numbers of `comm`'s ranks.
  HierarchicalAllreduce(const CommunicatorPtr& comm, int ranks_per_host);
  ~HierarchicalAllreduce();
  HierarchicalAllreduce(const HierarchicalAllreduce&) = delete;
  HierarchicalAllreduce& operator=(const HierarchicalAllreduce&) = delete;

  /// Sum allreduce of the contiguous `tensor`; in the order submitted (one at a time, on a
  /// thread of its own, so that every rank issues the three phases in the same order).
  WorkPtr allreduce(at::Tensor tensor);

  /// This host's ranks, and this local rank's peers on the other hosts.
  const CommunicatorPtr& local() const { return local_; }
  const CommunicatorPtr& cross() const { return cross_; }

 private:
  void run(const at::Tensor& tensor);
  void thread_main();

  CommunicatorPtr local_, cross_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dtrain::comm
