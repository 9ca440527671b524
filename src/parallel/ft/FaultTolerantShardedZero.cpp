#include "parallel/ft/FaultTolerantShardedZero.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"

namespace dtrain::parallel::ft {

namespace {

bool contains(const std::vector<int>& list, int value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

int index_in(const std::vector<int>& list, int value) {
  return static_cast<int>(std::find(list.begin(), list.end(), value) - list.begin());
}

}  // namespace

FaultTolerantShardedZero::FaultTolerantShardedZero(StrategyOptions options)
    : FaultTolerantDdp(std::move(options)) {
  DTRAIN_CHECK_INPUT(!precision::has_master_weights(precision_) &&
                         precision_ != precision::Precision::Bf16,
                     "--shard-across-replicas keeps the model's own dtype as the optimizer's: "
                     "use --precision fp32 or bf16-mixed");
  DTRAIN_CHECK_INPUT(!options_.of<zero::ZeroOverlapOptions>().param_gather,
                     "--shard-across-replicas gathers the parameters through the replica group "
                     "after the update: leave out --overlap-param-gather");
}

void FaultTolerantShardedZero::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                                     std::shared_ptr<comm::ProcessGrid> grid) {
  FaultTolerantDdp::setup(std::move(model), make_optimizer, std::move(grid));
  // A replacement had the weights from the leading replica; its slots' state comes from the
  // replicas holding them.
  if (replacement_ && joined_at_ != ReplaceableReplicas::kFinished) {
    transfer_slots(member_->admitted());
  }
}

std::vector<int> FaultTolerantShardedZero::slots_of(int replica) const {
  std::vector<int> slots = {replica};
  const int copy = (replica + replicas_ - 1) % replicas_;
  if (copy != replica) slots.push_back(copy);
  return slots;
}

void FaultTolerantShardedZero::build_optimizer(const optim::OptimizerFactory& make_optimizer) {
  const comm::CommunicatorPtr& world = grid_->world();
  replicas_ = world->size();
  replica_ = world->global_ranks()[world->rank()];
  held_ = slots_of(replica_);
  shards_ = zero::FlatShards(parameters_, ddp::bucket_groups(parameters_, names_,
                                                             reducer_options_from(options_)),
                             replicas_, replica_, "zero1 --shard-across-replicas");
  std::vector<at::Tensor> optimized;
  for (const int slot : held_) {
    pieces_.push_back(shards_.pieces_of(slot));
    for (const auto& piece : pieces_.back()) optimized.push_back(piece.tensor);
  }
  optimizer_ = make_optimizer(optimized);
}

std::vector<at::Tensor> FaultTolerantShardedZero::tensors_of_slot(int slot) const {
  std::vector<at::Tensor> tensors;
  if (!contains(held_, slot)) return tensors;
  for (const auto& piece : pieces_[index_in(held_, slot)]) tensors.push_back(piece.tensor);
  return tensors;
}

std::vector<std::vector<int>> FaultTolerantShardedZero::givers() const {
  const std::vector<int>& members = member_->manager().members();
  std::vector<std::vector<int>> gives(members.size());
  for (int slot = 0; slot < replicas_; ++slot) {
    const int buddy = (slot + 1) % replicas_;
    const int holder = contains(members, slot)                       ? slot
                       : buddy != slot && contains(members, buddy) ? buddy
                                                                     : -1;
    DTRAIN_CHECK(holder >= 0, "zero1 --shard-across-replicas: replica ", slot,
                 " and its buddy, replica ", buddy,
                 ", both failed before a replacement took their place: shard ", slot,
                 " of the optimizer state is lost (restart from the newest checkpoint: "
                 "--max-restarts)");
    gives[index_in(members, holder)].push_back(slot);
  }
  return gives;
}

void FaultTolerantShardedZero::apply_update() {
  // Every replica has the mean gradient of every parameter; each piece's gradient is the
  // matching slice of it, and the optimizer updates both slots this rank holds.
  const std::vector<at::Tensor> gradients = zero::FlatShards::gradients_of(parameters_);
  for (auto& pieces : pieces_) zero::FlatShards::alias_parameter_gradients(pieces, gradients);
  optimizer_->step();
  gather_parameters();
}

void FaultTolerantShardedZero::gather_parameters() {
  trace::Span span("sync", "parameter gather over the replicas present");
  torch::NoGradGuard no_grad;
  ReplicaManager& manager = member_->manager();
  const int64_t n = shards_.shard_numel();
  std::vector<std::vector<int>> gives;
  int64_t most = 1;
  bool in_place = false;
  manager.collective([&]() -> std::vector<comm::WorkPtr> {
    gives = givers();
    const comm::CommunicatorPtr& group = manager.group();
    // Every replica present, in order, each giving its own slot: each bucket's all-gather in
    // place, as plain ZeRO-1's.
    in_place = group->size() == replicas_;
    for (size_t m = 0; m < gives.size(); ++m) {
      in_place = in_place && gives[m] == std::vector<int>{static_cast<int>(m)};
    }
    if (in_place) return group->size() > 1 ? shards_.issue_allgather(group) : std::vector<comm::WorkPtr>{};
    // Otherwise each member gives the same number of slots (its own, and a missing
    // neighbour's while its buddy: padded to the most any member gives), in the members' order.
    most = 1;
    for (const auto& g : gives) most = std::max<int64_t>(most, static_cast<int64_t>(g.size()));
    const auto& mine = gives[group->rank()];
    if (!gather_in_.defined() || gather_in_.numel() != most * n) {
      gather_in_ = at::zeros({most * n}, parameters_.front().options());
    }
    for (size_t i = 0; i < mine.size(); ++i) shards_.pack(mine[i], gather_in_.narrow(0, i * n, n));
    if (!gather_out_.defined() || gather_out_.numel() != group->size() * most * n) {
      gather_out_ = at::empty({group->size() * most * n}, gather_in_.options());
    }
    if (group->size() == 1) {
      gather_out_.copy_(gather_in_);
      return {};
    }
    return {group->allgather(gather_out_, gather_in_)};
  });
  if (in_place) return;
  for (size_t m = 0; m < gives.size(); ++m) {
    for (size_t i = 0; i < gives[m].size(); ++i) {
      shards_.unpack(gives[m][i],
                     gather_out_.narrow(0, (static_cast<int64_t>(m) * most + i) * n, n));
    }
  }
}

void FaultTolerantShardedZero::transfer_slots(const std::vector<int>& admitted) {
  const std::vector<int>& members = member_->manager().members();
  for (const int replica : admitted) {
    for (const int slot : slots_of(replica)) {
      // The slot's holders that were there before: the replica itself and its buddy.
      int from = -1;
      for (const int holder : {slot, (slot + 1) % replicas_}) {
        if (from < 0 && contains(members, holder) && !contains(admitted, holder)) from = holder;
      }
      DTRAIN_CHECK(from >= 0, "zero1 --shard-across-replicas: no replica present holds shard ",
                   slot, " of the optimizer state for replacement replica ", replica,
                   " (replicas ", slot, " and ", (slot + 1) % replicas_, " both failed)");
      ReplicaState state;
      state.optimizers.push_back({optimizer_.get(), tensors_of_slot(slot)});
      const auto started = std::chrono::steady_clock::now();
      member_->send_optimizer_state(index_in(members, from), {index_in(members, replica)},
                                    state);
      if (replica == replica_) {
        std::fprintf(stderr,
                     "dtrain: replica group: world rank %d took shard %d's optimizer state from "
                     "world rank %d in %.0f ms\n",
                     replica_, slot, from,
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                               started)
                         .count());
        std::fflush(stderr);
      }
    }
  }
}

