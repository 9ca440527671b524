// The pipeline's point-to-point layer, kept apart from the schedules. The model is cut into
// V x P virtual stages, each living on the pipeline rank the schedule's placement says (s % P,
// consecutive ones on consecutive ranks, or zb-v's V: rank r holds r and 2P - 1 - r). Boundary
// b joins virtual stages b and b + 1: activations cross it forward, their gradients backward;
// where both stages live on this rank (the V's turn) the tensor is handed over in memory. Sends are
// asynchronous and receives are posted ahead of the action that needs them. For training, the
// shape and dtype crossing each boundary in each direction are agreed once (a small header
// before the first tensor) and every later send is checked against them, so a mismatch is an
// error naming the stage, micro-batch and shapes, never a wrong-sized receive or a hang. For
// evaluation (shapes vary with the batch), every tensor travels with its header. Between stages
// on the same machine the tensors go through shared-memory rings (comm/SharedMemoryChannel.h):
// a send is a copy into the ring and a receive a copy out, with no transport thread to wake.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/SharedMemoryChannel.h"
#include "dtrain/comm/Communicator.h"

namespace dtrain::parallel::pipeline {

class StageLink {
 public:
  enum Direction { Activation = 0, Gradient = 1 };

  /// Collective over `pp`, the pipeline communicator (this rank is pp->rank());
  /// `stage_ranks[s]`: the pipeline ranks of virtual stage s's replicas (V x P stages; one rank
  /// each unless stages are replicated), micro-batch m on stage_ranks[s][m % replicas]. Evaluation
  /// runs through each stage's first replica. `shared_memory`:
  /// neighbours on this machine exchange through shared memory (else everything goes through
  /// `pp`). Received tensors are made on `device` (shared memory carries CPU tensors only).
  StageLink(comm::CommunicatorPtr pp, std::vector<std::vector<int>> stage_ranks,
            bool shared_memory = true, c10::Device device = c10::Device(c10::DeviceType::CPU));
  /// Whether tensors to (sending) or from `peer` go through shared memory.
  bool shared_memory_with(int peer, bool sending) const;

  /// Sends the tensor crossing `boundary` for `micro_batch` (an activation from virtual stage
  /// boundary to boundary + 1; a gradient the other way).
  void send(Direction direction, int boundary, int micro_batch, const at::Tensor& tensor);
  /// Posts the receive of that tensor, once its shape is agreed (a no-op before, or if posted).
  void post_recv(Direction direction, int boundary, int micro_batch);
  /// The received tensor (posting and waiting as needed).
  at::Tensor recv(Direction direction, int boundary, int micro_batch);
  /// Waits for every send of the step to complete.
  void finish_sends();

  /// Evaluation: an activation of any shape crosses `boundary` forward (blocking).
  void send_any(int boundary, const at::Tensor& tensor);
  at::Tensor recv_any(int boundary);

 private:
  struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  int peer(Direction direction, int boundary, bool sending, int micro_batch) const;
  int data_tag(Direction direction, int boundary, int micro_batch) const;
  int header_tag(int channel, int boundary) const;
  at::Tensor header_of(const at::Tensor& tensor, Direction direction) const;
  Meta read_header(const at::Tensor& header, const char* what) const;
  std::string describe(const Meta& meta) const;

  comm::CommunicatorPtr pp_;
  c10::Device device_;
  int stage_;
  int virtual_stages_;
  std::vector<std::vector<int>> stage_ranks_;
  // Tensors crossing a boundary between two stages of this rank, by (direction, boundary,
  // micro-batch).
  std::map<std::tuple<int, int, int>, at::Tensor> local_;
  // Per (direction, boundary, peer): what this rank agreed to send / to receive.
  std::map<std::tuple<int, int, int>, Meta> sent_, expected_;
  std::map<std::tuple<int, int, int>, std::pair<at::Tensor, comm::WorkPtr>> posted_;
  struct Send {
    int direction;  // -1: a header
    int boundary;
    int micro_batch;
    at::Tensor buffer;
    comm::WorkPtr work;
  };
  void release_sends(const std::function<bool(const Send&)>& done);
  std::vector<Send> sends_;
  std::unique_ptr<comm::SharedMemoryChannel> shm_;
};

}  // namespace dtrain::parallel::pipeline
