#include "parallel/StrategySupport.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"
#include "dtrain/nn/DeferredInit.h"
#include "parallel/ddp/PowerSgd.h"

namespace dtrain::parallel {

parallel::ddp::ReducerOptions reducer_options_from(const StrategyOptions& options) {
  parallel::ddp::ReducerOptions reducer;
  reducer.bucket_cap_bytes = options.bucket_cap_bytes;
  reducer.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  const std::string& compression = options.grad_compression;
  if (compression == "fp16") {
    reducer.wire_dtype = at::kHalf;
  } else if (compression == "bf16") {
    reducer.wire_dtype = at::kBFloat16;
  } else if (compression.rfind("powersgd", 0) == 0) {
    reducer.powersgd = parallel::ddp::parse_powersgd(compression, "--grad-compression");
  } else {
    DTRAIN_CHECK_INPUT(compression == "none", "unknown gradient compression '", compression,
                       "' (expected none, fp16, bf16 or powersgd:RANK[:START_STEP[:MIN_RATE]])");
  }
  reducer.error_on_unused_parameters = options.error_on_unused_parameters;
  DTRAIN_CHECK_INPUT(options.ranks_per_host >= 0, "--ranks-per-host must be >= 0, got ",
                     options.ranks_per_host);
  if (options.hierarchical_allreduce) {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    reducer.ranks_per_host = options.ranks_per_host > 0 ? options.ranks_per_host
                             : local                    ? std::max(1, std::atoi(local))
                                                        : std::numeric_limits<int>::max();
  }
  return reducer;
}

std::unique_ptr<precision::LossScaler> make_loss_scaler(const StrategyOptions& options,
                                                        precision::Precision precision) {
  const std::string& scaling = options.loss_scaling;
  DTRAIN_CHECK_INPUT(scaling == "auto" || scaling == "dynamic" || scaling == "none",
                     "unknown loss scaling '", scaling, "' (expected auto, dynamic or none)");
  if (scaling == "none" || (scaling == "auto" && precision != precision::Precision::Fp16Mixed)) {
    return nullptr;
  }
  DTRAIN_CHECK_INPUT(!precision::has_master_weights(precision),
                     "--precision bf16-master needs no loss scaling: leave out --loss-scaling");
  precision::LossScalerOptions scaler_options;
  scaler_options.init_scale = options.loss_scale_init;
  scaler_options.growth_interval = options.loss_scale_growth_interval;
  return std::make_unique<precision::LossScaler>(scaler_options);
}

std::vector<at::Tensor> keep_master_weights(torch::nn::Module& module,
                                            const std::vector<at::Tensor>& parameters,
                                            precision::Precision precision) {
  if (!precision::has_master_weights(precision)) return {};
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> master;
  for (const auto& p : parameters) {
    // A placeholder has no values yet: a strategy that draws it (zero3) draws its master too.
    master.push_back(nn::is_placeholder(p) ? at::Tensor()
                                           : p.detach().to(at::kFloat, /*non_blocking=*/false,
                                                           /*copy=*/true));
  }
  // A pipeline rank's other stages are placeholders (nn/DeferredInit.h): they stay so.
  nn::module_to(module, at::TensorOptions().dtype(precision::parameter_dtype(precision)));
  return master;
}

at::Tensor gradient_holder(const at::Tensor& master, const at::Tensor& grad) {
  at::Tensor holder = master.defined() ? master : grad.detach();
  holder.mutable_grad() = grad;
  return holder;
}

void copy_weights(const std::vector<at::Tensor>& from, const std::vector<at::Tensor>& to) {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < from.size(); ++k) to[k].copy_(from[k]);
}

int64_t gradient_element_size(const at::Tensor& parameter, precision::Precision precision) {
  return precision::has_master_weights(precision) ? static_cast<int64_t>(sizeof(float))
                                                  : parameter.element_size();
}

