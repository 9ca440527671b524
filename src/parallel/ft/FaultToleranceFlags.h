// --fault-tolerance's flags and layout rule, declared once for every strategy that offers
// replicas (ddp, zero1, zero2, diloco): each lists the group and the rule in its registry entry.
#pragma once

#include "dtrain/parallel/Strategies.h"

namespace dtrain::parallel::ft {

/// --fault-tolerance, --max-replacements, --replica-shards, --shard-across-replicas,
/// --replica-heartbeat-timeout: their flags and checks.
OptionGroup fault_tolerance_options();
/// InputError unless the ranks divide into replicas (pipeline stages x --replica-shards x
/// tensor-parallel ranks each; no --stage-replicas).
void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout);

}  // namespace dtrain::parallel::ft
