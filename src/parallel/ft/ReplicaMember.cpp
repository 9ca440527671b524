#include "parallel/ft/ReplicaMember.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "dtrain/common/Error.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

namespace {

void check_launcher(int replica_size) {
  if (std::getenv("DTRAIN_AGENT_STORE") == nullptr) return;
  DTRAIN_CHECK_INPUT(std::getenv("DTRAIN_TOLERATE_FAILURES") != nullptr,
                     "--fault-tolerance replicas under dtrain launch needs the launcher's "
                     "--tolerate-failures (dtrain train --nproc sets it)");
  const char* size = std::getenv("DTRAIN_REPLICA_SIZE");
  const int launched = size == nullptr ? 1 : std::atoi(size);
  DTRAIN_CHECK_INPUT(launched == replica_size, "--fault-tolerance replicas: each replica is ",
                     replica_size,
                     " ranks (--tensor-parallel x --replica-shards; diloco: --island-size), but "
                     "the "
                     "launcher's --replica-size is ",
                     launched, " (dtrain train --nproc sets it)");
}

}  // namespace

int mean_over_replicas(ReplicaManager& manager, const std::vector<at::Tensor>& parameters,
                       double& loss) {
  torch::NoGradGuard no_grad;
  // Every gradient, then this replica's loss and a one: the sum counts the replicas in it.
  int64_t total = 0;
  for (const auto& p : parameters) total += p.numel();
  const auto options =
      parameters.empty() ? at::TensorOptions(at::kDouble) : parameters.front().options();
  at::Tensor flat = at::empty({total + 2}, options);
  const double local_loss = loss;
  auto fill = [&parameters, local_loss](at::Tensor& out) {
    int64_t offset = 0;
    for (const auto& p : parameters) {
      at::Tensor part = out.narrow(0, offset, p.numel());
      if (p.grad().defined()) {
        part.copy_(p.grad().reshape({-1}));
      } else {
        part.zero_();
      }
      offset += p.numel();
    }
    out[-2].fill_(local_loss);
    out[-1].fill_(1.0);
  };
  fill(flat);
  manager.allreduce(flat, fill);
  const double replicas = flat[-1].item<double>();
  flat.div_(replicas);
  int64_t offset = 0;
  for (const auto& p : parameters) {
    const at::Tensor mean = flat.narrow(0, offset, p.numel()).view(p.sizes());
    if (p.grad().defined()) {
      p.mutable_grad().copy_(mean);
    } else {
      p.mutable_grad() = mean.clone();
    }
    offset += p.numel();
  }
  loss = flat[-2].item<double>();
  return static_cast<int>(std::lround(replicas));
}

void ReplicaState::add_optimizer(torch::optim::Optimizer& optimizer) {
  Optimized set;
  set.optimizer = &optimizer;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) set.tensors.push_back(p);
  }
  optimizers.push_back(std::move(set));
}

ReplicaMember::ReplicaMember(comm::CommunicatorPtr world, double heartbeat_timeout_s,
                             bool replacement, int replica_size)
    : manager_(std::make_unique<ReplicaManager>(
          std::move(world),
          std::chrono::milliseconds(static_cast<int64_t>(std::lround(heartbeat_timeout_s * 1000))),
          replacement, replica_size)) {}

int64_t ReplicaMember::join(const ReplicaState& state) {
  const auto started = std::chrono::steady_clock::now();
  // While it waits for the step's end, the optimizer state it will receive is allocated and
  // written once (37 MB of fresh Adam moments cost ~25 ms of page faults on the receive else).
  std::vector<optim::ParamState> ready;
  const std::optional<ReplicaManager::Admission> admission = manager_->join([&] {
    torch::NoGradGuard no_grad;
    for (const auto& set : state.optimizers) {
      for (const auto& p : set.tensors) {
        ready.push_back(set.optimizer != nullptr ? optim::param_state_to_fill(*set.optimizer, p)
                                                 : optim::ParamState{});
      }
    }
  });
  if (!admission) return ReplaceableReplicas::kFinished;
  admitted_ = admission->admitted;
  const auto admitted = std::chrono::steady_clock::now();
  const int64_t joined_at = send_state(admission->root, {manager_->group()->rank()},
                                       admission->steps, state, std::move(ready));
  auto ms_since = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
        .count();
  };
  const int me = manager_->world_rank_of(manager_->members()[manager_->group()->rank()]);
  std::fprintf(stderr,
               "dtrain: replica group: world rank %d joined after step %lld, its state (%.1f MB) "
               "from world rank %d in %.0f ms (%.0f ms after it started to wait)\n",
               me, static_cast<long long>(joined_at), static_cast<double>(state_bytes_) / 1e6,
               manager_->world_rank_of(manager_->members()[admission->root]), ms_since(admitted),
               ms_since(started));
  std::fflush(stderr);
  return joined_at;
}

