// Builds the DP, PP and TP communicators of a ProcessGrid (every rank creates every group in
// the same order, keeping the ones it belongs to).
#include "dtrain/comm/ProcessGrid.h"

#include <algorithm>
#include <cstdlib>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

ProcessGrid::ProcessGrid(CommunicatorPtr world, int tensor_parallel, int pipeline_parallel,
                         GridOrder order)
    : world_(std::move(world)),
      pp_size_(pipeline_parallel),
      tp_size_(tensor_parallel),
      order_(order) {
  DTRAIN_CHECK(world_, "ProcessGrid needs a world communicator");
  const int world_size = world_->size();
  DTRAIN_CHECK_INPUT(tp_size_ >= 1 && pp_size_ >= 1 && world_size % (tp_size_ * pp_size_) == 0,
                     "world size ", world_size, " is not divisible by tensor-parallel size ",
                     tp_size_, " x pipeline-parallel size ", pp_size_);
  dp_size_ = world_size / (tp_size_ * pp_size_);
  coordinates_ = coordinates_of(world_->rank());

  auto make = [&](const std::vector<int>& ranks, const std::string& name) -> CommunicatorPtr {
    if (static_cast<int>(ranks.size()) == world_size) return world_;  // the whole world
    return world_->new_group(ranks, name);
  };
  auto keep = [](CommunicatorPtr& slot, CommunicatorPtr group) {
    if (group) slot = std::move(group);
  };
  // A replacement replica (--fault-tolerance replicas: a tensor-parallel group or a pipeline
  // started again while the others train) never forms the world: the groups inside its replica
  // (TP, and PP under GridOrder::kTpPpDp) form among its own ranks, which its launcher started
  // together, under a key of their incarnation.
  const char* incarnation = std::getenv("DTRAIN_FT_REPLACEMENT");
  const bool replacement = !world_->formed() && incarnation != nullptr;
  auto make_inside = [&](const std::vector<int>& ranks, const std::string& name) {
    const bool mine = std::find(ranks.begin(), ranks.end(), world_->rank()) != ranks.end();
    if (replacement && mine && ranks.size() > 1) {
      return world_->regroup(ranks, concat("replacement/", incarnation, "/", name), name);
    }
    return make(ranks, name);
  };
  const bool pp_inside = order_ == GridOrder::kTpPpDp;
  for (int pp = 0; pp < pp_size_; ++pp) {
    for (int dp = 0; dp < dp_size_; ++dp) {
      keep(tp_, make_inside(tp_members(dp, pp), concat("tp[pp=", pp, ",dp=", dp, "]")));
    }
  }
  for (int pp = 0; pp < pp_size_; ++pp) {
    for (int tp = 0; tp < tp_size_; ++tp) {
      std::vector<int> ranks;
      for (int dp = 0; dp < dp_size_; ++dp) ranks.push_back(world_rank_of({dp, pp, tp}));
      keep(dp_, make(ranks, concat("dp[pp=", pp, ",tp=", tp, "]")));
    }
  }
  for (int dp = 0; dp < dp_size_; ++dp) {
    for (int tp = 0; tp < tp_size_; ++tp) {
      std::vector<int> ranks;
      for (int pp = 0; pp < pp_size_; ++pp) ranks.push_back(world_rank_of({dp, pp, tp}));
      const std::string name = concat("pp[dp=", dp, ",tp=", tp, "]");
      keep(pp_, pp_inside ? make_inside(ranks, name) : make(ranks, name));
    }
  }
  DTRAIN_CHECK(dp_ && pp_ && tp_, "ProcessGrid: rank ", world_->rank(),
               " did not land in every group");
}

