// What a strategy whose replicas outlive each other does as a member of the replica group
// (--fault-tolerance replicas; ReplicaManager.h): forms the group, joins it as a replacement
// (its state from a member at its position), takes in replacements at a step's end and sends
// them the state. Shared by FaultTolerantDdp (replicas of one rank or one TP group) and
// FaultTolerantZero (replicas whose ranks shard the optimizer state: hybrid sharding).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaManager.h"

namespace dtrain::parallel::ft {

/// The state one rank of a replica holds: `values` (its parameters' values and buffers, in
/// place), and for each of its optimizers (DiLoCo: the inner and the outer one) the tensors it
/// updates, whose state it keeps.
struct ReplicaState {
  struct Optimized {
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<at::Tensor> tensors;
  };
  std::vector<at::Tensor> values;
  std::vector<Optimized> optimizers;
  /// The tensors `optimizer` updates (every parameter of its groups).
  void add_optimizer(torch::optim::Optimizer& optimizer);
};

/// The gradients of `parameters` (undefined ones as zeros) and this replica's `loss`, summed
/// over the replicas present by `manager` (with a one that counts them) and divided by their
/// number: the gradients become the mean over the replicas, `loss` the mean loss. Returns how
/// many replicas took part. Filled from the gradients, which stay as backward left them until
/// the sum commits (a sum taken again after a failure starts from them).
int mean_over_replicas(ReplicaManager& manager, const std::vector<at::Tensor>& parameters,
                       double& loss);

class ReplicaMember {
 public:
  /// Forms the replica group over `world` (replicas of `replica_size` consecutive ranks);
  /// `replacement`: this process replaces a failed member (DTRAIN_FT_REPLACEMENT or the option).
  ReplicaMember(comm::CommunicatorPtr world, double heartbeat_timeout_s, bool replacement,
                int replica_size);

  ReplicaManager& manager() { return *manager_; }
  const ReplicaManager& manager() const { return *manager_; }

  /// A replacement, once its state exists (after setup): waits to be admitted and receives the
  /// state of the member at its position; returns the steps that member had trained, or
  /// ReplaceableReplicas::kFinished when the job ended first.
  int64_t join(const ReplicaState& state);
  /// Every member after a step: takes in the replacements that step admitted and sends them the
  /// state (a no-op when there are none).
  void admit_waiting(int64_t steps, const ReplicaState& state);
  /// The replicas the last admission took in (join()'s or admit_waiting()'s), in order.
  const std::vector<int>& admitted() const { return admitted_; }
  /// Over the group, after an admission: the optimizer state of `state`'s tensors from group
  /// rank `root` to group ranks `to` (each into its own tensors of the same shapes, in the same
  /// order); root and `to` take part, the others return at once.
  void send_optimizer_state(int root, const std::vector<int>& to, const ReplicaState& state) {
    send_state(root, to, 0, state);
  }

 private:
  /// Over the group: `state` of group rank `root` to the group ranks `to`, and root's `steps`;
  /// returns them. Root and `to` take part; the others return at once. A receiver receives the
  /// optimizer state into `ready` (param_state_to_fill's, one per optimized tensor in order)
  /// where a tensor's key, dtype and size match, into fresh tensors otherwise.
  int64_t send_state(int root, const std::vector<int>& to, int64_t steps,
                     const ReplicaState& state, std::vector<optim::ParamState> ready = {});

  std::unique_ptr<ReplicaManager> manager_;
  int64_t state_bytes_ = 0;  // of the last state sent or received
  std::vector<int> admitted_;
};

/// ReplaceableReplicas as both fault-tolerant strategies answer it, from their ReplicaMember.
class ReplicaMemberStrategy : public ReplaceableReplicas {
 public:
  int64_t joined_at_step() const override { return joined_at_; }
  void admit_waiting(int64_t steps) override {
    if (!member_->manager().admitting().empty()) member_->admit_waiting(steps, replica_state());
  }
  void close_admissions() override { member_->manager().close(); }
  bool in_leading_replica() const override { return member_->manager().leads(); }
  bool leads() const override {
    return member_->manager().leads() && member_->manager().position() == 0;
  }

 protected:
  /// InputError for what the gradients' sum over the replicas cannot take (`loss_scaled`: a
  /// loss scaler, the hierarchical allreduce, gradient compression; `sums_gradients` false: a
  /// strategy whose replicas average something else, DiLoCo's outer gradient); reads whether
  /// this process is a replacement.
  ReplicaMemberStrategy(const StrategyOptions& options, bool loss_scaled,
                        bool sums_gradients = true);
  /// What a replacement receives.
  virtual ReplicaState replica_state() = 0;
  /// Forms the replica group over `world` in replicas of `replica_size` ranks (a replacement's
  /// heartbeat runs while it waits to be admitted).
  void form_replica_group(comm::CommunicatorPtr world, int replica_size);
  /// After setup: under dtrain launch, InputError unless the launcher tolerates failures (else
  /// nothing would be left to go on) and knows that a replica is `replica_size` ranks (else it
  /// would start one of them alone); a replacement waits for its admission and its state.
  void join_when_replacing(int replica_size);
  /// Where the groups inside replica `replica` form (regroup keys): a replacement replica's
  /// ranks, started again together, form theirs among themselves under their incarnation (the
  /// world never forms for them).
  std::string replica_key(int replica) const;

  std::unique_ptr<ReplicaMember> member_;
  bool replacement_ = false;
  int64_t joined_at_ = -1;

 private:
  double heartbeat_timeout_s_ = 2.0;
};

}  // namespace dtrain::parallel::ft
