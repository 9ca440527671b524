// The strategy registry: each strategy's name, the loop that drives it, what it combines with,
// its own options (flags, config keys, checks) and its factory. The Trainer, Job and CLI ask
// the registry; none of them compares a strategy's name (scripts/check-layers enforces it).
//
// Adding a strategy: a folder under src/parallel/ with the strategy, its options struct and a
// function returning its StrategyInfo, plus one line in kBuiltIn (src/parallel/Strategies.cpp).
// Code outside the library (a test, a user's program) registers one with register_strategy.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/common/Flags.h"
#include "dtrain/common/Registry.h"
#include "dtrain/parallel/Strategy.h"

namespace dtrain::parallel {

/// Which of the Trainer's runners drives a strategy.
enum class Loop {
  /// Synchronous steps: every rank steps together (a collective per step).
  kSteps,
  /// Asynchronous worker steps, no per-step collective (implements AsynchronousWorker).
  kAsynchronous,
  /// The strategy runs its own loop (implements DrivenLoop).
  kDriven,
};

/// What a run looks like around the strategy: the rules of each strategy are checked against
/// it before any rank starts (Job) and again by the Trainer. Unknown parts stay at defaults.
struct Layout {
  /// --strategy as given.
  std::string strategy;
  /// Ranks of the run (0 = not known yet).
  int ranks = 0;
  int pipeline_parallel = 1;
  int tensor_parallel = 1;
  /// --expert-parallel: a mixture of experts' experts split over this many data-parallel ranks.
  int expert_parallel = 1;
  /// --context-parallel: each sequence split over this many data-parallel ranks.
  int context_parallel = 1;
  /// --stage-replicas (empty: every stage on dp ranks alike).
  std::vector<int> stage_replicas;
  /// --sequence-parallel, --tied-embeddings, --defer-eval.
  bool sequence_parallel = false;
  bool tied_parameters = false;
  bool defer_eval = false;
  /// --checkpointing of whole blocks with state the forward reads besides its input (random
  /// masks: --dropout; packed documents: --reset-attention-mask): a recomputation in backward
  /// sets that state again.
  bool recomputes_forward_state = false;
  /// Micro-batches per step (a pipeline's M).
  int64_t micro_batches = 1;
  /// The model's name and stage count (0 = not known).
  std::string model;
  int model_stages = 0;
};

/// Options shared by strategies that list the same group (the parameter-server connection of
/// Downpour and Sandblaster): declared once however many strategies use them.
struct OptionGroup {
  std::string name;
  /// The group's flags (also its config file's keys), bound into options.of<ItsOptions>().
  std::function<void(FlagSet&, StrategyOptions&)> declare;
  /// InputError naming the flag that is out of range (nullptr: nothing to check).
  std::function<void(const StrategyOptions&)> check;
};

/// The option group of one options struct T: `declare` binds its flags to a T, `check` its
/// values (nullptr: nothing to check).
template <typename T>
OptionGroup option_group(std::string name, void (*declare)(FlagSet&, T&),
                         void (*check)(const T&) = nullptr) {
  OptionGroup group;
  group.name = std::move(name);
  group.declare = [declare](FlagSet& flags, StrategyOptions& options) {
    declare(flags, options.of<T>());
  };
  if (check != nullptr) {
    group.check = [check](const StrategyOptions& options) { check(options.of<T>()); };
  }
  return group;
}

/// What `dtrain plan` needs to know of a strategy to predict its step and its memory, declared
/// beside the strategy: src/plan composes these declarations and compares no strategy's name.
struct StepCost {
  /// How a step's gradients and parameters travel between the data-parallel ranks.
  enum class Traffic {
    /// dtrain plan does not model the strategy (it says which it models).
    kNotModelled,
    /// The reducer's buckets all-reduced as backward produces them (ddp).
    kAllReduce,
    /// The buckets reduce-scattered into each rank's shard; after the sharded update the
    /// shards all-gathered, or with --overlap-param-gather into the next forward (zero1, 2).
    kReduceScatterGather,
    /// Each layer all-gathered before its forward and again before its backward (the next
    /// one prefetched), its gradients reduce-scattered as they are produced (zero3).
    kGatherEachLayer,
    /// Asynchronous workers push gradients to parameter-server shards and pull the parameters
    /// every step; the shards' optimizer updates (downpour).
    kParameterServer,
  };
  Traffic traffic = Traffic::kNotModelled;
  /// Each of D data-parallel ranks keeps 1/D of these (the parameters:
  /// StrategyInfo::shards_parameters).
  bool shards_gradients = false;
  bool shards_optimizer = false;
  /// Copies of the parameters and gradients a rank keeps (a Downpour worker: the model and the
  /// pulls' landing buffer; .grad, the accumulation and the push in flight).
  int parameter_copies = 1;
  int gradient_copies = 1;
  /// Buffers beside the model's state: of a bucket's size (zero2's reduce-scatter) and of the
  /// largest layer's parameters (zero3: the gathered one and the prefetched next).
  int bucket_buffers = 0;
  int layer_buffers = 0;

