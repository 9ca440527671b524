// --fault-tolerance's flag group (shared by ddp, zero1, zero2 and diloco) and its layout rule:
// the policy of replicas that outlive each other, apart from the strategies that carry it.
#include "parallel/ft/FaultToleranceFlags.h"

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
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
  DTRAIN_CHECK_INPUT(
      o.replicas() || (o.max_replacements == defaults.max_replacements &&
                       o.heartbeat_timeout_s == defaults.heartbeat_timeout_s &&
                       o.replica_shards == defaults.replica_shards && !o.shard_across_replicas),
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
  DTRAIN_CHECK_INPUT(
      !o.shard_across_replicas || (layout.tensor_parallel == 1 && layout.pipeline_parallel == 1),
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

}  // namespace dtrain::parallel::ft
