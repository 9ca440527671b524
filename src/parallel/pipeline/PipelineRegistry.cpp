// The pipeline strategy's registry entry: its flags, the checks of its options and of a
// layout (named before any rank starts), and how --strategy sets its data-parallel side.
#include <algorithm>
#include <string>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "parallel/ft/FaultTolerantPipeline.h"
#include "parallel/pipeline/PipelineStrategy.h"

namespace dtrain::parallel::pipeline {

namespace {

// Layouts that cannot work, named before any rank starts: P that does not divide the ranks, a
// schedule the micro-batches cannot fill, more stages than the model has, a tied weight.
void check_layout(const PipelineOptions& o, const Layout& layout) {
  const int pp = layout.pipeline_parallel;
  const int tp = layout.tensor_parallel;
  if (!layout.stage_replicas.empty()) {
    check_stage_replicas(o, layout.stage_replicas, tp, layout.micro_batches);
    int sum = 0;
    for (int r : layout.stage_replicas) sum += r;
    DTRAIN_CHECK_INPUT(layout.ranks == 0 || layout.ranks == sum, "--stage-replicas adds up to ",
                       sum, " ranks, but --nproc is ", layout.ranks);
  }
  DTRAIN_CHECK_INPUT(
      !layout.stage_replicas.empty() || layout.ranks == 0 || layout.ranks % (pp * tp) == 0,
      "--pipeline-parallel ", pp, tp > 1 ? concat(" x --tensor-parallel ", tp) : std::string(),
      " does not divide the ", layout.ranks,
      " ranks of --nproc (ranks = pipeline "
      "stages x data-parallel replicas)");
  const ScheduleInfo& schedule = schedule_info(o.schedule);
  const int chunks = chunks_of(o.schedule, o.virtual_stages);
  validate({o.schedule, pp, static_cast<int>(std::max<int64_t>(layout.micro_batches, 1)), chunks});
  // DualPipe-V's pairs run two chunks on two threads at once (each thread's collectives on a
  // lane of its own): a recomputation in one would set the state the other's forward reads.
  if (schedule.overlaps) {
    DTRAIN_CHECK_INPUT(!layout.recomputes_forward_state, "--schedule ", o.schedule,
                       " with --checkpointing of whole blocks and --dropout or "
                       "--reset-attention-mask: not built yet (a recomputation in one thread of a "
                       "pair would set the random generators or the documents the other's "
                       "forward reads; --checkpointing selective works)");
  }
  DTRAIN_CHECK_INPUT(!layout.tied_parameters,
                     "--tied-embeddings shares one weight between the first and the last "
                     "pipeline stage, which the pipeline does not support: leave it out");
  if (layout.model_stages == 0) return;
  const int virtual_stages = pp * chunks;
  DTRAIN_CHECK_INPUT(
      layout.model_stages >= virtual_stages, "--pipeline-parallel ", pp,
      schedule.chunks > 1 ? concat(" x ", chunks, " chunks of --schedule ", o.schedule)
      : chunks > 1        ? concat(" x --virtual-stages ", chunks)
                          : std::string(),
      " needs ", virtual_stages, " model stages, but --model ", layout.model, " has ",
      layout.model_stages, " (an MLP has one per hidden layer plus the output)");
  if (o.balance != "params" && o.balance != "time") {
    partition_from_counts(o.balance, layout.model_stages, virtual_stages);
  }
}

void declare_flags(FlagSet& flags, PipelineOptions& o) {
  flags.add("--schedule", o.schedule,
            "Pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v (zero bubble: "
            "backward split into input and weight gradients; zb-v runs two chunks per rank in a "
            "V) or dualpipev (zb-v's V, one chunk's forward run with the other's backward on two "
            "threads; M >= 2P), or one registered with register_schedule");
  flags.add("--virtual-stages", o.virtual_stages,
            "Interleaved schedule: model chunks per pipeline rank");
  flags.add("--pipeline-balance", o.balance,
            "Place pipeline stages by params (parameter count), time (measured forward + "
            "backward) or S1,S2,... (model stages per pipeline stage)");
  flags.add("--pipeline-sync", o.sync,
            "Pipeline weight updates: flush (drain every step: the single-process step), 2bw "
            "(PipeDream-2BW: no flush, two weight versions per stage, gradients one step "
            "stale), eager (2bw's pipeline, each stage updating as soon as its schedule next "
            "needs the weights: only the last P - 1 - s of stage s's M micro-batch gradients "
            "are a step stale; learns as flush does) or async (PipeDream: no flush, an update "
            "per micro-batch, each micro-batch's backward on its forward's weights); 2bw, "
            "eager and async: 1f1b, ddp, no clipping or fp16");
  flags.add("--weight-prediction", o.weight_prediction,
            "--pipeline-sync 2bw: the weights each batch computes on: none (the version before "
            "the newest: PipeDream-2BW's one-step-stale gradient) or extrapolate (that version "
            "moved on by its last step: an estimate of the weights the gradient updates; one "
            "more weight copy)");
  flags.add("--pipeline-transport", o.transport,
            "Pipeline activations and gradients travel through auto (shared memory between "
            "stages on the same machine, else the communicator) or comm (always the "
            "communicator)");
}

}  // namespace

void check_options(const PipelineOptions& o) {
  const ScheduleInfo& schedule = schedule_info(o.schedule);
  DTRAIN_CHECK_INPUT(o.virtual_stages >= 1, "virtual stages per pipeline rank must be >= 1, got ",
                     o.virtual_stages);
  DTRAIN_CHECK_INPUT(
      schedule.chunks == 0 || o.virtual_stages == 1 || o.virtual_stages == schedule.chunks,
      "--schedule ", o.schedule, " runs ", schedule.chunks,
      " chunks per rank: leave --virtual-stages out (or give ", schedule.chunks, "), not ",
      o.virtual_stages);
  DTRAIN_CHECK_INPUT(o.virtual_stages == 1 || schedule.interleaves || schedule.chunks > 0,
                     "--virtual-stages ", o.virtual_stages, " needs --schedule interleaved (",
                     o.schedule, " runs one chunk per rank)");
  DTRAIN_CHECK_INPUT(!schedule.interleaves || o.virtual_stages >= 2, "the ", o.schedule,
                     " schedule needs --virtual-stages >= 2 (with 1 it is 1f1b)");
  DTRAIN_CHECK_INPUT(o.data_parallel == "ddp" || o.data_parallel == "zero1",
                     "pipeline stages are data-parallel by ddp or zero1, not '", o.data_parallel,
                     "' (zero2 and zero3 shard the gradients and parameters that the "
                     "micro-batches accumulate)");
  DTRAIN_CHECK_INPUT(o.transport == "auto" || o.transport == "comm",
                     "unknown --pipeline-transport '", o.transport, "' (expected auto or comm)");
  DTRAIN_CHECK_INPUT(o.sync == "flush" || o.sync == "2bw" || o.sync == "eager" || o.sync == "async",
                     "unknown --pipeline-sync '", o.sync,
                     "' (expected flush, 2bw, eager or async)");
  DTRAIN_CHECK_INPUT(o.weight_prediction == "none" || o.weight_prediction == "extrapolate",
                     "unknown --weight-prediction '", o.weight_prediction,
                     "' (expected none or extrapolate)");
  DTRAIN_CHECK_INPUT(o.weight_prediction == "none" || o.sync == "2bw", "--weight-prediction ",
                     o.weight_prediction, " is for --pipeline-sync 2bw, not ", o.sync);
  DTRAIN_CHECK_INPUT(o.sync == "flush" || schedule.flush_free, "--pipeline-sync ", o.sync,
                     " runs 1F1B without a flush: use --schedule 1f1b, not ", o.schedule);
  DTRAIN_CHECK_INPUT(o.sync == "flush" || o.data_parallel == "ddp", "--pipeline-sync ", o.sync,
                     " replicates stages with ddp, not ", o.data_parallel);
  const std::string& balance = o.balance;
  DTRAIN_CHECK_INPUT(!balance.empty(), "--pipeline-balance is empty (params, time or S1,S2,...)");
  DTRAIN_CHECK_INPUT(balance == "params" || balance == "time" ||
                         balance.find_first_not_of("0123456789, ") == std::string::npos,
                     "unknown --pipeline-balance '", balance,
                     "' (expected params, time or stage counts S1,S2,...)");
}

void check_stage_replicas(const PipelineOptions& o, const std::vector<int>& replicas,
                          int tensor_parallel, int64_t micro_batches) {
  DTRAIN_CHECK_INPUT(chunks_of(o.schedule, o.virtual_stages) == 1,
                     "--stage-replicas runs one chunk per ",
                     "stage: --schedule gpipe, 1f1b, zb-h1 or zb-h2, not ", o.schedule);
  DTRAIN_CHECK_INPUT(o.sync == "flush", "--stage-replicas runs with --pipeline-sync flush, not ",
                     o.sync, " (its replicas take turns at the micro-batches of a flushed step)");
  DTRAIN_CHECK_INPUT(o.data_parallel == "ddp", "--stage-replicas replicates stages with ddp, not ",
                     o.data_parallel);
  DTRAIN_CHECK_INPUT(tensor_parallel == 1, "--stage-replicas with --tensor-parallel ",
                     tensor_parallel, " is not supported: leave one of them out");
  const int most = *std::max_element(replicas.begin(), replicas.end());
  DTRAIN_CHECK_INPUT(micro_batches == 0 || micro_batches >= most, "--stage-replicas gives a stage ",
                     most, " replicas but a step has ", micro_batches,
                     " micro-batches (--micro-batches: each replica needs one at least)");
}

StrategyInfo pipeline_strategy() {
  StrategyInfo info;
  info.name = "pipeline";
  info.master_weights = true;
  info.summary =
      "pipeline parallelism (GPipe, 1F1B, interleaved, zero bubble H1/H2/V, DualPipe-V), stages "
      "data-parallel";
  info.pipelines = true;
  info.whole_model_on_rank0 = false;
  info.draws_deferred = true;  // each rank draws its own stages' parameters
  info.expert_parallel = true;
  info.context_parallel = true;
  info.set_stage_strategy = [](StrategyOptions& options, const std::string& stage_strategy) {
    options.of<PipelineOptions>().data_parallel = stage_strategy;
  };
  info.options = {option_group<PipelineOptions>("pipeline", declare_flags, check_options)};
  info.check_layout = [](const StrategyOptions& options, const Layout& layout) {
    check_layout(options.of<PipelineOptions>(), layout);
    if (options.of<ft::FaultToleranceOptions>().replicas()) {
      ft::check_pipeline_replicas(options.of<PipelineOptions>());
    }
    // (The strategy checks the same; here they are named before any rank starts.)
    const std::string& sync = options.of<PipelineOptions>().sync;
    DTRAIN_CHECK_INPUT(sync == "flush" || options.max_grad_norm <= 0, "--pipeline-sync ", sync,
                       " updates each stage on its own: global-norm clipping "
                       "(--max-grad-norm) needs every stage's gradients at once; leave it out");
    DTRAIN_CHECK_INPUT(sync == "flush" || options.precision.rfind("fp16", 0) != 0,
                       "--pipeline-sync ", sync,
                       " updates each stage on its own: fp16's loss scaling needs a check over "
                       "every stage; use --precision fp32, bf16-mixed or bf16");
    DTRAIN_CHECK_INPUT(sync == "flush" || layout.expert_parallel == 1, "--pipeline-sync ", sync,
                       " with --expert-parallel: not built yet (use flush)");
    DTRAIN_CHECK_INPUT(sync == "flush" || layout.context_parallel == 1, "--pipeline-sync ", sync,
                       " with --context-parallel: not built yet (use flush)");
  };
  // --fault-tolerance replicas: each replica a whole pipeline (ft/FaultTolerantPipeline.h).
  info.make = [](const StrategyOptions& options) -> StrategyPtr {
    if (options.of<ft::FaultToleranceOptions>().replicas()) {
      return std::make_unique<ft::FaultTolerantPipeline>(options);
    }
    return std::make_unique<PipelineStrategy>(options);
  };
  return info;
}

}  // namespace dtrain::parallel::pipeline
