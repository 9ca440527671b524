#include "parallel/ft/FaultTolerantDdp.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
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
}

void check_flags(const FaultToleranceOptions& o) {
  DTRAIN_CHECK_INPUT(o.mode == "none" || o.mode == "replicas",
                     "--fault-tolerance must be none or replicas, got '", o.mode, "'");
  DTRAIN_CHECK_INPUT(o.max_replacements >= 0 && o.max_replacements <= 100000,
                     "--max-replacements must be in 0..100000, got ", o.max_replacements);
}

}  // namespace

OptionGroup fault_tolerance_options() {
  return option_group<FaultToleranceOptions>("fault-tolerance", declare_flags, check_flags);
}

void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout) {
  if (!options.of<FaultToleranceOptions>().replicas()) return;
  DTRAIN_CHECK_INPUT(layout.pipeline_parallel == 1 && layout.tensor_parallel == 1 &&
                         layout.stage_replicas.empty(),
                     "--fault-tolerance replicas: each replica is one rank for now (ddp without "
                     "--pipeline-parallel, --stage-replicas or --tensor-parallel)");
  DTRAIN_CHECK_INPUT(!layout.defer_eval,
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
  DTRAIN_CHECK_INPUT(grid_->tp_size() == 1 && grid_->pp_size() == 1,
                     "--fault-tolerance replicas: each replica is one rank for now");
  // Under a launcher that stops every rank when one fails, nothing would be left to go on.
  DTRAIN_CHECK_INPUT(std::getenv("DTRAIN_AGENT_STORE") == nullptr ||
                         std::getenv("DTRAIN_TOLERATE_FAILURES") != nullptr,
                     "--fault-tolerance replicas under dtrain launch needs the launcher's "
                     "--tolerate-failures (dtrain train --nproc sets it)");
  if (!replacement_) manager_ = std::make_unique<ReplicaManager>(grid_->world());
  if (!replacement_) return;
  // (DdpStrategy::setup left the initial broadcast to the admission.)
  const auto started = std::chrono::steady_clock::now();
  const std::optional<ReplicaManager::Admission> admission = manager_->join();
  if (!admission) {
    joined_at_ = kFinished;
    return;
  }
  const auto admitted = std::chrono::steady_clock::now();
  joined_at_ = send_state(admission->root, admission->steps);
  auto ms_since = [](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since)
        .count();
  };
  std::fprintf(stderr,
               "dtrain: replica group: world rank %d joined after step %lld, its state (%.1f MB) "
               "from world rank %d in %.0f ms (%.0f ms after it started to wait)\n",
               grid_->world()->rank(), static_cast<long long>(joined_at_),
               static_cast<double>(state_bytes_) / 1e6, manager_->members()[admission->root],
               ms_since(admitted), ms_since(started));
  std::fflush(stderr);
}

void FaultTolerantDdp::broadcast_initial_state() {
  if (replacement_) {
    // Announced before the rest of setup: its heartbeat runs while it waits to be admitted.
    manager_ = std::make_unique<ReplicaManager>(grid_->world(), std::chrono::seconds(2), true);
    return;
  }
  DdpStrategy::broadcast_initial_state();
}

void FaultTolerantDdp::admit_waiting(int64_t steps) {
  if (manager_->admitting().empty()) return;
  send_state(manager_->admit(steps), steps);
}

int64_t FaultTolerantDdp::send_state(int root, int64_t steps) {
  torch::NoGradGuard no_grad;
  const comm::CommunicatorPtr& group = manager_->group();
  const bool sending = group->rank() == root;
  // One pickled blob (the receiver has no optimizer state to take its shapes from): the steps,
  // every parameter with its optimizer state, every buffer; on the CPU.
  std::vector<char> bytes;
  if (sending) {
    c10::impl::GenericList parameters(c10::AnyType::get());
    for (const auto& p : parameters_) {
      c10::Dict<std::string, at::Tensor> entry;
      entry.insert("param", p.detach().cpu());
      for (const auto& [key, value] : optim::get_param_state(*optimizer_, p)) {
        entry.insert(key, value.cpu());
      }
      parameters.push_back(entry);
    }
    c10::List<at::Tensor> buffers;
    for (const auto& b : model_.module->buffers()) buffers.push_back(b.cpu());
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    state.insert("steps", steps);
    state.insert("parameters", parameters);
    state.insert("buffers", buffers);
    bytes = torch::pickle_save(state);
  }
  at::Tensor size = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
  group->broadcast(size, {root})->wait();
  at::Tensor blob = at::empty({size.item<int64_t>()}, at::kByte);
  if (sending) std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
  group->broadcast(blob, {root})->wait();
  state_bytes_ = blob.numel();
  if (sending) return steps;
  const char* data = static_cast<const char*>(blob.data_ptr());
  const c10::impl::GenericDict state =
      torch::pickle_load(std::vector<char>(data, data + blob.numel())).toGenericDict();
  const c10::List<c10::IValue> parameters = state.at("parameters").toList();
  DTRAIN_CHECK(parameters.size() == parameters_.size(), "replica group: the state sent has ",
               parameters.size(), " parameters, this replica's model ", parameters_.size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto entry = c10::impl::toTypedDict<std::string, at::Tensor>(
        parameters.get(i).toGenericDict());
    optim::ParamState param_state;
    for (const auto& item : entry) {
      if (item.key() == "param") {
        parameters_[i].copy_(item.value());
      } else {
        param_state[item.key()] = item.value().to(parameters_[i].device());
      }
    }
    optim::set_param_state(*optimizer_, parameters_[i], param_state);
  }
  const std::vector<at::Tensor> buffers = state.at("buffers").toTensorVector();
  size_t b = 0;
  for (auto& buffer : model_.module->buffers()) {
    DTRAIN_CHECK(b < buffers.size(), "replica group: the state sent has too few buffers");
    buffer.copy_(buffers[b++]);
  }
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
