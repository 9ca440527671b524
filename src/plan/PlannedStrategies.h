// The strategies dtrain plan models, as their registry entries declare them
// (parallel::StrategyInfo::cost): the planner reads these and compares no strategy's name.
#pragma once

#include <string>

#include "dtrain/parallel/Strategies.h"

namespace dtrain::plan {

/// The registry's entry of a layout's strategy; InputError for an unknown strategy or one the
/// planner does not model, naming those it models.
const parallel::StrategyInfo& planned_strategy(const std::string& name);

}  // namespace dtrain::plan
