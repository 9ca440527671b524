#include "parallel/ft/FaultTolerantDdp.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/common/Trace.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

namespace {

void declare_flags(FlagSet& flags, FaultToleranceOptions& o) {
  flags.add("--fault-tolerance", o.mode,
            "ddp: none (a failed rank stops the job; --max-restarts restarts every rank from "
            "the newest checkpoint) or replicas (the other replicas go on without it at once, "
            "its share of the data dropped until a replacement joins; --nproc or dtrain "
            "launch)");
  flags.add("--max-replacements", o.max_replacements,
            "--fault-tolerance replicas with --nproc: start a failed replica again up to this "
            "many times; it joins the others at a step's end with the state of one of them");
  flags.add("--replica-heartbeat-timeout", o.heartbeat_timeout_s,
            "--fault-tolerance replicas: a replica whose heartbeat stays silent this many "
            "seconds is counted as dead (a hang, a stopped machine) and the others go on; too "
            "short counts a slow replica out");
}

void check_flags(const FaultToleranceOptions& o) {
  DTRAIN_CHECK_INPUT(o.mode == "none" || o.mode == "replicas",
                     "--fault-tolerance must be none or replicas, got '", o.mode, "'");
  DTRAIN_CHECK_INPUT(o.max_replacements >= 0 && o.max_replacements <= 100000,
                     "--max-replacements must be in 0..100000, got ", o.max_replacements);
  DTRAIN_CHECK_INPUT(o.heartbeat_timeout_s >= 0.1 && o.heartbeat_timeout_s <= 3600,
                     "--replica-heartbeat-timeout must be in [0.1, 3600] seconds, got ",
                     o.heartbeat_timeout_s);
  const FaultToleranceOptions defaults;
  DTRAIN_CHECK_INPUT(o.replicas() || (o.max_replacements == defaults.max_replacements &&
                                      o.heartbeat_timeout_s == defaults.heartbeat_timeout_s),
                     "--max-replacements and --replica-heartbeat-timeout apply with "
                     "--fault-tolerance replicas, which this run does not have");
}

}  // namespace

OptionGroup fault_tolerance_options() {
  return option_group<FaultToleranceOptions>("fault-tolerance", declare_flags, check_flags);
}

void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout) {
  if (!options.of<FaultToleranceOptions>().replicas()) return;
  DTRAIN_CHECK_INPUT(
      layout.pipeline_parallel == 1 && layout.stage_replicas.empty(),
      "--fault-tolerance replicas: a replica is one rank or one tensor-parallel group for now "
      "(ddp without --pipeline-parallel or --stage-replicas)");
  DTRAIN_CHECK_INPUT(
      !layout.defer_eval,
      "--fault-tolerance replicas evaluates on rank 0 alone: leave out --defer-eval");
}

FaultTolerantDdp::FaultTolerantDdp(StrategyOptions options)
    : DdpStrategy(std::move(options)),
      replacement_(options_.of<FaultToleranceOptions>().replacement ||
                   std::getenv("DTRAIN_FT_REPLACEMENT") != nullptr) {
  DTRAIN_CHECK_INPUT(scaler_ == nullptr,
                     "--fault-tolerance replicas with loss scaling (fp16-mixed) is not built: use "
                     "bf16-mixed or fp32, or --loss-scaling none");
  DTRAIN_CHECK_INPUT(!options_.hierarchical_allreduce && options_.grad_compression == "none",
                     "--fault-tolerance replicas sums full-precision gradients over one group: "
                     "leave out --hierarchical-allreduce and --grad-compression");
}

