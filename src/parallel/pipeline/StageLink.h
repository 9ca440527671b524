// The pipeline's point-to-point layer, kept apart from the schedules: activations go to the next
// stage and their gradients to the previous one over the PP communicator, sends asynchronous and
// receives posted ahead of the action that needs them. Shapes and dtypes are agreed once per
// direction (a small header before the first tensor) and every later send is checked against
// them, so a mismatch is an error naming the stage, micro-batch and shapes, not a wrong-sized
// receive.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::parallel::pipeline {

class StageLink {
 public:
  enum Direction { Activation = 0, Gradient = 1 };

  /// `pp`: the pipeline communicator; this rank is stage pp->rank().
  explicit StageLink(comm::CommunicatorPtr pp);

  /// Sends `tensor` (activation: to the next stage; gradient: to the previous one).
  void send(Direction direction, int micro_batch, const at::Tensor& tensor);
  /// Posts the receive of micro-batch's tensor from the neighbour, once its shape is agreed.
  void post_recv(Direction direction, int micro_batch);
  /// The received tensor (posting and waiting as needed).
  at::Tensor recv(Direction direction, int micro_batch);
  /// Waits for every send of the step to complete.
  void finish_sends();

 private:
  struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  int peer(Direction direction, bool sending) const;
  std::string describe(const Meta& meta) const;

  comm::CommunicatorPtr pp_;
  int stage_;
  std::optional<Meta> sent_[2];      // what this rank agreed to send, per direction
  std::optional<Meta> expected_[2];  // what it agreed to receive
  std::map<std::pair<int, int>, std::pair<at::Tensor, comm::WorkPtr>> posted_;
  std::vector<std::pair<at::Tensor, comm::WorkPtr>> sends_;
};

}  // namespace dtrain::parallel::pipeline
