// The strategy registry. Adding a built-in strategy: one line in kBuiltIn (and the include of
// the header declaring its StrategyInfo).
#include "dtrain/parallel/Strategies.h"

#include <algorithm>
#include <set>
#include <type_traits>
#include <variant>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "parallel/ddp/DdpStrategy.h"
#include "parallel/diloco/DilocoStrategy.h"
#include "parallel/pipeline/PipelineStrategy.h"
#ifdef DTRAIN_SERVICES  // the parameter server's strategies need its gRPC client
#include "parallel/ps/DownpourStrategy.h"
#include "parallel/ps/SandblasterStrategy.h"
#endif
#include "parallel/zero/Zero3Strategy.h"
#include "parallel/zero/ZeroStrategy.h"

namespace dtrain::parallel {

namespace {

using InfoFn = StrategyInfo (*)();
constexpr InfoFn kBuiltIn[] = {
    ddp::ddp_strategy,     zero::zero1_strategy,        zero::zero2_strategy,
    zero::zero3_strategy,  pipeline::pipeline_strategy, diloco::diloco_strategy,
#ifdef DTRAIN_SERVICES
    ps::downpour_strategy, ps::sandblaster_strategy,
#endif
};

Registry<StrategyInfo>& registry() {
  static Registry<StrategyInfo> all("strategy", "--strategy", [] {
    std::vector<StrategyInfo> built_in;
    for (InfoFn info : kBuiltIn) built_in.push_back(info());
    return built_in;
  }());
  return all;
}

std::string joined(const std::vector<std::string>& names, const char* last_separator) {
  return Registry<StrategyInfo>::joined(names, last_separator);
}

// Every option group once (strategies may share one), in registry order.
std::vector<const OptionGroup*> option_groups() {
  std::vector<const OptionGroup*> groups;
  std::set<std::string> seen;
  for (const auto& info : strategies()) {
    for (const auto& group : info.options) {
      if (seen.insert(group.name).second) groups.push_back(&group);
    }
  }
  return groups;
}

// Whether the flag bound in `a` holds another value than the same flag bound in `b`.
bool differs(const Flag& a, const Flag& b) {
  return std::visit(
      [&](auto* value) {
        using Pointer = std::decay_t<decltype(value)>;
        return *value != *std::get<Pointer>(b.target);
      },
      a.target);
}

// Flags of groups that no strategy of the run lists, set away from their defaults (by flag or
// config file): a mistake the run would otherwise hide (--outer-lr under ddp trains as if it
// were not there). `running`: the strategies of the run.
void refuse_flags_of_other_strategies(StrategyOptions& options,
                                      const std::vector<const StrategyInfo*>& running) {
  StrategyOptions defaults;
  for (const OptionGroup* group : option_groups()) {
    const bool listed = std::any_of(running.begin(), running.end(), [&](const StrategyInfo* s) {
      return std::any_of(s->options.begin(), s->options.end(),
                         [&](const OptionGroup& g) { return g.name == group->name; });
    });
    if (listed) continue;
    FlagSet given, fresh;
    group->declare(given, options);
    group->declare(fresh, defaults);
    for (size_t i = 0; i < given.flags().size(); ++i) {
      if (!differs(given.flags()[i], fresh.flags()[i])) continue;
      std::vector<std::string> owners;
      bool pipeline = false;
      for (const auto& info : strategies()) {
        for (const auto& g : info.options) {
          if (g.name != group->name) continue;
          if (info.pipelines) {
            pipeline = true;
          } else {
            owners.push_back(info.name);
          }
        }
      }
      const std::string whose = pipeline ? std::string("a pipeline's (--pipeline-parallel > 1)")
                                         : concat("--strategy ", joined(owners, " or "), "'s");
      DTRAIN_THROW(InputError, given.flags()[i].name, " is ", whose, " option; this run (",
                   running.front()->name, ") would not use it: leave it out");
    }
  }
}

}  // namespace

const std::deque<StrategyInfo>& strategies() { return registry().all(); }

std::vector<std::string> strategy_names() { return registry().names(); }

const StrategyInfo& strategy_info(const std::string& name) { return registry().at(name); }

void register_strategy(StrategyInfo info) {
  DTRAIN_CHECK_INPUT(info.make, "register_strategy: a strategy needs a factory");
  registry().add(std::move(info));
}

int replica_ranks(const StrategyOptions& options, const Layout& layout) {
  const StrategyInfo& info = strategy_info(layout.strategy);
  if (info.replica_ranks) return info.replica_ranks(options, layout);
  return layout.tensor_parallel * layout.pipeline_parallel *
         options.of<ft::FaultToleranceOptions>().replica_shards;
}

comm::GridOrder grid_order(const StrategyOptions& options) {
  return options.of<ft::FaultToleranceOptions>().replicas() ? comm::GridOrder::kTpPpDp
                                                            : comm::GridOrder::kTpDpPp;
}

StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options) {
  return strategy_info(name).make(options);
}

