// A planner layout's own words: its rank count, its one-line description and the dtrain train
// flags that run it.
#include <string>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {

int Layout::ranks() const {
  if (stage_replicas.empty()) return dp * pp * tp;
  int slots = 0;
  for (int r : stage_replicas) slots += r;
  return slots * tp;
}

namespace {
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
  if (pp > 1) text += concat(" ", schedule, chunks > 1 ? concat("x", chunks) : std::string());
  if (pp > 1 && pipeline_sync != "flush") text += concat(" ", pipeline_sync);
  text += concat(" mb", micro_batch_size, "x", micro_batches, " ", precision);
  if (checkpointing) {
    text += " ckpt";
  } else if (selective_recompute) {
    text += " selective";
  }
  if (sequence_parallel) text += " sp";
  if (overlap_param_gather && (strategy == "zero1" || strategy == "zero2")) text += " ovl";
  if (tp_comm_overlap && tp > 1) text += " tpo";
  return text;
}

std::string Layout::train_flags(int layers) const {
  std::string text = concat("--nproc ", ranks(), " --strategy ", strategy);
  if (tp > 1) text += concat(" --tensor-parallel ", tp);
  if (!stage_replicas.empty()) {
    text += concat(" --stage-replicas ", joined_counts(stage_replicas));
  } else if (pp > 1) {
    text += concat(" --pipeline-parallel ", pp);
  }
  if (pp > 1) {
    text += concat(" --schedule ", schedule, " --pipeline-balance time");
    if (schedule == "interleaved") text += concat(" --virtual-stages ", chunks);
    if (pipeline_sync != "flush") text += concat(" --pipeline-sync ", pipeline_sync);
  }
  text += concat(" --batch-size ", micro_batch_size, " --micro-batches ", micro_batches,
                 " --precision ", precision);
  if (checkpointing) {
    text += concat(" --checkpointing ", layers);
  } else if (selective_recompute) {
    text += " --checkpointing selective";
  }
  if (sequence_parallel) text += " --sequence-parallel";
  if (overlap_param_gather && (strategy == "zero1" || strategy == "zero2")) {
    text += " --overlap-param-gather";
  }
  if (tp_comm_overlap && tp > 1) text += " --tp-comm-overlap";
  return text;
}

}  // namespace dtrain::plan
