// ZeRO-1 sharded across replicas that outlive each other (--strategy zero1 --fault-tolerance
// replicas --shard-across-replicas): the optimizer state is sharded over all N replicas (one
// rank each, ZeRO's flat layout: slot s is the s-th part of every bucket), and each slot is also
// kept by the next replica, its buddy (Gemini's in-memory copy, kept by computing it: every
// replica has the step's summed gradient, so the buddy updates its copy of slot s exactly as
// replica s updates slot s). Each rank updates the two slots it holds, 2/N of the state.
//
// Each step the gradients are summed over the replicas present (as FaultTolerantDdp), each rank
// updates its slots, and the slots' new values are all-gathered over the replicas present, each
// slot from its holder (replica s, or its buddy while s is missing) through the ReplicaManager,
// so a failure during the gather regroups and gathers again. A failed replica's slot goes on at
// its buddy; a replacement receives the weights from the leading replica and the state of its
// two slots from the replicas holding them (its own from its buddy, the copy it keeps from the
// replica before it). Two neighbours missing at once lose a slot: the job stops with an error
// naming it (--max-restarts resumes from the newest checkpoint).
//
// Checkpoints: every replica present writes the slots it gives out (one file per slot), so the
// checkpoint is collective over the replicas present and resumes at any layout; evaluation is
// the leading replica's alone.
#pragma once

#include <vector>

#include "parallel/ft/FaultTolerantDdp.h"
#include "parallel/zero/FlatShards.h"

namespace dtrain::parallel::ft {

class FaultTolerantShardedZero : public FaultTolerantDdp {
 public:
  explicit FaultTolerantShardedZero(StrategyOptions options);
  std::string name() const override { return "zero1"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  MemoryReport memory_report() const override;
  void save(const std::string& directory) override;
  void admit_waiting(int64_t steps) override;
  /// Evaluation is the leading replica's alone; every replica present checkpoints.
  comm::CommunicatorPtr replica_group() const override { return nullptr; }
  comm::CommunicatorPtr checkpoint_group() const override { return member_->manager().group(); }
  bool checkpoints_in_every_replica() const override { return true; }
  int64_t checkpoint_barrier() override;
  std::function<int64_t()> failure_count() const override {
    return member_->manager().death_counter();
  }

 protected:
  void build_optimizer(const optim::OptimizerFactory& make_optimizer) override;
  /// With every replica present in order (and no clipping, which needs whole gradients): the
  /// gradients reduce-scattered over the replicas, each rank's shard then sent to its buddy
  /// (half an allreduce's bytes and a shard); otherwise allreduced whole.
  void sum_gradients(StepResult& result) override;
  void apply_update() override;
  /// Loads fill both slots' optimizer state (any checkpoint layout).
  std::vector<PieceRef> state_pieces() const override;
  bool state_sharded() const override { return true; }
  /// What a replacement receives from the leading replica: the weights and buffers (its slots'
  /// state comes from their holders: transfer_slots).
  ReplicaState replica_state() override;

 private:
  /// The slots replica `replica` holds: its own, then the copy of the one before it.
  std::vector<int> slots_of(int replica) const;
  /// For each member of the group (in group order), the slots it gives out: its own, and a
  /// missing replica's whose buddy it is. Error naming a slot whose holders are both missing.
  std::vector<std::vector<int>> givers() const;
  /// Over the group, after an admission: each admitted replica receives its slots' optimizer
  /// state from a member that held them before.
  void transfer_slots(const std::vector<int>& admitted);
  /// The parameters' new values, each slot from the member that gives it out, over the replicas
  /// present (again over the others after a failure).
  void gather_parameters();
  std::vector<at::Tensor> tensors_of_slot(int slot) const;

  int replicas_ = 1;  // N: the slots
  int replica_ = 0;   // this rank's
  zero::FlatShards shards_;
  std::vector<int> held_;                                     // slots_of(replica_)
  std::vector<std::vector<zero::FlatShards::Piece>> pieces_;  // of each held slot
  at::Tensor gather_in_, gather_out_;  // a gather's buffers while a replica is missing
  /// The step's mean gradient of the slots held (held_'s order), which the pieces' gradients
  /// alias; `summed_` the gradients laid out as the buffer (and the loss and a one).
  std::vector<at::Tensor> slot_grads_;
  at::Tensor summed_;
  at::Tensor reordered_;  // summed_ with each bucket's parts in the members' order
  bool in_slots_ = false;  // this step's mean gradient is in slot_grads_ (else the .grads)
};

}  // namespace dtrain::parallel::ft
