// What the training loop asks of a strategy whose replicas can be replaced while the others
// train (--fault-tolerance replicas, parallel/ft/ReplicaManager.h): a replacement starts from
// the step its state was sent at; the members take in waiting replacements at a step's end.
#pragma once

#include <cstdint>
#include <functional>

#include "dtrain/parallel/Strategy.h"

namespace dtrain::parallel::ft {

class ReplaceableReplicas {
 public:
  virtual ~ReplaceableReplicas() = default;

  /// A replacement, after setup(): the number of steps its state (weights, optimizer state) had
  /// trained when a member sent it; it trains from the next. -1 on the other replicas (they start
  /// from their checkpoint, if any). kFinished when the job ended before it was admitted.
  virtual int64_t joined_at_step() const = 0;
  static constexpr int64_t kFinished = INT64_MAX;

  /// Every replica present, after step `steps` (the steps trained so far): takes in the
  /// replacements its last step admitted (forms the group with them and sends them the state;
  /// collective over the new group), a no-op when there are none.
  virtual void admit_waiting(int64_t steps) = 0;

  /// The leader, after its last step: replacements still waiting are told that none will admit
  /// them.
  virtual void close_admissions() = 0;

  /// This rank's replica is the first present: it evaluates and checkpoints alone (collective
  /// over its ranks). Rank 0's until it fails, then the longest present replica's.
  virtual bool in_leading_replica() const = 0;
  /// This rank writes the run's outputs (metrics, progress, the summary): the leading replica's
  /// first rank.
  virtual bool leads() const = 0;
  /// Every rank of this rank's replica (its TP group, or the ranks that shard its state): the
  /// group the leading replica checkpoints over.
  virtual comm::CommunicatorPtr replica_group() const = 0;
  /// Whether every replica present takes part in a checkpoint (replicas that shard the state
  /// between them: --shard-across-replicas), over checkpoint_group(); otherwise the leading
  /// replica checkpoints alone, over replica_group().
  virtual bool checkpoints_in_every_replica() const { return false; }
  virtual comm::CommunicatorPtr checkpoint_group() const { return replica_group(); }
  /// checkpoints_in_every_replica(): a barrier over the replicas present that a member's failure
  /// does not break (the others regroup without it and go on, as in a step); returns how many
  /// times their group has been formed so far: a change between two barriers says a member
  /// failed while the checkpoint was written (its files may be missing).
  virtual int64_t checkpoint_barrier() { return 0; }
  /// How many failures of ranks the launcher has reported so far; callable from any thread (an
  /// asynchronous checkpoint's writer watches it). nullptr: none are reported.
  virtual std::function<int64_t()> failure_count() const { return nullptr; }
};

/// The strategy's ReplaceableReplicas, or nullptr when it has none.
inline ReplaceableReplicas* replaceable(Strategy& strategy) {
  return dynamic_cast<ReplaceableReplicas*>(&strategy);
}

}  // namespace dtrain::parallel::ft