void declare_strategy_flags(FlagSet& flags, StrategyOptions& options) {
  for (const OptionGroup* group : option_groups()) group->declare(flags, options);
}

std::string resolve_strategy(const Layout& layout, StrategyOptions& options) {
  const StrategyInfo& named = strategy_info(layout.strategy);
  // Every strategy's options are checked, used or not: a typo in a flag of another strategy is
  // still a typo.
  for (const OptionGroup* group : option_groups()) {
    if (group->check) group->check(options);
  }
  DTRAIN_CHECK_INPUT(layout.pipeline_parallel >= 1, "--pipeline-parallel must be >= 1, got ",
                     layout.pipeline_parallel);
  DTRAIN_CHECK_INPUT(layout.tensor_parallel >= 1, "--tensor-parallel must be >= 1, got ",
                     layout.tensor_parallel);
  if (named.check_layout) named.check_layout(options, layout);
  DTRAIN_CHECK_INPUT(layout.expert_parallel >= 1, "--expert-parallel must be >= 1, got ",
                     layout.expert_parallel);
  if (layout.expert_parallel > 1) {
    std::vector<std::string> splitting;
    for (const auto& info : strategies()) {
      if (info.expert_parallel) splitting.push_back(info.name);
    }
    DTRAIN_CHECK_INPUT(named.expert_parallel, "--expert-parallel is built for --strategy ",
                       joined(splitting, " or "), " so far, not ", named.name);
    DTRAIN_CHECK_INPUT(!options.of<ft::FaultToleranceOptions>().replicas(),
                       "--expert-parallel with --fault-tolerance replicas: not built (a "
                       "replacement replica would have to take its experts from its expert "
                       "data-parallel group)");
    DTRAIN_CHECK_INPUT(!options.of<zero::ZeroOverlapOptions>().param_gather,
                       "--overlap-param-gather with --expert-parallel: not built yet");
    DTRAIN_CHECK_INPUT(!layout.defer_eval,
                       "--defer-eval evaluates on rank 0 alone: with --expert-parallel every "
                       "rank of an expert group takes part in each forward");
  }
  DTRAIN_CHECK_INPUT(layout.context_parallel >= 1, "--context-parallel must be >= 1, got ",
                     layout.context_parallel);
  if (layout.context_parallel > 1) {
    std::vector<std::string> splitting;
    for (const auto& info : strategies()) {
      if (info.context_parallel) splitting.push_back(info.name);
    }
    DTRAIN_CHECK_INPUT(named.context_parallel, "--context-parallel is built for --strategy ",
                       joined(splitting, " or "), " so far, not ", named.name);
    DTRAIN_CHECK_INPUT(!options.of<ft::FaultToleranceOptions>().replicas(),
                       "--context-parallel with --fault-tolerance replicas: not built (every "
                       "forward is collective over the context group)");
    DTRAIN_CHECK_INPUT(!layout.defer_eval,
                       "--defer-eval evaluates on rank 0 alone: with --context-parallel every "
                       "rank of a context group takes part in each forward");
    DTRAIN_CHECK_INPUT(layout.stage_replicas.empty(),
                       "--context-parallel with --stage-replicas: not built");
  }
  if (options.of<ft::FaultToleranceOptions>().replicas() && !named.fault_tolerant) {
    std::vector<std::string> tolerant;
    for (const auto& info : strategies()) {
      if (info.fault_tolerant) tolerant.push_back(info.name);
    }
    DTRAIN_THROW(InputError, "--fault-tolerance replicas is built for --strategy ",
                 joined(tolerant, " or "), ", not ", named.name);
  }
  // Flags of a group the strategy does not list are refused where using them would be a
  // mistake the run would hide (ZeRO's overlap has nothing to overlap elsewhere).
  const bool lists_overlap =
      std::any_of(named.options.begin(), named.options.end(),
                  [](const OptionGroup& g) { return g.name == "zero-overlap"; });
  DTRAIN_CHECK_INPUT(!options.of<zero::ZeroOverlapOptions>().param_gather || lists_overlap,
                     "--overlap-param-gather overlaps the parameter all-gather of ZeRO-1/2's "
                     "sharded update: use --strategy zero1 or zero2 (with or without a pipeline), "
                     "not ",
                     named.name);
  const StrategyInfo* runs = &named;
  if (!named.pipelines && layout.pipeline_parallel > 1) {
    std::vector<std::string> stage_strategies;
    for (const auto& info : strategies()) {
      if (info.pipeline_stages) stage_strategies.push_back(info.name);
    }
    DTRAIN_CHECK_INPUT(named.pipeline_stages, "--pipeline-parallel combines with --strategy ",
                       joined(stage_strategies, " or "),
                       " (the data parallelism of each stage), "
                       "not ",
                       named.name,
                       " (it shards or moves the gradients and parameters "
                       "the micro-batches accumulate)");
    const auto pipeline = std::find_if(strategies().begin(), strategies().end(),
                                       [](const StrategyInfo& info) { return info.pipelines; });
    DTRAIN_CHECK(pipeline != strategies().end(), "no pipeline strategy is registered");
    pipeline->set_stage_strategy(options, named.name);
    if (pipeline->check_layout) pipeline->check_layout(options, layout);
    runs = &*pipeline;
  }
  std::vector<const StrategyInfo*> running = {&named};
  if (runs != &named) running.push_back(runs);
  if (named.inner_strategy) running.push_back(&strategy_info(named.inner_strategy(options)));
  refuse_flags_of_other_strategies(options, running);
  if (options.precision == "bf16-master") {
    std::vector<std::string> keeping;
    for (const auto& info : strategies()) {
      if (info.master_weights) keeping.push_back(info.name);
    }
    for (const StrategyInfo* info : running) {
      DTRAIN_CHECK_INPUT(info->master_weights, "--precision bf16-master is built for ",
                         joined(keeping, ", "), "; not for ", info->name,
                         " (use --precision bf16-mixed there)");
    }
    DTRAIN_CHECK_INPUT(!options.of<ft::FaultToleranceOptions>().replicas(),
                       "--precision bf16-master is not built for --fault-tolerance replicas yet "
                       "(a replacement takes the model, not master weights); use bf16-mixed");
  }
  DTRAIN_CHECK_INPUT(
      !layout.defer_eval || (runs->whole_model_on_rank0 && layout.tensor_parallel <= 1),
      "--defer-eval copies the whole model on rank 0: not with ", runs->name,
      layout.tensor_parallel > 1 ? " and tensor parallelism" : "",
      " (use a strategy that keeps the whole model on rank 0)");
  return runs->name;
}

}  // namespace dtrain::parallel
