#include "parallel/StrategySupport.h"

#include <torch/torch.h>

#include <cmath>
#include <fstream>

#include "dtrain/common/Error.h"

namespace dtrain::parallel {

ReducerOptions reducer_options_from(const StrategyOptions& options) {
  ReducerOptions reducer;
  reducer.bucket_cap_bytes = options.bucket_cap_bytes;
  reducer.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  const std::string& compression = options.grad_compression;
  if (compression == "fp16") {
    reducer.wire_dtype = at::kHalf;
  } else if (compression == "bf16") {
    reducer.wire_dtype = at::kBFloat16;
  } else {
    DTRAIN_CHECK_INPUT(compression == "none", "unknown gradient compression '", compression,
                       "' (expected none, fp16 or bf16)");
  }
  reducer.error_on_unused_parameters = options.error_on_unused_parameters;
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
  precision::LossScalerOptions scaler_options;
  scaler_options.init_scale = options.loss_scale_init;
  scaler_options.growth_interval = options.loss_scale_growth_interval;
  return std::make_unique<precision::LossScaler>(scaler_options);
}

double clip_by_global_norm(const std::vector<at::Tensor>& holders,
                           const comm::CommunicatorPtr& sum_over, double max_norm) {
  at::Tensor squares = at::zeros({1}, at::kDouble);
  for (const auto& t : holders) {
    if (t.grad().defined()) squares += t.grad().to(at::kDouble).pow(2).sum();
  }
  sum_over->allreduce(squares)->wait();
  const double norm = std::sqrt(squares.item<double>());
  const double factor = max_norm / (norm + 1e-6);
  if (factor < 1.0) {
    for (const auto& t : holders) {
      if (t.grad().defined()) t.grad().mul_(factor);
    }
  }
  return norm;
}

void save_loss_scaler(const precision::LossScaler& scaler, const std::string& directory) {
  torch::save(scaler.state(), directory + "/loss_scaler.pt");
}

void load_loss_scaler(precision::LossScaler& scaler, const std::string& directory) {
  const std::string path = directory + "/loss_scaler.pt";
  if (!std::ifstream(path).good()) return;
  try {
    at::Tensor state;
    torch::load(state, path);
    scaler.load_state(state);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, "checkpoint file ", path, " is not a loss-scaler state: ",
                 e.what_without_backtrace());
  }
}

}  // namespace dtrain::parallel
