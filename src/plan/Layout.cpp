// A planner layout's own words: its rank count, its one-line description, the dtrain train
// flags that run it, and the check of what a layout may be (check_layout).
#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Planner.h"
#include "plan/PlannedStrategies.h"

namespace dtrain::plan {

namespace pp = parallel::pipeline;

const parallel::StrategyInfo& planned_strategy(const std::string& name) {
  const std::vector<std::string> modelled = planned_strategies(false);
  const auto named = [&] {
    std::string text;
    for (const std::string& m : modelled) text += concat(text.empty() ? "" : ", ", m);
    return text;
  };
  if (std::find(modelled.begin(), modelled.end(), name) == modelled.end()) {
    const std::vector<std::string> known = parallel::strategy_names();
    const bool registered = std::find(known.begin(), known.end(), name) != known.end();
    DTRAIN_THROW(InputError,
                 registered ? "the planner does not model strategy '" : "unknown strategy '", name,
                 "' (it models ", named(), ")");
  }
  return parallel::strategy_info(name);
}

std::vector<std::string> planned_strategies(bool synchronous) {
  std::vector<std::string> names;
  for (const parallel::StrategyInfo& info : parallel::strategies()) {
    if (!info.cost.modelled()) continue;
    if (synchronous && info.cost.traffic == parallel::StepCost::Traffic::kParameterServer) continue;
    names.push_back(info.name);
  }
  return names;
}

int Layout::ranks() const {
  if (stage_replicas.empty()) return dp * cp * pp * tp;
  int slots = 0;
  for (int r : stage_replicas) slots += r;
  return slots * tp;
}

namespace {
bool is_one_of(const std::string& value, std::initializer_list<const char*> choices) {
  for (const char* choice : choices) {
    if (value == choice) return true;
  }
  return false;
}

std::string joined_counts(const std::vector<int>& counts) {
  std::string text;
  for (size_t i = 0; i < counts.size(); ++i) text += concat(i ? "," : "", counts[i]);
  return text;
}
}  // namespace

std::string Layout::describe() const {
  std::string text = concat(strategy, " dp", dp, " pp", pp, " tp", tp);
  if (!stage_replicas.empty()) {
    text = concat(strategy, " pp", pp, " replicas ", joined_counts(stage_replicas), " tp", tp);
  }
  if (ep > 1) text += concat(" ep", ep);
  if (cp > 1) text += concat(" cp", cp, cp_method == "ring" ? "" : " " + cp_method);
  if (pp > 1) text += concat(" ", schedule, chunks > 1 ? concat("x", chunks) : std::string());
  if (pp > 1 && pipeline_sync != "flush") text += concat(" ", pipeline_sync);
  text += concat(" mb", micro_batch_size, "x", micro_batches, " ", precision);
  if (checkpointing) {
    text += " ckpt";
  } else if (selective_recompute) {
    text += " selective";
  }
  if (sequence_parallel) text += " sp";
  if (overlap_param_gather && planned_strategy(strategy).cost.gathers_updated_shards()) {
    text += " ovl";
  }
  if (tp_comm_overlap && tp > 1) text += " tpo";
  if (offload != "none") text += " offload-" + offload;
  return text;
}

namespace {

/// The flags of `l`'s parallelism after --strategy; `global`: the global batch instead of the
/// micro-batches (the same step: --global-batch sets the micro-batches).
std::string parallel_flags(const Layout& l, int layers, bool global) {
  std::string text;
  if (l.tp > 1) text += concat(" --tensor-parallel ", l.tp);
  if (l.ep > 1) text += concat(" --expert-parallel ", l.ep);
  if (l.cp > 1) {
    text += concat(" --context-parallel ", l.cp);
    if (l.cp_method != "ring") text += concat(" --cp-method ", l.cp_method);
  }
  if (!l.stage_replicas.empty()) {
    text += concat(" --stage-replicas ", joined_counts(l.stage_replicas));
  } else if (l.pp > 1) {
    text += concat(" --pipeline-parallel ", l.pp);
  }
  if (l.pp > 1) {
    text += concat(" --schedule ", l.schedule, " --pipeline-balance time");
    if (pp::schedule_info(l.schedule).interleaves) text += concat(" --virtual-stages ", l.chunks);
    if (l.pipeline_sync != "flush") text += concat(" --pipeline-sync ", l.pipeline_sync);
  }
  text += concat(" --batch-size ", l.micro_batch_size);
  text += global && l.stage_replicas.empty() ? concat(" --global-batch ", l.global_batch())
                                             : concat(" --micro-batches ", l.micro_batches);
  text += concat(" --precision ", l.precision);
  if (l.checkpointing) {
    text += concat(" --checkpointing ", layers);
  } else if (l.selective_recompute) {
    text += " --checkpointing selective";
  }
  if (l.sequence_parallel) text += " --sequence-parallel";
  if (l.overlap_param_gather && planned_strategy(l.strategy).cost.gathers_updated_shards()) {
    text += " --overlap-param-gather";
  }
  if (l.tp_comm_overlap && l.tp > 1) text += " --tp-comm-overlap";
  if (l.offload == "host") text += " --offload optimizer";
  if (l.offload == "disk") text += " --offload optimizer:<a folder on the local disk>";
  return text;
}

}  // namespace

std::string Layout::train_flags(int layers) const {
  return concat("--nproc ", ranks(), " --strategy ", strategy,
                parallel_flags(*this, layers, false));
}

std::string Layout::command(const ModelCost& model, const Cluster& cluster) const {
  const std::string launch =
      cluster.nodes > 1 ? concat("dtrain launch --nnodes ", cluster.nodes, " --nproc-per-node ",
                                 cluster.per_node(), " --node-rank <0..", cluster.nodes - 1,
                                 "> --master-addr <node 0's address> -- dtrain train")
                        : concat("dtrain train --nproc ", cluster.per_node());
  const bool gpus = !cluster.hardware.shared_cores;
  return concat(launch, " ", model.train_flags.empty() ? "--model <yours>" : model.train_flags,
                " --dataset <yours>", gpus ? " --device cuda --backend nccl" : "", " --strategy ",
                strategy, parallel_flags(*this, static_cast<int>(model.layers.size()), true));
}

namespace {

/// What dtrain train refuses of the layout, asked of the strategy registry as train asks it
/// (parallel::resolve_strategy): the strategy's own rules (zero3 without sequence parallelism,
/// parameter-server workers without pp or tp, bf16-master only where master weights are kept)
/// and the pipeline's (which strategies make its stages data-parallel, the schedules and syncs
/// they run, replicated stages).
void check_as_train_does(const ModelCost& model, const Layout& layout) {
  parallel::Layout run;
  run.tied_parameters = model.tied_embeddings;
  run.strategy = layout.strategy;
  run.ranks = layout.ranks();
  run.pipeline_parallel = layout.pp;
  run.tensor_parallel = layout.tp;
  run.expert_parallel = layout.ep;
  run.context_parallel = layout.cp;
  run.stage_replicas = layout.stage_replicas;
  run.sequence_parallel = layout.sequence_parallel;
  run.micro_batches = layout.micro_batches;
  parallel::StrategyOptions options;
  options.precision = layout.precision;
  auto& pipeline = options.of<pp::PipelineOptions>();
  pipeline.schedule = layout.schedule;
  pipeline.virtual_stages = layout.chunks;
  pipeline.sync = layout.pipeline_sync;
  parallel::resolve_strategy(run, options);
}

}  // namespace

void check_layout(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  planned_strategy(layout.strategy);  // (InputError: one the planner does not model)
  DTRAIN_CHECK_INPUT(is_one_of(layout.precision, {"fp32", "bf16-mixed", "fp16-mixed", "bf16",
                                                  "bf16-master", "fp16-master"}),
                     "unknown precision '", layout.precision,
                     "' (fp32, bf16-mixed, fp16-mixed, bf16, bf16-master, fp16-master)");
  DTRAIN_CHECK_INPUT(is_one_of(layout.optimizer, {"adam", "sgd", "momentum"}),
                     "unknown optimizer '", layout.optimizer, "' (adam, sgd, momentum)");
  const Hardware& hw = cluster.hardware;
  DTRAIN_CHECK_INPUT(is_one_of(layout.offload, {"none", "host", "disk"}), "unknown offload '",
                     layout.offload, "' (none, host, disk)");
  DTRAIN_CHECK_INPUT(layout.offload != "host" || !hw.shared_cores, "offload host: on ", hw.name,
                     " the ranks' memory is the host's already "
                     "(offload disk moves the optimizer's state out of it)");
  DTRAIN_CHECK_INPUT(
      layout.offload == "none" || hw.shared_cores ||
          (hw.host_memory_bandwidth_Bps > 0 && hw.host_link_Bps > 0 && hw.host_memory_bytes > 0),
      "offload ", layout.offload, ": profile ", hw.name,
      " gives no node.host_memory_gib, node.host_memory_bandwidth_gb_s and "
      "node.host_link_gb_s to predict it by");
  DTRAIN_CHECK_INPUT(layout.offload != "disk" || (hw.disk_read_Bps > 0 && hw.disk_write_Bps > 0),
                     "offload disk: profile ", hw.name,
                     " gives no node.disk_read_gb_s and node.disk_write_gb_s to predict it by");
  DTRAIN_CHECK_INPUT(
      layout.dp >= 1 && layout.pp >= 1 && layout.tp >= 1 && layout.ep >= 1 && layout.cp >= 1,
      "dp, pp, tp, ep and cp must be >= 1");
  if (layout.cp > 1) {
    DTRAIN_CHECK_INPUT(model.heads > 0, "context parallelism ", layout.cp, ": model ", model.name,
                       " has no attention over a sequence");
    DTRAIN_CHECK_INPUT(model.tokens_per_sample % (2 * layout.cp) == 0, "context parallelism ",
                       layout.cp, " cuts the ", model.tokens_per_sample,
                       " tokens of a sample into ", 2 * layout.cp,
                       " chunks (the zigzag): they must divide them");
    DTRAIN_CHECK_INPUT(is_one_of(layout.cp_method, {"ring", "allgather", "ulysses"}),
                       "unknown context-parallel method '", layout.cp_method,
                       "' (ring, allgather, ulysses)");
    DTRAIN_CHECK_INPUT(layout.cp_method != "ulysses" || (model.heads / layout.tp) % layout.cp == 0,
                       "ulysses hands the ", model.heads / layout.tp,
                       " attention heads of a tensor-parallel rank out over cp ", layout.cp,
                       ": it must divide them");
    DTRAIN_CHECK_INPUT(
        !layout.sequence_parallel || (model.tokens_per_sample / layout.cp) % layout.tp == 0,
        "sequence parallelism splits a context-parallel rank's ",
        model.tokens_per_sample / layout.cp, " tokens over tp ", layout.tp,
        ": it must divide them");
  }
  if (layout.ep > 1) {
    DTRAIN_CHECK_INPUT(model.experts > 0, "expert parallelism ", layout.ep, ": model ", model.name,
                       " has no mixture of experts");
    DTRAIN_CHECK_INPUT(model.experts % layout.ep == 0, "expert parallelism ", layout.ep,
                       " does not divide the model's ", model.experts, " experts");
    DTRAIN_CHECK_INPUT(layout.dp % layout.ep == 0 && layout.stage_replicas.empty(),
                       "expert parallelism ", layout.ep, " must divide the data-parallel size ",
                       layout.dp, " (the experts are split over data-parallel ranks)");
    DTRAIN_CHECK_INPUT(!layout.overlap_param_gather ||
                           !planned_strategy(layout.strategy).cost.gathers_updated_shards(),
                       "overlap-param-gather with expert parallelism: dtrain train does not "
                       "overlap them yet");
  }
  DTRAIN_CHECK_INPUT(layout.micro_batch_size >= 1 && layout.micro_batches >= 1,
                     "micro-batch size and micro-batches must be >= 1");
  DTRAIN_CHECK_INPUT(layout.ranks() == cluster.gpus(), "layout ", layout.describe(),
                     " uses dp x cp x pp x tp = ", layout.ranks(), " ranks, the cluster has ",
                     cluster.gpus(), " GPUs (", cluster.nodes, " nodes x ", cluster.per_node(),
                     ")");
  if (model.heads > 0) {
    DTRAIN_CHECK_INPUT(model.heads % layout.tp == 0, "tensor parallelism ", layout.tp,
                       " does not divide the model's ", model.heads, " attention heads");
  }
  if (model.kv_heads > 0) {
    DTRAIN_CHECK_INPUT(model.kv_heads % layout.tp == 0 || layout.tp % model.kv_heads == 0,
                       "tensor parallelism ", layout.tp, " and the model's ", model.kv_heads,
                       " key/value heads: one must divide the other");
  }
  DTRAIN_CHECK_INPUT(!layout.sequence_parallel || model.tokens_per_sample % layout.tp == 0,
                     "sequence parallelism splits the ", model.tokens_per_sample,
                     " tokens of a sample over tp ", layout.tp, ": it must divide them");
  const bool splits = std::any_of(model.layers.begin(), model.layers.end(),
                                  [](const Layer& l) { return l.tensor_parallel; });
  DTRAIN_CHECK_INPUT(layout.tp == 1 || splits, "model ", model.name,
                     " has no tensor-parallel layers: tp must be 1");
  DTRAIN_CHECK_INPUT(!layout.selective_recompute ||
                         std::any_of(model.layers.begin(), model.layers.end(),
                                     [](const Layer& l) { return l.attention_saved_elements > 0; }),
                     "selective recomputation recomputes attention's core: model ", model.name,
                     " has no attention");
  DTRAIN_CHECK_INPUT(!layout.sequence_parallel || layout.tp > 1,
                     "sequence parallelism needs tp > 1");
  check_as_train_does(model, layout);
  const int virtual_stages = layout.pp * layout.chunks;
  DTRAIN_CHECK_INPUT(static_cast<int>(model.layers.size()) >= virtual_stages, "model ", model.name,
                     " has ", model.layers.size(),
                     " layers, fewer than pp x chunks = ", virtual_stages, " stages");
  if (layout.pp > 1) {
    pp::ScheduleSpec spec{layout.schedule, layout.pp, layout.micro_batches, layout.chunks};
    pp::validate(spec);  // the builder's own rules (1F1B: M >= P; interleaved: M % P == 0)
    DTRAIN_CHECK_INPUT(layout.pipeline_sync != "eager" || !layout.sequence_parallel,
                       "pipeline sync eager with sequence parallelism: dtrain train refuses it "
                       "(its late gradients would be partial sums over the TP group)");
  } else {
    DTRAIN_CHECK_INPUT(layout.chunks == 1, "chunks > 1 needs an interleaved pipeline");
  }
  if (!layout.stage_replicas.empty()) {
    DTRAIN_CHECK_INPUT(static_cast<int>(layout.stage_replicas.size()) == layout.pp && layout.pp > 1,
                       "layout ", layout.describe(), ": one replica count per stage, pp > 1");
    // (Which strategy, schedule and sync replicated stages run: check_as_train_does.)
    DTRAIN_CHECK_INPUT(layout.dp == 1, "replicated stages run one data stream: dp 1");
    pp::ScheduleSpec spec{layout.schedule, layout.pp, layout.micro_batches, 1,
                          layout.stage_replicas};
    pp::validate(spec);  // a micro-batch per replica at least
  }
}

}  // namespace dtrain::plan