double clip_by_global_norm(const std::vector<at::Tensor>& holders,
                           const std::vector<comm::CommunicatorPtr>& sum_over, double max_norm,
                           const std::vector<bool>& counted) {
  DTRAIN_CHECK(counted.empty() || counted.size() == holders.size(),
               "clip_by_global_norm: ", counted.size(), " flags for ", holders.size(), " holders");
  // Summed where the gradients are (a GPU's: one read at the end).
  const auto where = std::find_if(holders.begin(), holders.end(),
                                  [](const at::Tensor& t) { return t.grad().defined(); });
  // Each tensor's squared norm in one pass over its gradient (in float32 for 16-bit gradients,
  // whose norm can overflow fp16), summed over tensors in float64. (Squaring a float64 copy of
  // every gradient, as this did, wrote three times the gradients' bytes: ~50 ms of a
  // 25 M-parameter Llama's step on a CPU.) The pass is cut into rows of kChunk elements: a CPU's
  // float32 norm of one long tensor accumulates its error along it (PyTorch's too: 3e-5 of a
  // 2 M-element gradient, 1.4e-4 of a 10 M-parameter model's global norm), a row's stays small.
  constexpr int64_t kChunk = 16384;
  std::vector<at::Tensor> norms;  // of rows and tails, squared and summed in float64 at the end
  for (size_t i = 0; i < holders.size(); ++i) {
    const at::Tensor& t = holders[i];
    if (!t.grad().defined() || !(counted.empty() || counted[i])) continue;
    const at::Tensor flat = t.grad().reshape({-1});
    const c10::optional<at::ScalarType> dtype =
        at::elementSize(flat.scalar_type()) < 4 ? c10::optional<at::ScalarType>(at::kFloat)
                                                : c10::nullopt;
    const int64_t n = flat.numel(), whole = n / kChunk * kChunk;
    if (whole > 0) {
      norms.push_back(
          at::linalg_vector_norm(flat.narrow(0, 0, whole).view({whole / kChunk, kChunk}), 2,
                                 at::IntArrayRef{1}, false, dtype));
    }
    if (n > whole) {
      norms.push_back(
          at::linalg_vector_norm(flat.narrow(0, whole, n - whole), 2, c10::nullopt, false, dtype)
              .reshape({1}));
    }
  }
  at::Tensor squares =
      norms.empty()
          ? at::zeros({1}, at::TensorOptions(at::kDouble)
                               .device(where == holders.end() ? at::kCPU : where->grad().device()))
          : at::cat(norms).to(at::kDouble).pow(2).sum().reshape({1});
  for (const auto& group : sum_over) {
    if (group && group->size() > 1) group->allreduce(squares)->wait();
  }
  const double norm = std::sqrt(squares.item<double>());
  const double factor = max_norm / (norm + 1e-6);
  if (factor < 1.0) {
    for (const auto& t : holders) {
      if (t.grad().defined()) t.grad().mul_(factor);
    }
  }
  return norm;
}

std::vector<PieceRef> TensorParallelLayout::for_writing(std::vector<PieceRef> pieces) const {
  // A block several ranks hold is written by the first of them.
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                              [this](const PieceRef& piece) {
                                const auto it = splits.find(piece.name);
                                // (Experts are split over the expert group and replicated
                                // over the tensor-parallel one: TP rank 0 writes them.)
                                return it != splits.end() &&
                                       (it->second.expert ? rank != 0 : it->second.replica != 0);
                              }),
               pieces.end());
  return with_splits(std::move(pieces), splits, /*keep_replicated=*/rank == 0);
}

std::vector<PieceRef> TensorParallelLayout::for_reading(std::vector<PieceRef> pieces) const {
  return with_splits(std::move(pieces), splits);
}

bool TensorParallelLayout::has_shared_blocks() const {
  return std::any_of(splits.begin(), splits.end(),
                     [](const auto& item) { return item.second.replicas > 1; });
}

std::vector<bool> TensorParallelLayout::counted(const std::vector<std::string>& names) const {
  std::vector<bool> flags;
  for (const auto& name : names) {
    const auto it = splits.find(name);
    flags.push_back(it == splits.end() || it->second.expert ? rank == 0 : it->second.replica == 0);
  }
  return flags;
}

std::vector<bool> TensorParallelLayout::partial_flags(const std::vector<std::string>& names) const {
  std::vector<bool> flags;
  for (const auto& name : names) {
    flags.push_back(std::find(partial.begin(), partial.end(), name) != partial.end());
  }
  return flags;
}

std::vector<bool> TensorParallelLayout::expert_flags(const std::vector<std::string>& names) const {
  std::vector<bool> flags;
  for (const auto& name : names) {
    const auto split = splits.find(name);
    flags.push_back(split != splits.end() && split->second.expert);
  }
  return flags;
}

