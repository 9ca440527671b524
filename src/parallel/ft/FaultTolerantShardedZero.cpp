#include "parallel/ft/FaultTolerantShardedZero.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/comm/Work.h"
#include "dtrain/parallel/zero/ZeroOverlapOptions.h"

namespace dtrain::parallel::ft {

namespace {

bool contains(const std::vector<int>& list, int value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

// `out` to group rank `to` and `in` from group rank `from`, on a thread of its own: a
// point-to-point op's work completes only when waited, and the replica group looks at its works
// while it waits for deaths. `send_first`: around a ring the even members send first and the
// odd ones receive first (a group runs its point-to-point ops one after another).
comm::WorkPtr exchange(const comm::CommunicatorPtr& group, const at::Tensor& out, int to,
                       const at::Tensor& in, int from, bool send_first) {
  auto work = std::make_shared<comm::PromiseWork>(
      concat("gradient shard to rank ", to, ", from rank ", from, " on group '", group->name(),
             "'"),
      group->timeout());
  std::thread([work, group, out, to, in, from, send_first] {
    try {
      comm::P2POptions tag;
      tag.tag = 7302;
      if (send_first) {
        group->send(out, to, tag)->wait();
        group->recv(in, from, tag)->wait();
      } else {
        group->recv(in, from, tag)->wait();
        group->send(out, to, tag)->wait();
      }
      work->finish();
    } catch (...) {
      work->finish(std::current_exception());
    }
  }).detach();
  return work;
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

void FaultTolerantShardedZero::sum_gradients(StepResult& result) {
  in_slots_ = false;
  // Clipping takes the norm of the whole mean gradient: every replica has it from the sum.
  if (options_.max_grad_norm > 0 || replicas_ == 1) return FaultTolerantDdp::sum_gradients(result);
  torch::NoGradGuard no_grad;
  ReplicaManager& manager = member_->manager();
  const int64_t n = shards_.shard_numel();
  const int64_t flat = shards_.layout().flat_numel;
  if (!summed_.defined()) {
    summed_ = at::empty({flat + 2}, parameters_.front().options());
    for (size_t i = 0; i < held_.size(); ++i) slot_grads_.push_back(at::empty({n}, summed_.options()));
  }
  const double local_loss = result.loss;
  const std::vector<at::Tensor> gradients = zero::FlatShards::gradients_of(parameters_);
  at::Tensor extra = at::empty({2}, at::kDouble);
  // Filled from the gradients backward left, at each try (after a failure, the others' sum).
  auto fill = [&] {
    shards_.lay_out(gradients, summed_);
    summed_[flat] = local_loss;
    summed_[flat + 1] = 1.0;
    extra[0] = local_loss;
    extra[1] = 1.0;
  };

  bool scattered = false;  // reduce-scattered (else allreduced whole)
  auto allreduce_whole = [&]() -> std::vector<comm::WorkPtr> {
    scattered = false;
    fill();
    if (manager.group()->size() == 1) return {};
    return {manager.group()->allreduce(summed_)};
  };
  manager.reduce([&]() -> std::vector<comm::WorkPtr> {
    const std::vector<int>& members = manager.members();
    if (static_cast<int>(members.size()) != replicas_) return allreduce_whole();
    scattered = true;
    fill();
    // Group rank g receives part g of each bucket's sum: its own slot, members[g] (after a
    // replacement joined, the members are not in the slots' order: the parts are reordered).
    bool in_order = true;
    for (int g = 0; g < replicas_; ++g) in_order = in_order && members[g] == g;
    at::Tensor input = summed_;
    if (!in_order) {
      if (!reordered_.defined()) reordered_ = at::empty({flat}, summed_.options());
      shards_.reorder_parts(summed_, members, reordered_);
      input = reordered_;
    }
    std::vector<comm::WorkPtr> works =
        shards_.issue_reduce_scatter(manager.group(), input, slot_grads_[0]);
    works.push_back(manager.group()->allreduce(extra));
    return works;
  });
  if (scattered && held_.size() > 1) {
    // Each rank's summed shard to its buddy, the next replica (the copy of the one before it
    // from that one). A member that dies in this leaves the others to sum the step again,
    // whole, over who is left.
    bool first = true;
    manager.collective(
        [&]() -> std::vector<comm::WorkPtr> {
          if (!first) {
            // (The abandoned receive may still write into the old buffer.)
            slot_grads_[1] = at::empty_like(slot_grads_[1]);
            return allreduce_whole();
          }
          first = false;
          const comm::CommunicatorPtr& group = manager.group();
          const std::vector<int>& members = manager.members();
          const int buddy = index_in(members, (replica_ + 1) % replicas_);
          const int before = index_in(members, (replica_ + replicas_ - 1) % replicas_);
          return {exchange(group, slot_grads_[0], buddy, slot_grads_[1], before,
                           replica_ % 2 == 0)};
        },
        "gradient shard to its buddy");
  }
  double count = 0;
  if (scattered) {
    count = extra[1].item<double>();
    result.loss = extra[0].item<double>() / count;
    for (auto& g : slot_grads_) g.div_(count);
  } else {
    count = summed_[flat + 1].item<double>();
    summed_.div_(count);
    result.loss = summed_[flat].item<double>();
    for (size_t i = 0; i < held_.size(); ++i) shards_.pack(summed_, held_[i], slot_grads_[i]);
  }
  in_slots_ = true;
  result.metrics["replicas"] = count;
}

void FaultTolerantShardedZero::apply_update() {
  // The mean gradient of the slots this rank holds (or every parameter's, with clipping): each
  // piece's gradient is the matching slice of it, and the optimizer updates both slots.
  if (in_slots_) {
    for (size_t i = 0; i < held_.size(); ++i) {
      zero::FlatShards::alias_shard_gradient(pieces_[i], slot_grads_[i]);
    }
  } else {
    const std::vector<at::Tensor> gradients = zero::FlatShards::gradients_of(parameters_);
    for (auto& pieces : pieces_) zero::FlatShards::alias_parameter_gradients(pieces, gradients);
  }
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

std::vector<PieceRef> FaultTolerantShardedZero::state_pieces() const {
  std::vector<PieceRef> refs;
  for (const auto& pieces : pieces_) {
    for (auto& ref : zero::FlatShards::state_pieces(pieces, names_, parameters_)) {
      refs.push_back(std::move(ref));
    }
  }
  return refs;
}

void FaultTolerantShardedZero::save(const std::string& directory) {
  // One file per slot, from the member that gives it out; the leading replica adds the buffers.
  const std::vector<std::vector<int>> gives = givers();
  const auto& mine = gives[member_->manager().group()->rank()];
  for (size_t i = 0; i < mine.size(); ++i) {
    const NamedTensors buffers = i == 0 && leads() ? named_buffers() : NamedTensors{};
    write_state_shard(directory, mine[i], replicas_,
                      zero::FlatShards::state_pieces(pieces_[index_in(held_, mine[i])], names_,
                                                     parameters_),
                      optimizer_.get(), buffers);
  }
}

int64_t FaultTolerantShardedZero::checkpoint_barrier() {
  ReplicaManager& manager = member_->manager();
  manager.collective([&] { return std::vector<comm::WorkPtr>{manager.group()->barrier()}; },
                     "checkpoint");
  return manager.regroupings();
}

MemoryReport FaultTolerantShardedZero::memory_report() const {
  MemoryReport report = FaultTolerantDdp::memory_report();
  report.parameter_bytes += shards_.padding_bytes();
  return report;
}

}  // namespace dtrain::parallel::ft