void FaultTolerantShardedZero::admit_waiting(int64_t steps) {
  if (member_->manager().admitting().empty()) return;
  member_->admit_waiting(steps, replica_state());
  transfer_slots(member_->admitted());
}

ReplicaState FaultTolerantShardedZero::replica_state() {
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : model_.module->buffers()) state.values.push_back(b);
  return state;
}

std::vector<PieceRef> FaultTolerantShardedZero::piece_refs(
    const std::vector<zero::FlatShards::Piece>& pieces) const {
  std::vector<PieceRef> refs;
  for (const auto& piece : pieces) {
    refs.push_back({names_[piece.parameter], piece.offset, piece.tensor,
                    parameters_[piece.parameter].sizes().vec()});
  }
  return refs;
}

std::vector<PieceRef> FaultTolerantShardedZero::state_pieces() const {
  std::vector<PieceRef> refs;
  for (const auto& pieces : pieces_) {
    for (auto& ref : piece_refs(pieces)) refs.push_back(std::move(ref));
  }
  return refs;
}

void FaultTolerantShardedZero::save(const std::string& directory) {
  // One file per slot, from the member that gives it out; the leading replica adds the buffers.
  const std::vector<std::vector<int>> gives = givers();
  const auto& mine = gives[member_->manager().group()->rank()];
  for (size_t i = 0; i < mine.size(); ++i) {
    const NamedTensors buffers = i == 0 && leads() ? named_buffers() : NamedTensors{};
    write_state_shard(directory, mine[i], replicas_, piece_refs(pieces_[index_in(held_, mine[i])]),
                      optimizer_.get(), buffers);
  }
}

MemoryReport FaultTolerantShardedZero::memory_report() const {
  MemoryReport report = FaultTolerantDdp::memory_report();
  report.parameter_bytes += shards_.padding_bytes();
  return report;
}

}  // namespace dtrain::parallel::ft
