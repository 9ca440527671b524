// ProcessGrid: the DP x PP x TP decomposition (with context and expert groups inside DP) of the
// world (Megatron's parallel_state). Every strategy takes its communicators from here; a 1-rank
// world is a valid 1x1x1 grid.
#pragma once

#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm {

struct GridCoordinates {
  int dp = 0;
  int pp = 0;
  int tp = 0;
};

/// How world ranks map to coordinates (Megatron's orders; tensor-parallel always fastest, so a
/// TP group is a run of neighbouring ranks, the ones that talk most).
enum class GridOrder {
  /// world_rank = pp * (dp_size * tp_size) + dp * tp_size + tp (Megatron's default).
  kTpDpPp,
  /// world_rank = dp * (pp_size * tp_size) + pp * tp_size + tp: each data-parallel replica
  /// (every stage and TP rank of it) is a run of consecutive ranks, what --fault-tolerance
  /// replicas fails and replaces as one (Megatron's --use-tp-pp-dp-mapping).
  kTpPpDp,
};

class ProcessGrid {
 public:
  /// Collective over `world`. dp size = world size / (tp * pp), which must divide evenly.
  ProcessGrid(CommunicatorPtr world, int tensor_parallel = 1, int pipeline_parallel = 1,
              GridOrder order = GridOrder::kTpDpPp);
  /// Collective over `world`: a pipeline whose stage s is replicated stage_replicas[s] times
  /// (PipeDream's layouts; the world holds their sum x tp ranks). Stage s's replicas are the
  /// world ranks after stage s - 1's, replica k of stage s at pp coordinate s and dp coordinate
  /// k. dp() is this stage's replicas (dp_size() their count, which differs between stages);
  /// pp() the whole pipeline, every replica of every stage at this tp coordinate, in world
  /// order. The data is one stream (data_parallel_size() 1): the pipeline strategy hands each
  /// stage's micro-batches round-robin to its replicas.
  ProcessGrid(CommunicatorPtr world, int tensor_parallel, std::vector<int> stage_replicas);

  const CommunicatorPtr& world() const { return world_; }
  const CommunicatorPtr& dp() const { return dp_; }
  const CommunicatorPtr& pp() const { return pp_; }
  const CommunicatorPtr& tp() const { return tp_; }

  /// Collective over the world: expert parallelism over `ranks` data-parallel ranks (a mixture
  /// of experts' experts split over them, issue 81). The data-parallel group is cut into expert
  /// groups of `ranks` consecutive dp coordinates (ep()) and, across them, the expert
  /// data-parallel groups of the ranks holding the same experts (edp(): torchtitan's mesh rule,
  /// dp = edp x ep). InputError when `ranks` does not divide the data-parallel size.
  void split_experts(int ranks);
  /// The expert-parallel group (this rank's; size 1 without split_experts) and the expert
  /// data-parallel group (the dp group without split_experts).
  const CommunicatorPtr& ep() const { return ep_; }
  const CommunicatorPtr& edp() const { return edp_ ? edp_ : dp_; }
  int ep_size() const { return ep_ ? ep_->size() : 1; }
  /// Collective over the world, after split_experts and split_context: a second group of the
  /// ranks of each expert, tensor-parallel and context group (those of more than one rank), for
  /// a second thread's collectives (comm::LaneScope; DualPipe-V's pairs). Null before, or
  /// without such groups. lanes(): the substitutions for that thread.
  void add_lanes();
  const CommunicatorPtr& ep_lane() const { return ep_lane_; }
  const CommunicatorPtr& tp_lane() const { return tp_lane_; }
  const CommunicatorPtr& cp_lane() const { return cp_lane_; }
  std::vector<std::pair<const Communicator*, CommunicatorPtr>> lanes() const;
  int ep_rank() const { return ep_ ? ep_->rank() : 0; }

  /// Collective over the world: context parallelism over `ranks` data-parallel ranks (issue 82:
  /// each sequence of a batch split over them, nn/context/Attention.h). The data-parallel group
  /// is cut into context groups of `ranks` consecutive dp coordinates (cp()), which read the
  /// same examples (data_parallel_size() is dp_size() / ranks); the gradients are still
  /// averaged over the whole dp() group (Megatron folds CP into data parallelism for the
  /// weights). Call before split_experts. InputError when `ranks` does not divide the
  /// data-parallel size.
  void split_context(int ranks);
  /// The context-parallel group (null without split_context) and its size.
  const CommunicatorPtr& cp() const { return cp_; }
  int cp_size() const { return cp_ ? cp_->size() : 1; }

  int dp_size() const { return dp_size_; }
  /// How many shares the data is cut into, and this rank's share (the data sampler's view):
  /// dp_size() and the dp coordinate (over the context-parallel size), or 1 and 0 when stages
  /// are replicated.
  int data_parallel_size() const { return replicated_stages() ? 1 : dp_size_ / cp_size(); }
  int data_parallel_rank() const { return replicated_stages() ? 0 : coordinates_.dp / cp_size(); }
  /// Replicas of each pipeline stage (empty: a regular DP x PP x TP grid).
  const std::vector<int>& stage_replicas() const { return stage_replicas_; }
  bool replicated_stages() const { return !stage_replicas_.empty(); }
  /// The rank in pp() of replica `replica` of stage `stage`.
  int pp_rank_of(int stage, int replica = 0) const;
  int pp_size() const { return pp_size_; }
  int tp_size() const { return tp_size_; }
  GridOrder order() const { return order_; }
  const GridCoordinates& coordinates() const { return coordinates_; }

  bool is_first_stage() const { return coordinates_.pp == 0; }
  bool is_last_stage() const { return coordinates_.pp == pp_size_ - 1; }
  /// World rank of the previous / next pipeline stage (-1 at the ends).
  int prev_stage_world_rank() const;
  int next_stage_world_rank() const;

  int world_rank_of(const GridCoordinates& c) const;
  GridCoordinates coordinates_of(int world_rank) const;

 private:
  /// World ranks of block `g` of `ranks` consecutive data-parallel coordinates at (pp, tp): an
  /// expert or context group (and its lane).
  std::vector<int> dp_block(int ranks, int g, int pp, int tp) const;
  /// World ranks of the tensor-parallel group at (dp, pp) (and its lane).
  std::vector<int> tp_members(int dp, int pp) const;
  CommunicatorPtr world_;
  int dp_size_;
  int pp_size_;
  int tp_size_;
  GridOrder order_ = GridOrder::kTpDpPp;
  std::vector<int> stage_replicas_;
  std::vector<int> stage_offsets_;  // replicated stages: stage s's first slot (rank / tp)
  GridCoordinates coordinates_;
  CommunicatorPtr dp_;
  CommunicatorPtr pp_;
  CommunicatorPtr tp_;
  CommunicatorPtr ep_;
  CommunicatorPtr edp_;
  CommunicatorPtr ep_lane_, tp_lane_, cp_lane_;
  CommunicatorPtr cp_;
};

}  // namespace dtrain::comm