  bool modelled() const { return traffic != Traffic::kNotModelled; }
  /// The updated shards are all-gathered after the update (--overlap-param-gather applies).
  bool gathers_updated_shards() const { return traffic == Traffic::kReduceScatterGather; }
};

struct StrategyInfo {
  std::string name;
  /// One line for --help.
  std::string summary;
  Loop loop = Loop::kSteps;
  /// Can be the data parallelism of a pipeline's stages (--pipeline-parallel with it).
  bool pipeline_stages = false;
  /// The pipeline itself: it runs whenever --pipeline-parallel > 1, wrapping the --strategy
  /// that makes its stages data-parallel (set_stage_strategy records which).
  bool pipelines = false;
  std::function<void(StrategyOptions&, const std::string& stage_strategy)> set_stage_strategy;
  /// Rank 0 holds the whole model (so --defer-eval can copy it).
  bool whole_model_on_rank0 = true;
  /// Keeps only shards of the parameters once set up (Strategy::parameter_pieces()): initial
  /// weights from a file go into the shards after setup, each rank reading its own.
  bool shards_parameters = false;
  /// Takes a model whose parameters are placeholders (Model::deferred) and draws only the
  /// parts it keeps; the Trainer materializes such a model whole for the others.
  bool draws_deferred = false;
  /// Trains against parameter-server shards (--ps, or --ps-shards started by dtrain train).
  bool parameter_server = false;
  /// The shards apply the updates with their optimizer (their schedule runs by version).
  bool server_optimizer = false;
  /// Builds replicas that outlive each other with --fault-tolerance replicas.
  bool fault_tolerant = false;
  /// With --fault-tolerance replicas: the ranks of one replica (what fails and is replaced as
  /// one; consecutive world ranks). nullptr: --tensor-parallel x --replica-shards.
  std::function<int(const StrategyOptions&, const Layout&)> replica_ranks;
  /// What dtrain plan models of its step (default: not modelled).
  StepCost cost;
  /// Trains with --precision bf16-master (a bf16 model, fp32 master weights in its optimizer).
  bool master_weights = false;
  /// Trains a model whose experts are split over data-parallel ranks (--expert-parallel): the
  /// experts' gradients reduced over the expert data-parallel group, checkpoints by expert.
  bool expert_parallel = false;
  /// Trains a model whose sequences are split over data-parallel ranks (--context-parallel):
  /// its gradients averaged over the whole data-parallel group, context groups included, and
  /// every forward collective over the context group.
  bool context_parallel = false;
  /// Its options (groups shared with other strategies are declared once). A flag of a group
  /// that no strategy of the run lists, moved from its default, is refused naming the
  /// strategies that list it.
  std::vector<OptionGroup> options;
  /// The strategy it runs inside itself (DiLoCo's islands: --inner-strategy), whose options
  /// apply too (nullptr: none).
  std::function<std::string(const StrategyOptions&)> inner_strategy;
  /// InputError naming the flags when the layout does not suit the strategy (nullptr: any).
  std::function<void(const StrategyOptions&, const Layout&)> check_layout;
  std::function<StrategyPtr(const StrategyOptions&)> make;
};

/// A StrategyInfo::make for a strategy class constructed from the options.
template <typename S>
StrategyPtr make_from_options(const StrategyOptions& options) {
  return std::make_unique<S>(options);
}

/// Every registered strategy, built-in ones first.
const std::deque<StrategyInfo>& strategies();
std::vector<std::string> strategy_names();
/// InputError naming the available strategies for an unknown name.
const StrategyInfo& strategy_info(const std::string& name);
/// Adds a strategy (InputError when the name is taken); for code outside the library, before
/// any run starts (the registry is read without a lock afterwards).
void register_strategy(StrategyInfo info);

/// With --fault-tolerance replicas: the ranks of one replica of `layout.strategy`
/// (StrategyInfo::replica_ranks), what the launcher ends and starts again together.
int replica_ranks(const StrategyOptions& options, const Layout& layout);

/// How the run's ranks are laid out (ProcessGrid): with --fault-tolerance replicas each
/// data-parallel replica's ranks are consecutive (a pipeline's stages inside its replica), else
/// Megatron's default order.
comm::GridOrder grid_order(const StrategyOptions& options);

/// Builds a registered strategy by name; InputError for unknown names.
StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options);

/// Every strategy's flags, each group once, bound into `options`.
void declare_strategy_flags(FlagSet& flags, StrategyOptions& options);

/// Checks `layout.strategy` and its options against the layout (the strategy's own options and
/// rules, and the pipeline's when --pipeline-parallel > 1); returns the strategy that runs:
/// the one named, or the pipeline wrapping it, with `options` saying which makes its stages
/// data-parallel. InputError naming the flags. (What the strategy checks of the common options,
/// such as precision, its constructor checks: make_strategy with the result.)
std::string resolve_strategy(const Layout& layout, StrategyOptions& options);

}  // namespace dtrain::parallel
