// Pieces every data-parallel strategy builds the same way from StrategyOptions: the Reducer's
// options, the loss scaler, and the loss scaler's checkpoint file.
#pragma once

#include <memory>
#include <string>

#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "dtrain/precision/LossScaler.h"
#include "dtrain/precision/Precision.h"

namespace dtrain::parallel {

/// Bucket caps, wire dtype ("none", "fp16", "bf16": InputError otherwise) and unused-parameter
/// policy from `options`.
ReducerOptions reducer_options_from(const StrategyOptions& options);

/// The dynamic loss scaler `options` ask for with `precision` (null when none): "dynamic", or
/// "auto" under fp16-mixed. InputError for an unknown loss_scaling.
std::unique_ptr<precision::LossScaler> make_loss_scaler(const StrategyOptions& options,
                                                        precision::Precision precision);

/// Scales the gradients of `holders` so their global L2 norm is at most `max_norm`, the squared
/// norm summed over `sum_over` (the ranks holding disjoint parts of the gradients). Collective;
/// returns the norm before clipping.
double clip_by_global_norm(const std::vector<at::Tensor>& holders,
                           const comm::CommunicatorPtr& sum_over, double max_norm);

/// The scaler's state in a checkpoint directory: written by the caller's chosen rank; read if
/// present (InputError naming the file when it is not a scaler state).
void save_loss_scaler(const precision::LossScaler& scaler, const std::string& directory);
void load_loss_scaler(precision::LossScaler& scaler, const std::string& directory);

}  // namespace dtrain::parallel