ProcessGrid::ProcessGrid(CommunicatorPtr world, int tensor_parallel,
                         std::vector<int> stage_replicas)
    : world_(std::move(world)),
      pp_size_(static_cast<int>(stage_replicas.size())),
      tp_size_(tensor_parallel),
      stage_replicas_(std::move(stage_replicas)) {
  DTRAIN_CHECK(world_, "ProcessGrid needs a world communicator");
  DTRAIN_CHECK_INPUT(pp_size_ >= 1 && tp_size_ >= 1, "--stage-replicas names no stage");
  int slots = 0;
  for (int s = 0; s < pp_size_; ++s) {
    DTRAIN_CHECK_INPUT(stage_replicas_[s] >= 1, "--stage-replicas: stage ", s, " has ",
                       stage_replicas_[s], " replicas (at least 1)");
    stage_offsets_.push_back(slots);
    slots += stage_replicas_[s];
  }
  const int world_size = world_->size();
  DTRAIN_CHECK_INPUT(slots * tp_size_ == world_size, "--stage-replicas adds up to ", slots,
                     " ranks", tp_size_ > 1 ? concat(" x --tensor-parallel ", tp_size_) : "",
                     ", but the world has ", world_size);
  coordinates_ = coordinates_of(world_->rank());
  dp_size_ = stage_replicas_[coordinates_.pp];
  auto make = [&](const std::vector<int>& ranks, const std::string& name) -> CommunicatorPtr {
    if (static_cast<int>(ranks.size()) == world_size) return world_;
    return world_->new_group(ranks, name);
  };
  auto keep = [](CommunicatorPtr& slot, CommunicatorPtr group) {
    if (group) slot = std::move(group);
  };
  for (int slot = 0; slot < slots; ++slot) {
    std::vector<int> ranks;
    for (int tp = 0; tp < tp_size_; ++tp) ranks.push_back(slot * tp_size_ + tp);
    keep(tp_, make(ranks, concat("tp[slot=", slot, "]")));
  }
  for (int pp = 0; pp < pp_size_; ++pp) {
    for (int tp = 0; tp < tp_size_; ++tp) {
      std::vector<int> ranks;
      for (int dp = 0; dp < stage_replicas_[pp]; ++dp) ranks.push_back(world_rank_of({dp, pp, tp}));
      keep(dp_, make(ranks, concat("dp[pp=", pp, ",tp=", tp, "]")));
    }
  }
  for (int tp = 0; tp < tp_size_; ++tp) {
    std::vector<int> ranks;
    for (int slot = 0; slot < slots; ++slot) ranks.push_back(slot * tp_size_ + tp);
    keep(pp_, make(ranks, concat("pp[tp=", tp, "]")));
  }
  DTRAIN_CHECK(dp_ && pp_ && tp_, "ProcessGrid: rank ", world_->rank(),
               " did not land in every group");
}

int ProcessGrid::pp_rank_of(int stage, int replica) const {
  if (replicated_stages()) return stage_offsets_[stage] + replica;
  return stage;
}

int ProcessGrid::world_rank_of(const GridCoordinates& c) const {
  if (replicated_stages()) return (stage_offsets_[c.pp] + c.dp) * tp_size_ + c.tp;
  if (order_ == GridOrder::kTpPpDp) return c.dp * (pp_size_ * tp_size_) + c.pp * tp_size_ + c.tp;
  return c.pp * (dp_size_ * tp_size_) + c.dp * tp_size_ + c.tp;
}

GridCoordinates ProcessGrid::coordinates_of(int world_rank) const {
  GridCoordinates c;
  c.tp = world_rank % tp_size_;
  if (replicated_stages()) {
    const int slot = world_rank / tp_size_;
    while (c.pp + 1 < pp_size_ && stage_offsets_[c.pp + 1] <= slot) ++c.pp;
    c.dp = slot - stage_offsets_[c.pp];
    return c;
  }
  if (order_ == GridOrder::kTpPpDp) {
    c.pp = (world_rank / tp_size_) % pp_size_;
    c.dp = world_rank / (tp_size_ * pp_size_);
    return c;
  }
  c.dp = (world_rank / tp_size_) % dp_size_;
  c.pp = world_rank / (tp_size_ * dp_size_);
  return c;
}

// (Replicated stages: the neighbouring stage's replica of the same index, or its last.)
int ProcessGrid::prev_stage_world_rank() const {
  if (is_first_stage()) return -1;
  if (replicated_stages()) {
    const int pp = coordinates_.pp - 1;
    return world_rank_of({std::min(coordinates_.dp, stage_replicas_[pp] - 1), pp, coordinates_.tp});
  }
  return world_rank_of({coordinates_.dp, coordinates_.pp - 1, coordinates_.tp});
}

int ProcessGrid::next_stage_world_rank() const {
  if (is_last_stage()) return -1;
  if (replicated_stages()) {
    const int pp = coordinates_.pp + 1;
    return world_rank_of({std::min(coordinates_.dp, stage_replicas_[pp] - 1), pp, coordinates_.tp});
  }
  return world_rank_of({coordinates_.dp, coordinates_.pp + 1, coordinates_.tp});
}

