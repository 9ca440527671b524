// The planner's memory part: what each slot (a pipeline rank, or a replica of a replicated
// stage) keeps during a step, as its strategy declares it shards and copies the model's state.
#include <algorithm>
#include <vector>

#include "plan/StepModel.h"

namespace dtrain::plan {

std::vector<Memory> slot_memory(const Step& step, const Timeline& timeline) {
  const ModelCost& model = step.model;
  const Layout& layout = step.layout;
  const int P = layout.pp, V = layout.chunks;
  const double b = layout.micro_batch_size;
  const parallel::StrategyInfo& strategy = step.strategy;
  const parallel::StepCost& cost = strategy.cost;
  std::vector<Memory> memory;
  for (int r = 0; r < step.slots; ++r) {
    Memory m;
    double params = 0, experts = 0, saved = 0, boundary = 0, largest_saved = 0, largest_layer = 0;
    for (int c = 0; c < V; ++c) {
      const int s = step.vstage(c, r);
      for (int i = step.partition.first(s); i < step.partition.end(s); ++i) {
        const Layer& l = model.layers[i];
        const double split = l.tensor_parallel ? layout.tp : 1;
        params += step.local_params[i];
        experts += step.local_expert_params[i];
        const double replicated = layout.sequence_parallel ? l.replicated_saved_elements / split
                                                           : l.replicated_saved_elements;
        const double dropped = layout.selective_recompute ? l.attention_saved_elements : 0;
        const double layer_saved =
            (l.saved_elements - l.replicated_saved_elements - dropped) / split + replicated;
        saved += layer_saved;
        boundary += l.output_elements / (layout.sequence_parallel ? split : 1);
        largest_saved = std::max(largest_saved, layer_saved);
        largest_layer = std::max(largest_layer, step.local_params[i]);
      }
    }
    // A pipeline's last stage keeps its own copy of the tied embedding.
    if (P > 1 && step.vstage(0, r) == P - 1 && model.layers.front().name == "embedding" &&
        model.layers.back().name == "head") {
      params += step.local_params.front();
    }
    const double in_flight =
        P > 1 ? std::max(1.0, timeline.simulation.peak_live[r] / static_cast<double>(V)) : 1.0;
    // What the strategy shards keeps 1/DP of it (a mixture of experts' experts 1 / (DP / EP):
    // their shards span the ranks holding the same experts); its copies as it declares them.
    const double sharded = step.replicas_of(r);
    const auto kept = [&](bool shards) {
      return shards ? step.sharded_share(params, experts, r) : params;
    };
    m.parameters = cost.parameter_copies * kept(strategy.shards_parameters) * step.bytes.parameter;
    // PipeDream's weight versions: 2bw two, async up to one per micro-batch in flight and one.
    if (step.flush_free) m.parameters *= layout.pipeline_sync == "async" ? P - r + 1 : 2;
    m.gradients = cost.gradient_copies * kept(cost.shards_gradients) * step.bytes.gradient;
    // (The parameter server's optimizer lives on its shards.)
    m.optimizer =
        strategy.server_optimizer ? 0.0 : kept(cost.shards_optimizer) * step.bytes.optimizer;
    m.activations =
        b * step.bytes.activation *
        (layout.checkpointing ? in_flight * boundary + largest_saved : in_flight * saved);
    m.buffers = cost.layer_buffers * largest_layer * step.bytes.parameter +
                cost.bucket_buffers * static_cast<double>(layout.bucket_cap_bytes);
    // Setup, in fp32: zero3 draws only its shard (and one parameter at a time: bounded by the
    // largest layer's); a pipeline rank of a decoder (drawn by parameter name) only its own
    // stages; every other layout builds each parameter it holds a part of (a pipeline rank of
    // another model every stage: its stages are cut from the whole model). zero3 with master
    // weights holds its 16-bit shard beside the fp32 master it was rounded from (until the first
    // step moves the master into an offload file).
    constexpr double kBuilt = 4;
    const bool master = layout.precision == "bf16-master" || layout.precision == "fp16-master";
    if (strategy.draws_deferred && P == 1) {
      m.setup = params * (kBuilt + (master ? step.bytes.parameter : 0)) / sharded +
                largest_layer * kBuilt;
    } else if (P > 1 && model.heads > 0) {
      m.setup = params * kBuilt;
    } else {
      double built = 0;
      for (size_t i = 0; i < model.layers.size(); ++i) built += step.local_params[i];
      m.setup = built * kBuilt;
    }
    // Offload: the optimizer's state leaves the device; ZeRO-Offload keeps fp32 master weights
    // beside it in host memory.
    if (layout.offload == "host") {
      m.host = m.optimizer + kept(cost.shards_optimizer) * kBuilt;
      m.optimizer = 0;
    } else if (layout.offload == "disk") {
      m.disk = m.optimizer;
      m.optimizer = 0;
    }
    memory.push_back(m);
  }
  return memory;
}

}  // namespace dtrain::plan
