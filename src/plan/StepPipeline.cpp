// The planner's pipeline part: one replica's step through the schedule builder's action lists
// and its simulator, with each stage's costs, the time an activation or a gradient takes to
// reach the next stage, and (--overlap-param-gather) the update's all-gathers each forward
// waits for.
#include <algorithm>
#include <vector>

#include "plan/StepModel.h"

namespace dtrain::plan {

namespace pp = parallel::pipeline;

namespace {

/// DualPipe-V's pair of a forward on virtual stage `f` and a backward (with its W) on `b`, on two
/// threads: each one's expert all-to-alls run while the other computes (DeepSeek-V3's overlap of
/// one micro-batch's exchange with another's compute), hidden as far as that compute lasts. The
/// time the pair saves against running the two one after the other.
double pair_hidden(const Step& step, int f, int b) {
  const double f_exchange = step.stage_alltoall[f], b_exchange = step.stage_alltoall[b];
  const double f_compute = step.stage_f[f] - f_exchange, b_compute = step.stage_b[b] - b_exchange;
  return std::min(f_exchange, b_compute) + std::min(b_exchange, f_compute);
}

/// What each action costs on its stage, and what its result takes to reach the next rank.
pp::ActionCosts stage_costs(const Step& step) {
  pp::ActionCosts costs;
  costs.duration = [&step](int rank, const pp::Action& a) {
    const int s = step.vstage(a.chunk, rank);
    // (A pair is a forward of one of the rank's two chunks with a backward of the other; the
    // simulator runs it as one piece, the sum of its actions' durations: the forward's carries
    // what the pair hides.)
    if (a.kind == pp::Action::Forward && a.overlapped) {
      return step.stage_f[s] - pair_hidden(step, s, step.vstage(1 - a.chunk, rank));
    }
    if (a.kind == pp::Action::Forward) return step.stage_f[s];
    if (a.kind == pp::Action::Weight) return step.stage_w[s];
    return step.stage_b[s] - step.stage_w[s];
  };
  costs.transfer = [&step](int from, int to, const pp::Action& a) {
    const int s = step.vstage(a.chunk, to);
    const int boundary =
        a.kind == pp::Action::Forward ? step.partition.first(s) - 1 : step.partition.end(s) - 1;
    const double elements =
        step.model.layers[std::max(0, boundary)].output_elements * step.layout.micro_batch_size;
    const int per_node = step.cluster.per_node();
    auto node = [&](int rank) {  // (a slot is a world rank: replicated stages have tp 1)
      return step.replicated ? rank / per_node : step.place.node_of(rank, 0, 0);
    };
    // Every rank of a node sends its stage's activations at once: each gets its share of the
    // node's network.
    const Link link = node(from) == node(to) ? step.hw.intra_node
                                             : Link{step.hw.inter_node.latency_s,
                                                    step.hw.inter_node.bandwidth_Bps / per_node};
    return elements * step.bytes.activation / link.bandwidth_Bps + link.latency_s;
  };
  return costs;
}

/// --overlap-param-gather: the update's all-gathers run at the start of the step, bucket after
/// bucket in the layers' order (chunk 0's first) on the rank's data-parallel link; a chunk's
/// first forward waits until each of its buckets is in when its layers come: it starts no
/// earlier than max over its buckets of (gathered by - forward time of the layers before).
/// Per slot and chunk, that earliest start; `gathered`: per slot, the gathers' total.
std::vector<std::vector<double>> gather_releases(const Step& step, std::vector<double>& gathered) {
  std::vector<std::vector<double>> release(step.slots, std::vector<double>(step.V, 0.0));
  for (int r = 0; r < step.slots; ++r) {
    const int D = step.replicas_of(r);
    if (D <= 1) continue;
    const Link dp_link = step.place.group_link(step.layout.tp, D);
    double total = 0;
    for (int c = 0; c < step.V; ++c) {
      const int s = step.vstage(c, r);
      const int first = step.partition.first(s);
      auto buckets = step.buckets[s];
      for (auto& bucket : buckets) std::sort(bucket.begin(), bucket.end());
      std::sort(buckets.begin(), buckets.end());
      for (const auto& bucket : buckets) {
        double bucket_params = 0;
        for (size_t k : bucket) bucket_params += step.local_params[first + k];
        total += ring_half(bucket_params * step.bytes.parameter, D, dp_link);
        double before = 0;
        for (int i = first; i < first + static_cast<int>(bucket.front()); ++i) {
          before += step.times[i].forward;
        }
        release[r][c] = std::max(release[r][c], total - before);
      }
    }
    gathered[r] = total;
  }
  return release;
}

}  // namespace

double Timeline::compute_end(const Step& step, int slot) const {
  if (step.flush_free) return steady_step;
  return simulation.ends[slot].empty() ? 0 : simulation.ends[slot].back();
}

double Timeline::busy(int slot) const {
  double total = 0;
  for (size_t k = 0; k < simulation.ends[slot].size(); ++k) {
    total += simulation.ends[slot][k] - simulation.starts[slot][k];
  }
  return total;
}

Timeline simulate_pipeline(const Step& step) {
  Timeline out;
  pp::ActionCosts costs = stage_costs(step);
  out.gathered.assign(step.slots, 0.0);
  out.overlaps_gathers =
      step.layout.overlap_param_gather && step.strategy.cost.gathers_updated_shards();
  std::vector<std::vector<double>> release;
  if (out.overlaps_gathers) {
    release = gather_releases(step, out.gathered);
    costs.release = [&release](int rank, const pp::Action& a) {
      return a.kind == pp::Action::Forward && a.micro_batch == 0 ? release[rank][a.chunk] : 0.0;
    };
  }
  out.simulation = pp::simulate(step.spec, step.lists, costs);
  // What the gathers' waits added to the schedule (counted as exposed communication, not as
  // the pipeline's bubble): the same schedule without them.
  if (out.overlaps_gathers) {
    pp::ActionCosts unreleased = costs;
    unreleased.release = nullptr;
    out.gather_exposed = std::max(
        0.0, out.simulation.makespan - pp::simulate(step.spec, step.lists, unreleased).makespan);
  }
  // PipeDream's flush-free steps: one step of an endless 1F1B stream costs what M more
  // micro-batches add to a long flushed one (the marginal step), every rank busy as in a
  // flushed step.
  if (step.flush_free) {
    auto makespan_of = [&](int steps) {
      pp::ScheduleSpec longer = step.spec;
      longer.micro_batches = steps * step.spec.micro_batches;
      std::vector<std::vector<pp::Action>> stream;
      for (int r = 0; r < step.P; ++r) stream.push_back(pp::build_schedule(longer, r));
      return pp::simulate(longer, stream, costs).makespan;
    };
    out.steady_step = makespan_of(3) - makespan_of(2);
  }
  return out;
}

}  // namespace dtrain::plan