void ReplicaMember::admit_waiting(int64_t steps, const ReplicaState& state) {
  if (manager_->admitting().empty()) return;
  const std::vector<int> admitting = manager_->admitting();
  admitted_ = admitting;
  const int root = manager_->admit(steps);
  std::vector<int> to;  // their ranks in the new group
  const auto& members = manager_->members();
  for (const int r : admitting) {
    to.push_back(static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin()));
  }
  send_state(root, to, steps, state);
}

int64_t ReplicaMember::send_state(int root, const std::vector<int>& to, int64_t steps,
                                  const ReplicaState& state, std::vector<optim::ParamState> ready) {
  torch::NoGradGuard no_grad;
  const comm::CommunicatorPtr& group = manager_->group();
  const bool sending = group->rank() == root;
  if (!sending && std::find(to.begin(), to.end(), group->rank()) == to.end()) return steps;
  // What the receiver cannot know (the optimizer state's keys and shapes: it has none yet) in a
  // small pickled header; then every tensor point to point, from where it lies into where it
  // goes (no staging copy), to each replacement (the other members hold the state already).
  // Order: the values, then each optimizer's tensors' state in key order.
  std::vector<at::Tensor> tensors;
  std::vector<char> header;
  if (sending) {
    for (const auto& v : state.values) tensors.push_back(v.detach());
    c10::impl::GenericList layout(c10::AnyType::get());
    for (const auto& set : state.optimizers) {
      DTRAIN_CHECK(set.optimizer != nullptr, "replica group: no optimizer to send the state of");
      for (const auto& p : set.tensors) {
        c10::impl::GenericList keys(c10::AnyType::get());
        for (const auto& [key, value] : optim::get_param_state(*set.optimizer, p)) {
          tensors.push_back(value);
          keys.push_back(c10::ivalue::Tuple::create(
              {key, static_cast<int64_t>(value.scalar_type()), c10::List<int64_t>(value.sizes())}));
        }
        layout.push_back(keys);
      }
    }
    c10::impl::GenericDict header_state(c10::StringType::get(), c10::AnyType::get());
    header_state.insert("steps", steps);
    header_state.insert("values", static_cast<int64_t>(state.values.size()));
    header_state.insert("layout", layout);
    header = torch::pickle_save(header_state);
  }
  at::Tensor size = at::tensor({static_cast<int64_t>(header.size())}, at::kLong);
  comm::P2POptions tag;
  tag.tag = 7301;
  int64_t bytes = 0;
  if (sending) {
    at::Tensor head = at::empty({size.item<int64_t>()}, at::kByte);
    std::memcpy(head.data_ptr(), header.data(), header.size());
    std::vector<comm::WorkPtr> works;
    for (auto& t : tensors) {
      t = t.contiguous();
      bytes += t.numel() * t.element_size();
    }
    for (const int r : to) {
      works.push_back(group->send(size, r, tag));
      works.push_back(group->send(head, r, tag));
      for (const auto& t : tensors) works.push_back(group->send(t, r, tag));
    }
    comm::wait_all(works);
    state_bytes_ = bytes;
    return steps;
  }
  group->recv(size, root, tag)->wait();
  at::Tensor head = at::empty({size.item<int64_t>()}, at::kByte);
  group->recv(head, root, tag)->wait();
  const char* data = static_cast<const char*>(head.data_ptr());
  const c10::impl::GenericDict received =
      torch::pickle_load(std::vector<char>(data, data + head.numel())).toGenericDict();
  const c10::List<c10::IValue> layout = received.at("layout").toList();
  std::vector<std::pair<torch::optim::Optimizer*, at::Tensor>> optimized;
  for (const auto& set : state.optimizers) {
    for (const auto& p : set.tensors) optimized.emplace_back(set.optimizer, p);
  }
  DTRAIN_CHECK(received.at("values").toInt() == static_cast<int64_t>(state.values.size()) &&
                   layout.size() == optimized.size(),
               "replica group: the state sent has ", received.at("values").toInt(), " values and ",
               layout.size(), " optimized tensors, this replica's ", state.values.size(), " and ",
               optimized.size());
  // Posted in the order sent; the values straight into place.
  std::vector<comm::WorkPtr> works;
  std::vector<optim::ParamState> param_states(optimized.size());
  auto receive = [&](at::Tensor into) {
    bytes += into.numel() * into.element_size();
    works.push_back(group->recv(into, root, tag));
  };
  for (const auto& v : state.values) receive(v.detach());
  for (size_t i = 0; i < optimized.size(); ++i) {
    for (const c10::IValue& item : layout.get(i).toList()) {
      const auto tuple = item.toTuple();
      const auto& entry = tuple->elements();
      const std::vector<int64_t> sizes = entry[2].toIntVector();
      const auto dtype = static_cast<at::ScalarType>(entry[1].toInt());
      at::Tensor value;
      if (i < ready.size()) {
        auto found = ready[i].find(entry[0].toStringRef());
        if (found != ready[i].end() && found->second.scalar_type() == dtype &&
            found->second.is_contiguous() &&
            found->second.numel() == c10::multiply_integers(sizes)) {
          value = found->second.view(sizes);
        }
      }
      if (!value.defined()) value = at::empty(sizes, optimized[i].second.options().dtype(dtype));
      param_states[i][entry[0].toStringRef()] = value;
      receive(value);
    }
  }
  comm::wait_all(works);
  for (size_t i = 0; i < optimized.size(); ++i) {
    optim::adopt_param_state(*optimized[i].first, optimized[i].second, std::move(param_states[i]));
  }
  state_bytes_ = bytes;
  return received.at("steps").toInt();
}