void ProcessGrid::split_context(int ranks) {
  if (ranks == 1) return;
  DTRAIN_CHECK_INPUT(ranks >= 1 && dp_size_ % ranks == 0, "--context-parallel ", ranks,
                     " must divide the data-parallel size ", dp_size_);
  DTRAIN_CHECK_INPUT(!replicated_stages(), "--context-parallel with --stage-replicas: not built");
  DTRAIN_CHECK(!cp_ && !ep_, "ProcessGrid::split_context: split once, before split_experts");
  for (int pp = 0; pp < pp_size_; ++pp) {
    for (int tp = 0; tp < tp_size_; ++tp) {
      for (int g = 0; g < dp_size_ / ranks; ++g) {
        const std::vector<int> members = dp_block(ranks, g, pp, tp);
        auto group =
            static_cast<int>(members.size()) == world_->size()
                ? world_
                : world_->new_group(members, concat("cp[pp=", pp, ",tp=", tp, ",g=", g, "]"));
        if (group) cp_ = group;
      }
    }
  }
  DTRAIN_CHECK(cp_, "ProcessGrid: rank ", world_->rank(), " has no context group");
}

void ProcessGrid::split_experts(int ranks) {
  if (ranks == 1) return;
  DTRAIN_CHECK_INPUT(ranks >= 1 && dp_size_ % ranks == 0, "--expert-parallel ", ranks,
                     " must divide the data-parallel size ", dp_size_);
  DTRAIN_CHECK_INPUT(!replicated_stages(), "--expert-parallel with --stage-replicas: not built");
  const int groups = dp_size_ / ranks;
  auto make = [&](const std::vector<int>& members, const std::string& name) {
    return static_cast<int>(members.size()) == world_->size() ? world_
                                                              : world_->new_group(members, name);
  };
  for (int pp = 0; pp < pp_size_; ++pp) {
    for (int tp = 0; tp < tp_size_; ++tp) {
      for (int g = 0; g < groups; ++g) {
        if (auto group =
                make(dp_block(ranks, g, pp, tp), concat("ep[pp=", pp, ",tp=", tp, ",g=", g, "]"))) {
          ep_ = group;
        }
      }
      for (int e = 0; e < ranks; ++e) {
        std::vector<int> members;
        for (int g = 0; g < groups; ++g) members.push_back(world_rank_of({g * ranks + e, pp, tp}));
        if (auto group = make(members, concat("edp[pp=", pp, ",tp=", tp, ",e=", e, "]"))) {
          edp_ = group;
        }
      }
    }
  }
  DTRAIN_CHECK(ep_ && edp_, "ProcessGrid: rank ", world_->rank(), " has no expert groups");
}

void ProcessGrid::add_lanes() {
  if (ep_lane_ || tp_lane_ || cp_lane_) return;
  // (Every rank makes every group, in one order: the groups' own, as split_experts,
  // split_context and the constructor list them.)
  auto over_blocks = [&](CommunicatorPtr& lane, int ranks, const char* prefix) {
    for (int pp = 0; pp < pp_size_; ++pp) {
      for (int tp = 0; tp < tp_size_; ++tp) {
        for (int g = 0; g < dp_size_ / ranks; ++g) {
          if (auto group =
                  world_->new_group(dp_block(ranks, g, pp, tp),
                                    concat(prefix, "[pp=", pp, ",tp=", tp, ",g=", g, "] lane 2"))) {
            lane = group;
          }
        }
      }
    }
    DTRAIN_CHECK(lane, "ProcessGrid: rank ", world_->rank(), " has no second ", prefix, " lane");
  };
  if (ep_) over_blocks(ep_lane_, ep_->size(), "ep");
  if (cp_) over_blocks(cp_lane_, cp_->size(), "cp");
  if (tp_size_ > 1) {
    for (int pp = 0; pp < pp_size_; ++pp) {
      for (int dp = 0; dp < dp_size_; ++dp) {
        if (auto group = world_->new_group(tp_members(dp, pp),
                                           concat("tp[pp=", pp, ",dp=", dp, "] lane 2"))) {
          tp_lane_ = group;
        }
      }
    }
    DTRAIN_CHECK(tp_lane_, "ProcessGrid: rank ", world_->rank(), " has no second tp lane");
  }
}

std::vector<std::pair<const Communicator*, CommunicatorPtr>> ProcessGrid::lanes() const {
  std::vector<std::pair<const Communicator*, CommunicatorPtr>> out;
  if (ep_lane_) out.emplace_back(ep_.get(), ep_lane_);
  if (tp_lane_) out.emplace_back(tp_.get(), tp_lane_);
  if (cp_lane_) out.emplace_back(cp_.get(), cp_lane_);
  return out;
}

std::vector<int> ProcessGrid::dp_block(int ranks, int g, int pp, int tp) const {
  std::vector<int> members;
  for (int e = 0; e < ranks; ++e) members.push_back(world_rank_of({g * ranks + e, pp, tp}));
  return members;
}

std::vector<int> ProcessGrid::tp_members(int dp, int pp) const {
  std::vector<int> members;
  for (int tp = 0; tp < tp_size_; ++tp) members.push_back(world_rank_of({dp, pp, tp}));
  return members;
}

}  // namespace dtrain::comm
