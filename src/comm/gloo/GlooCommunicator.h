// The c10d ProcessGroupGloo backend. All LibTorch-1.13-specific c10d code lives in this folder.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm::gloo {

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> root_store, std::string store_prefix, int rank,
                   int size, std::string name, std::vector<int> global_ranks, Milliseconds timeout,
                   std::shared_ptr<::gloo::transport::Device> device, int threads,
                   bool connect = true);
  ~GlooCommunicator() override;

  std::string backend_name() const override { return "gloo"; }
  WorkPtr allreduce(at::Tensor tensor, const AllreduceOptions& options) override;
  WorkPtr broadcast(at::Tensor tensor, const BroadcastOptions& options) override;
  WorkPtr barrier(const BarrierOptions& options) override;
  CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& name) override;
  std::shared_ptr<KeyValue> key_value() const override;
  CommunicatorPtr regroup(const std::vector<int>& world_ranks, const std::string& key,
                          const std::string& name) override;
  bool formed() const override { return group_ != nullptr; }
  /// The store this group's rendezvous used (another backend's groups can rendezvous there).
  const c10::intrusive_ptr<c10d::Store>& store() const { return root_store_; }
  const std::string& store_prefix() const { return store_prefix_; }
  /// Point-to-point with an internal algorithm's tag, for a backend that sends its CPU tensors
  /// through this group.
  WorkPtr send_internal(at::Tensor tensor, int dst, int tag, Milliseconds timeout) {
    return send_tagged(std::move(tensor), dst, tag, timeout);
  }
  WorkPtr recv_internal(at::Tensor tensor, int src, int tag, Milliseconds timeout) {
    return recv_tagged(std::move(tensor), src, tag, timeout);
  }

 protected:
  WorkPtr send_tagged(at::Tensor tensor, int dst, int tag, Milliseconds timeout) override;
  WorkPtr recv_tagged(at::Tensor tensor, int src, int tag, Milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Store> root_store_;
  std::string store_prefix_;
  std::shared_ptr<::gloo::transport::Device> device_;
  int threads_;
  int groups_created_ = 0;
  /// Null when the group never connected (a replacement replica's world).
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  /// The connected group; Error naming `what` when it never formed.
  c10d::ProcessGroupGloo& connected(const std::string& what) const;
};

/// Rendezvous through a TCPStore at options.master_addr:master_port and connect the world.
std::shared_ptr<GlooCommunicator> create_world(const InitOptions& options);

}  // namespace dtrain::comm::gloo