ReplicaMemberStrategy::ReplicaMemberStrategy(const StrategyOptions& options, bool loss_scaled,
                                             bool sums_gradients)
    : replacement_(options.of<FaultToleranceOptions>().replacement ||
                   std::getenv("DTRAIN_FT_REPLACEMENT") != nullptr),
      heartbeat_timeout_s_(options.of<FaultToleranceOptions>().heartbeat_timeout_s) {
  DTRAIN_CHECK_INPUT(!loss_scaled,
                     "--fault-tolerance replicas with loss scaling (fp16-mixed) is not built: use "
                     "bf16-mixed or fp32, or --loss-scaling none");
  DTRAIN_CHECK_INPUT(
      !sums_gradients || (!options.hierarchical_allreduce && options.grad_compression == "none"),
      "--fault-tolerance replicas sums full-precision gradients over one group: "
      "leave out --hierarchical-allreduce and --grad-compression");
}

void ReplicaMemberStrategy::form_replica_group(comm::CommunicatorPtr world, int replica_size) {
  member_ = std::make_unique<ReplicaMember>(std::move(world), heartbeat_timeout_s_, replacement_,
                                            replica_size);
}

std::string ReplicaMemberStrategy::replica_key(int replica) const {
  const char* incarnation = std::getenv("DTRAIN_FT_REPLACEMENT");
  return concat(incarnation != nullptr ? incarnation
                : replacement_         ? "replacement"
                                       : "0",
                "/", replica);
}

void ReplicaMemberStrategy::join_when_replacing(int replica_size) {
  check_launcher(replica_size);
  if (replacement_) joined_at_ = member_->join(replica_state());
}

}  // namespace dtrain::parallel::ft
