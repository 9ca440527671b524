// ProcessGrid: the DP x PP x TP decomposition of the world (Megatron's parallel_state). Every
// strategy takes its communicators from here; a 1-rank world is a valid 1x1x1 grid.
#pragma once

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm {

struct GridCoordinates {
  int dp = 0;
  int pp = 0;
  int tp = 0;
};

/// Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline:
/// world_rank = pp * (dp_size * tp_size) + dp * tp_size + tp, so a TP group is a run of
/// neighbouring ranks (the ones that talk most).
class ProcessGrid {
 public:
  /// Collective over `world`. dp size = world size / (tp * pp), which must divide evenly.
  ProcessGrid(CommunicatorPtr world, int tensor_parallel = 1, int pipeline_parallel = 1);

  const CommunicatorPtr& world() const { return world_; }
  const CommunicatorPtr& dp() const { return dp_; }
  const CommunicatorPtr& pp() const { return pp_; }
  const CommunicatorPtr& tp() const { return tp_; }

  int dp_size() const { return dp_size_; }
  int pp_size() const { return pp_size_; }
  int tp_size() const { return tp_size_; }
  const GridCoordinates& coordinates() const { return coordinates_; }

  bool is_first_stage() const { return coordinates_.pp == 0; }
  bool is_last_stage() const { return coordinates_.pp == pp_size_ - 1; }
  /// World rank of the previous / next pipeline stage (-1 at the ends).
  int prev_stage_world_rank() const;
  int next_stage_world_rank() const;

  int world_rank_of(const GridCoordinates& c) const;
  GridCoordinates coordinates_of(int world_rank) const;

 private:
  CommunicatorPtr world_;
  int dp_size_;
  int pp_size_;
  int tp_size_;
  GridCoordinates coordinates_;
  CommunicatorPtr dp_;
  CommunicatorPtr pp_;
  CommunicatorPtr tp_;
};

}  // namespace dtrain::comm