std::vector<PieceRef> TensorParallelLayout::for_expert_rank(std::vector<PieceRef> pieces,
                                                            int ep_rank) const {
  if (ep_rank == 0) return pieces;
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                              [this](const PieceRef& piece) {
                                const auto it = splits.find(piece.name);
                                return it == splits.end() || !it->second.expert;
                              }),
               pieces.end());
  return pieces;
}

void reduce_expert_gradients(const std::vector<at::Tensor>& experts,
                             const comm::CommunicatorPtr& edp, int data_parallel) {
  if (experts.empty()) return;
  trace::Span span("sync", "expert gradients");
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads, flats;
  for (auto p : experts) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
    flats.push_back(p.grad().reshape({-1}));
  }
  at::Tensor flat = at::cat(flats);
  if (edp && edp->size() > 1) edp->allreduce(flat)->wait();
  flat.div_(static_cast<double>(data_parallel));
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

void TensorParallelLayout::sum_partial_gradients(const std::vector<at::Tensor>& parameters,
                                                 const std::vector<std::string>& names) const {
  if (size == 1) return;
  torch::NoGradGuard no_grad;
  // Replicated parameters whose gradients are partial sums go into the buffer whole; a block
  // several ranks hold goes in at its place in the full tensor, zeros around it, so the holders'
  // partial sums add up there and nowhere else. Every TP rank lays the buffer out the same way.
  struct Entry {
    at::Tensor grad;
    const nn::tensor::ParameterSplit* split;  // null: replicated
  };
  std::vector<Entry> entries;
  int64_t total = 0;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto split = splits.find(names[i]);
    const bool held_by_several = split != splits.end() && split->second.replicas > 1;
    if (!held_by_several && std::find(partial.begin(), partial.end(), names[i]) == partial.end()) {
      continue;
    }
    if (!parameters[i].grad().defined())
      parameters[i].mutable_grad() = at::zeros_like(parameters[i]);
    entries.push_back({parameters[i].grad(), held_by_several ? &split->second : nullptr});
    total +=
        held_by_several ? c10::multiply_integers(split->second.full_shape) : parameters[i].numel();
  }
  if (entries.empty()) return;
  at::Tensor flat = at::zeros({total}, entries.front().grad.options());
  auto place = [&](const Entry& e, int64_t offset) {
    if (!e.split) return flat.narrow(0, offset, e.grad.numel()).view(e.grad.sizes());
    return flat.narrow(0, offset, c10::multiply_integers(e.split->full_shape))
        .view(e.split->full_shape)
        .narrow(e.split->dim, e.split->start, e.split->length);
  };
  int64_t offset = 0;
  for (const auto& e : entries) {
    place(e, offset).copy_(e.grad);
    offset += e.split ? c10::multiply_integers(e.split->full_shape) : e.grad.numel();
  }
  group->allreduce(flat)->wait();
  offset = 0;
  for (auto& e : entries) {
    e.grad.copy_(place(e, offset));
    offset += e.split ? c10::multiply_integers(e.split->full_shape) : e.grad.numel();
  }
}

TensorParallelLayout tensor_parallel_layout(const torch::nn::Module& module,
                                            const comm::ProcessGrid& grid) {
  TensorParallelLayout layout;
  layout.splits = nn::tensor::parameter_splits(module);
  layout.partial = nn::tensor::partial_gradient_parameters(module);
  layout.group = grid.tp();
  layout.rank = grid.coordinates().tp;
  layout.size = grid.tp_size();
  DTRAIN_CHECK_INPUT(layout.size == 1 || !layout.splits.empty(), "--tensor-parallel ", layout.size,
                     ": the model has no tensor-parallel layers (build it over the "
                     "grid's TP group: make_model(spec, grid->tp()))");
  return layout;
}

void save_loss_scaler(const precision::LossScaler& scaler, const std::string& directory) {
  save_tensor_file(directory + "/loss_scaler.pt", scaler.state());
}

void load_loss_scaler(precision::LossScaler& scaler, const std::string& directory) {
  const std::string path = directory + "/loss_scaler.pt";
  if (!std::ifstream(path).good()) return;
  try {
    at::Tensor state;
    torch::load(state, path);
    scaler.load_state(state);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, "checkpoint file ", path,
                 " is not a loss-scaler state: ", e.what_without_backtrace());
  }
}

}  // namespace dtrain::parallel
