#include "parallel/ft/FaultTolerantDdp.h"

#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/common/Trace.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"

namespace dtrain::parallel::ft {

namespace {

void declare_flags(FlagSet& flags, FaultToleranceOptions& o) {
  flags.add("--fault-tolerance", o.mode,
            "ddp, zero1, zero2, diloco: none (a failed rank stops the job; --max-restarts "
            "restarts every rank from the newest checkpoint) or replicas (the other replicas go "
            "on without it at once, its share of the data dropped until a replacement joins; "
            "diloco: a replica is an island; --nproc or dtrain launch)");
  flags.add("--max-replacements", o.max_replacements,
            "--fault-tolerance replicas with --nproc: start a failed replica again up to this "
            "many times; it joins the others at a step's end with the state of one of them");
  flags.add("--replica-shards", o.replica_shards,
            "--fault-tolerance replicas with zero1/zero2: each replica is this many data-parallel "
            "ranks (x --tensor-parallel) that shard its optimizer state among themselves, the "
            "replicas holding copies (hybrid sharding); a rank that fails takes its replica out");
  flags.add("--shard-across-replicas", o.shard_across_replicas,
            "--fault-tolerance replicas with zero1: shard the optimizer state over all the "
            "replicas, each shard also kept by the next replica (a buddy copy, Gemini): 2/N of "
            "the state per rank instead of a whole copy; a failed replica's shard is taken over "
            "by its buddy and sent to its replacement");
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
  DTRAIN_CHECK_INPUT(o.replica_shards >= 1 && o.replica_shards <= 4096,
                     "--replica-shards must be in 1..4096, got ", o.replica_shards);
  const FaultToleranceOptions defaults;
  DTRAIN_CHECK_INPUT(o.replicas() || (o.max_replacements == defaults.max_replacements &&
                                      o.heartbeat_timeout_s == defaults.heartbeat_timeout_s &&
                                      o.replica_shards == defaults.replica_shards &&
                                      !o.shard_across_replicas),
                     "--max-replacements, --replica-heartbeat-timeout, --replica-shards and "
                     "--shard-across-replicas apply with --fault-tolerance replicas, which this run "
                     "does not have");
  DTRAIN_CHECK_INPUT(!o.shard_across_replicas || o.replica_shards == 1,
                     "--shard-across-replicas shards the state over every replica; "
                     "--replica-shards shards it inside each: choose one");
}

}  // namespace

OptionGroup fault_tolerance_options() {
  return option_group<FaultToleranceOptions>("fault-tolerance", declare_flags, check_flags);
}

void check_fault_tolerance_layout(const StrategyOptions& options, const Layout& layout) {
  const auto& o = options.of<FaultToleranceOptions>();
  if (!o.replicas()) return;
  DTRAIN_CHECK_INPUT(
      o.replica_shards == 1 || layout.strategy == "zero1" || layout.strategy == "zero2",
      "--replica-shards ", o.replica_shards,
      ": a replica's ranks shard the optimizer state with --strategy zero1 or "
      "zero2, not ",
      layout.strategy);
  DTRAIN_CHECK_INPUT(!o.shard_across_replicas || layout.strategy == "zero1",
                     "--shard-across-replicas shards zero1's optimizer state over the replicas; "
                     "it is built for --strategy zero1, not ",
                     layout.strategy);
  DTRAIN_CHECK_INPUT(!o.shard_across_replicas ||
                         (layout.tensor_parallel == 1 && layout.pipeline_parallel == 1),
                     "--shard-across-replicas is built for replicas of one rank: leave out "
                     "--tensor-parallel and --pipeline-parallel (or use --replica-shards)");
  DTRAIN_CHECK_INPUT(layout.stage_replicas.empty(),
                     "--fault-tolerance replicas: a replica is a whole pipeline; --stage-replicas "
                     "replicates stages inside one: leave it out");
  const int replica = o.replica_shards * layout.tensor_parallel * layout.pipeline_parallel;
  DTRAIN_CHECK_INPUT(
      layout.ranks == 0 || layout.ranks % replica == 0,
      "--fault-tolerance replicas: ", layout.ranks, " ranks do not divide into replicas of ",
      layout.pipeline_parallel > 1 ? concat("--pipeline-parallel ", layout.pipeline_parallel, " x ")
                                   : std::string(),
      o.replica_shards > 1 ? concat("--replica-shards ", o.replica_shards, " x ") : std::string(),
      "--tensor-parallel ", layout.tensor_parallel);
  DTRAIN_CHECK_INPUT(!layout.defer_eval,
                     "--fault-tolerance replicas evaluates on the leading replica alone: leave out "
                     "--defer-eval");
}

FaultTolerantDdp::FaultTolerantDdp(StrategyOptions options)
    : DdpStrategy(std::move(options)), ReplicaMemberStrategy(options_, scaler_ != nullptr) {}

void FaultTolerantDdp::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                             std::shared_ptr<comm::ProcessGrid> grid) {
  DdpStrategy::setup(std::move(model), make_optimizer, std::move(grid));
  DTRAIN_CHECK(grid_->pp_size() == 1 && !grid_->replicated_stages(),
               "FaultTolerantDdp: a pipeline's replicas are FaultTolerantPipeline's");
  // (broadcast_initial_state left a replacement's state to the admission.)
  join_when_replacing(grid_->tp_size());
}

void FaultTolerantDdp::broadcast_initial_state() {
  // The replica group forms here; a replacement's heartbeat runs while it waits to be admitted.
  form_replica_group(grid_->world(), grid_->tp_size());
  if (!replacement_) DdpStrategy::broadcast_initial_state();
}

ReplicaState FaultTolerantDdp::replica_state() {
  ReplicaState state;
  state.values = parameters_;
  for (const auto& b : model_.module->buffers()) state.values.push_back(b);
  state.optimizers.push_back({optimizer_.get(), parameters_});
  return state;
}

void FaultTolerantDdp::sum_gradients(StepResult& result) {
  const int replicas = mean_over_replicas(member_->manager(), parameters_, result.loss);
  // Sequence parallelism: what each TP rank holds of a replicated parameter's gradient is a
  // part; the replica's TP group sums them (as ddp does after its reduction).
  tp_.sum_partial_gradients(reduced_gradient_holders(), names_);
  result.metrics["replicas"] = replicas;
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
    sum_gradients(result);
    result.metrics["regroupings"] = static_cast<double>(member_->manager().regroupings());
  }
  trace::Span span("optimizer", "step");
  if (options_.max_grad_norm > 0) result.grad_norm = clip_gradients(options_.max_grad_norm);
  apply_update();
  result.metrics["step_skipped"] = 0.0;
  return result;
}

}  // namespace dtrain::parallel::ft