void FaultTolerantDdp::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  DdpStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  DTRAIN_CHECK_INPUT(grid_->pp_size() == 1 && !grid_->replicated_stages(),
                     "--fault-tolerance replicas: a replica is one rank or one tensor-parallel "
                     "group for now (no pipeline)");
  // Under a launcher that stops every rank when one fails, nothing would be left to go on; one
  // that does not know a replica's ranks would start one of them alone.
  if (std::getenv("DTRAIN_AGENT_STORE") != nullptr) {
    DTRAIN_CHECK_INPUT(std::getenv("DTRAIN_TOLERATE_FAILURES") != nullptr,
                       "--fault-tolerance replicas under dtrain launch needs the launcher's "
                       "--tolerate-failures (dtrain train --nproc sets it)");
    const char* size = std::getenv("DTRAIN_REPLICA_SIZE");
    const int launched = size == nullptr ? 1 : std::atoi(size);
    DTRAIN_CHECK_INPUT(launched == grid_->tp_size(),
                       "--fault-tolerance replicas with --tensor-parallel ", grid_->tp_size(),
                       ": each replica is ", grid_->tp_size(),
                       " ranks, but the launcher's --replica-size is ", launched,
                       " (dtrain train --nproc sets it)");
  }
  if (!replacement_) return;
  // (broadcast_initial_state left the state to the admission.)
  const auto started = std::chrono::steady_clock::now();
  const std::optional<ReplicaManager::Admission> admission = manager_->join();
  if (!admission) {
    joined_at_ = kFinished;
    return;
  }
  const auto admitted = std::chrono::steady_clock::now();
  joined_at_ = send_state(admission->root, {manager_->group()->rank()}, admission->steps);
  auto ms_since = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
        .count();
  };
  std::fprintf(stderr,
               "dtrain: replica group: world rank %d joined after step %lld, its state (%.1f MB) "
               "from world rank %d in %.0f ms (%.0f ms after it started to wait)\n",
               grid_->world()->rank(), static_cast<long long>(joined_at_),
               static_cast<double>(state_bytes_) / 1e6,
               manager_->world_rank_of(manager_->members()[admission->root]), ms_since(admitted),
               ms_since(started));
  std::fflush(stderr);
}

void FaultTolerantDdp::broadcast_initial_state() {
  // The replica group forms here; a replacement's heartbeat runs while it waits to be admitted.
  manager_ = std::make_unique<ReplicaManager>(
      grid_->world(),
      std::chrono::milliseconds(static_cast<int64_t>(
          std::lround(options_.of<FaultToleranceOptions>().heartbeat_timeout_s * 1000))),
      replacement_, grid_->tp_size());
  if (!replacement_) DdpStrategy::broadcast_initial_state();
}

void FaultTolerantDdp::admit_waiting(int64_t steps) {
  if (manager_->admitting().empty()) return;
  const std::vector<int> admitting = manager_->admitting();
  const int root = manager_->admit(steps);
  std::vector<int> to;  // their ranks in the new group
  const auto& members = manager_->members();
  for (const int r : admitting) {
    to.push_back(static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin()));
  }
  send_state(root, to, steps);
}

int64_t FaultTolerantDdp::send_state(int root, const std::vector<int>& to, int64_t steps) {
  torch::NoGradGuard no_grad;
  const comm::CommunicatorPtr& group = manager_->group();
  const bool sending = group->rank() == root;
  if (!sending && std::find(to.begin(), to.end(), group->rank()) == to.end()) return steps;
  // What the receiver cannot know (the optimizer state's keys and shapes: it has none yet) in a
  // small pickled header; then every tensor point to point, from where it lies into where it
  // goes (no staging copy), to each replacement (the other members hold the state already).
  std::vector<at::Tensor> tensors;  // each parameter, its state in key order; the buffers
  std::vector<char> header;
  if (sending) {
    c10::impl::GenericList layout(c10::AnyType::get());
    for (const auto& p : parameters_) {
      tensors.push_back(p.detach());
      c10::impl::GenericList keys(c10::AnyType::get());
      for (const auto& [key, value] : optim::get_param_state(*optimizer_, p)) {
        tensors.push_back(value);
        keys.push_back(c10::ivalue::Tuple::create(
            {key, static_cast<int64_t>(value.scalar_type()), c10::List<int64_t>(value.sizes())}));
      }
      layout.push_back(keys);
    }
    for (const auto& b : model_.module->buffers()) tensors.push_back(b);
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    state.insert("steps", steps);
    state.insert("layout", layout);
    header = torch::pickle_save(state);
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
  const c10::impl::GenericDict state =
      torch::pickle_load(std::vector<char>(data, data + head.numel())).toGenericDict();
  const c10::List<c10::IValue> layout = state.at("layout").toList();
  DTRAIN_CHECK(layout.size() == parameters_.size(), "replica group: the state sent has ",
               layout.size(), " parameters, this replica's model ", parameters_.size());
  // Posted in the order sent; the parameters' and buffers' values straight into them.
  std::vector<comm::WorkPtr> works;
  std::vector<optim::ParamState> param_states(parameters_.size());
  auto receive = [&](at::Tensor into) {
    bytes += into.numel() * into.element_size();
    works.push_back(group->recv(into, root, tag));
  };
  for (size_t i = 0; i < parameters_.size(); ++i) {
    receive(parameters_[i].detach());
    for (const c10::IValue item : layout.get(i).toList()) {
      const auto tuple = item.toTuple();
      const auto& entry = tuple->elements();
      at::Tensor value =
          at::empty(entry[2].toIntVector(),
                    parameters_[i].options().dtype(static_cast<at::ScalarType>(entry[1].toInt())));
      param_states[i][entry[0].toStringRef()] = value;
      receive(value);
    }
  }
  for (auto& buffer : model_.module->buffers()) receive(buffer);
  comm::wait_all(works);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    optim::adopt_param_state(*optimizer_, parameters_[i], std::move(param_states[i]));
  }
  state_bytes_ = bytes;
  return state.at("steps").toInt();
}

StepResult FaultTolerantDdp::train_step(const std::vector<data::Batch>& micro_batches,
                                        const LossFn& loss) {
  DTRAIN_CHECK(!micro_batches.empty(), "train_step needs at least one micro-batch");
  model_.module->train();
  for (auto& p : parameters_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  StepResult result;
  const auto count = static_cast<double>(micro_batches.size());
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const auto& batch = micro_batches[i];
    const at::Tensor value = micro_batch_loss(batch, loss, i);
    {
      trace::Span span("backward", concat("B", i));
      (micro_batches.size() == 1 ? value : value / count).backward();
    }
    result.loss += value.item<double>() / count;
    result.samples += batch.inputs.size(0);
  }
  {
    trace::Span span("sync", "gradient sum over the replicas present");
    torch::NoGradGuard no_grad;
    // Every gradient, then this replica's loss and a one: the sum counts the replicas in it.
    // Filled from the gradients, which stay as backward left them until the sum commits (a sum
    // taken again after a failure starts from them).
    int64_t total = 0;
    for (const auto& p : parameters_) total += p.numel();
    at::Tensor flat = at::empty({total + 2}, parameters_.front().options());
    const double local_loss = result.loss;
    auto fill = [this, local_loss](at::Tensor& out) {
      int64_t offset = 0;
      for (const auto& p : parameters_) {
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
    manager_->allreduce(flat, fill);
    const double replicas = flat[-1].item<double>();
    flat.div_(replicas);
    int64_t offset = 0;
    for (auto& p : parameters_) {
      const at::Tensor mean = flat.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(mean);
      } else {
        p.mutable_grad() = mean.clone();
      }
      offset += p.numel();
    }
    // Sequence parallelism: what each TP rank holds of a replicated parameter's gradient is a
    // part; the replica's TP group sums them (as ddp does after its reduction).
    tp_.sum_partial_gradients(reduced_gradient_holders(), names_);
    result.loss = flat[-2].item<double>();
    result.metrics["replicas"] = replicas;
    result.metrics["regroupings"] = static_cast<double>(manager_->regroupings());
  }
  trace::Span span("optimizer", "step");
  if (options_.max_grad_norm > 0) result.grad_norm = clip_gradients(options_.max_grad_norm);
  apply_update();
  result.metrics["step_skipped"] = 0.0;
  return result;
}

}  // namespace dtrain::parallel::ft
