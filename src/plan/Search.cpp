// `dtrain plan --search`: every layout of the cluster's GPUs at a fixed global batch, the ones
// that fit ranked by predicted step time.
#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::plan {

namespace {

std::vector<int> divisors(int64_t n, int64_t limit) {
  std::vector<int> out;
  for (int64_t d = 1; d <= std::min(n, limit); ++d) {
    if (n % d == 0) out.push_back(static_cast<int>(d));
  }
  return out;
}

/// Sequence parallelism applies: tp > 1 dividing a sample's tokens, not PipeDream's eager sync
/// (dtrain train refuses it there).
bool sequence_parallel_fits(const ModelCost& model, int tp, const std::string& sync) {
  return tp > 1 && model.tokens_per_sample % tp == 0 && sync != "eager";
}

/// Every layout simulated on every core (an exception: a layout the enumeration should not
/// have made).
std::vector<Prediction> predict_all(const ModelCost& model, const Cluster& cluster,
                                    const std::vector<Layout>& layouts) {
  std::vector<Prediction> predictions(layouts.size());
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> failures(layouts.size());
  auto work = [&] {
    for (size_t i = next++; i < layouts.size(); i = next++) {
      try {
        predictions[i] = predict(model, cluster, layouts[i]);
      } catch (...) {
        failures[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  const unsigned count = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  for (unsigned t = 0; t < count; ++t) threads.emplace_back(work);
  for (auto& thread : threads) thread.join();
  for (const auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
  return predictions;
}

/// `base` with each step option that applies to it and is not pinned set both ways (every
/// other combination than `base`'s own).
std::vector<Layout> step_variants(const ModelCost& model, const Layout& base,
                                  const SearchOptions& options) {
  std::vector<bool Layout::*> open;
  if (!options.sequence_parallel && sequence_parallel_fits(model, base.tp, base.pipeline_sync)) {
    open.push_back(&Layout::sequence_parallel);
  }
  if (!options.tp_comm_overlap && base.tp > 1) open.push_back(&Layout::tp_comm_overlap);
  if (!options.overlap_param_gather && (base.strategy == "zero1" || base.strategy == "zero2")) {
    open.push_back(&Layout::overlap_param_gather);
  }
  std::vector<Layout> variants;
  for (unsigned mask = 0; mask < (1u << open.size()); ++mask) {
    Layout v = base;
    for (size_t i = 0; i < open.size(); ++i) v.*open[i] = (mask >> i) & 1u;
    bool same = true;
    for (bool Layout::*field : open) same = same && v.*field == base.*field;
    if (!same) variants.push_back(v);
  }
  return variants;
}

/// The `options.refine` fastest of `ranked` again with every combination of the step options the
/// search decides (each usually helps, but it moves the stages' balance and the pipeline's
/// timing, so not always): each keeps its fastest variant that fits. Returns the variants run.
int refine(const ModelCost& model, const Cluster& cluster, const SearchOptions& options,
           std::vector<Prediction>& ranked) {
  std::vector<Layout> variants;
  std::vector<size_t> owner;
  for (size_t i = 0; i < std::min(ranked.size(), options.refine); ++i) {
    for (const Layout& v : step_variants(model, ranked[i].layout, options)) {
      variants.push_back(v);
      owner.push_back(i);
    }
  }
  const std::vector<Prediction> refinements = predict_all(model, cluster, variants);
  for (size_t k = 0; k < refinements.size(); ++k) {
    Prediction& kept = ranked[owner[k]];
    if (refinements[k].fits && refinements[k].step_s < kept.step_s) kept = refinements[k];
  }
  return static_cast<int>(variants.size());
}

}  // namespace

SearchResult search(const ModelCost& model, const Cluster& cluster, const SearchOptions& options) {
  DTRAIN_CHECK_INPUT(options.global_batch > 0, "--search needs a global batch > 0");
  SearchResult result;
  std::vector<Layout> layouts;
  const int gpus = cluster.gpus();
  const int layers = static_cast<int>(model.layers.size());
  const bool splits = std::any_of(model.layers.begin(), model.layers.end(),
                                  [](const Layer& l) { return l.tensor_parallel; });
  const bool attention = std::any_of(model.layers.begin(), model.layers.end(),
                                     [](const Layer& l) { return l.attention_saved_elements > 0; });
  // A transformer's blocks (what deeper interleaving divides); 0 for other models.
  const int blocks = static_cast<int>(std::count_if(model.layers.begin(), model.layers.end(),
                                                    [](const Layer& l) { return l.block; }));
  // A layout of `micro_batches` x `mbs` per replica, without recomputation and (when allowed)
  // with checkpointing of every layer and, for models with attention, selective recomputation;
  // the search's precision and optimizer; `set` fills the parallelism.
  enum Recompute { kNone, kFull, kSelective };
  auto add = [&](int mbs, int64_t micro_batches, const std::function<void(Layout&)>& set) {
    for (Recompute recompute : {kNone, kFull, kSelective}) {
      if (recompute != kNone && !options.allow_checkpointing) continue;
      if (recompute == kSelective && !attention) continue;
      Layout layout;
      layout.micro_batch_size = mbs;
      layout.micro_batches = static_cast<int>(micro_batches);
      layout.precision = options.precision;
      layout.optimizer = options.optimizer;
      layout.checkpointing = recompute == kFull;
      layout.selective_recompute = recompute == kSelective;
      set(layout);
      layouts.push_back(layout);
    }
  };
  // Tensor parallelism stays inside a node (its all-reduces are on every layer's critical
  // path: Narayanan et al.'s first takeaway).
  for (int tp : divisors(gpus, splits ? cluster.per_node() : 1)) {
    if (model.heads > 0 && model.heads % tp != 0) continue;
    if (model.kv_heads > 0 && model.kv_heads % tp != 0 && tp % model.kv_heads != 0) continue;
    for (int pp : divisors(gpus / tp, layers)) {
      const int dp = gpus / (tp * pp);
      if (options.global_batch % dp != 0) continue;
      const int64_t per_replica = options.global_batch / dp;
      for (int mbs : divisors(per_replica, options.max_micro_batch_size)) {
        const int micro_batches = static_cast<int>(per_replica / mbs);
        std::vector<std::pair<std::string, int>> schedules = {{"1f1b", 1}};
        if (pp > 1) {
          if (micro_batches < pp) continue;  // 1F1B cannot fill its warm-up
          // Interleaved: 2 chunks per rank where the layers allow, and every deeper count the
          // blocks divide into evenly (Megatron's rule: blocks % (pp x chunks) == 0).
          if (micro_batches % pp == 0) {
            for (int chunks = 2; chunks * pp <= layers; ++chunks) {
              if (chunks == 2 || (blocks > 0 && blocks % (pp * chunks) == 0)) {
                schedules.push_back({"interleaved", chunks});
              }
            }
          }
        }
        for (const auto& [schedule, chunks] : schedules) {
          for (const std::string& strategy : options.strategies) {
            // dtrain's pipeline stages are data-parallel by ddp or zero1.
            if ((strategy == "zero3" || strategy == "zero2") && pp > 1) continue;
            if (dp == 1 && strategy != "ddp") continue;  // nothing to shard
            for (const std::string& sync : options.pipeline_syncs) {
              // PipeDream's flush-free steps: 1F1B with ddp replicas.
              if (sync != "flush" && (pp == 1 || schedule != "1f1b" || strategy != "ddp")) {
                continue;
              }
              add(mbs, micro_batches, [&](Layout& layout) {
                layout.strategy = strategy;
                layout.dp = dp;
                layout.pp = pp;
                layout.tp = tp;
                layout.schedule = schedule;
                layout.chunks = chunks;
                layout.pipeline_sync = sync;
                layout.sequence_parallel = options.sequence_parallel.value_or(true) &&
                                           sequence_parallel_fits(model, tp, sync);
                layout.overlap_param_gather = options.overlap_param_gather.value_or(true) &&
                                              (strategy == "zero1" || strategy == "zero2");
                layout.tp_comm_overlap = options.tp_comm_overlap.value_or(true) && tp > 1;
              });
            }
          }
        }
      }
    }
  }
  // PipeDream's layouts: P stages over the GPUs replicated unequally (the even splits are the
  // dp x pp grid's above), one data stream, 1F1B with ddp.
  if (options.replicated_stages && gpus <= 16 &&
      options.strategies.end() !=
          std::find(options.strategies.begin(), options.strategies.end(), "ddp")) {
    for (int stages = 2; stages <= std::min({4, layers, gpus}); ++stages) {
      std::vector<int> counts(stages, 1);
      counts.back() = gpus - (stages - 1);
      // Every composition of the GPUs into `stages` counts >= 1, in lexicographic order.
      while (true) {
        const bool even =
            std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts.front(); });
        const int most = *std::max_element(counts.begin(), counts.end());
        for (int mbs : divisors(options.global_batch, options.max_micro_batch_size)) {
          const int64_t micro_batches = options.global_batch / mbs;
          if (even || micro_batches < std::max(stages, most)) continue;
          add(mbs, micro_batches, [&](Layout& layout) {
            layout.pp = stages;
            layout.stage_replicas = counts;
          });
        }
        // The next composition: move one from the last count into the one before the rightmost
        // count that can give (all but the last are >= 1 and grow; the last takes the rest).
        int k = stages - 2;
        while (k >= 0 && counts.back() == 1) {
          counts.back() += counts[k] - 1;
          counts[k] = 1;
          --k;
        }
        if (k < 0) break;
        ++counts[k];
        --counts.back();
      }
    }
  }
  // Simulate them on every core; rank those that fit.
  result.considered = static_cast<int>(layouts.size());
  const std::vector<Prediction> predictions = predict_all(model, cluster, layouts);
  result.smallest_memory = -1;
  for (const Prediction& p : predictions) {
    if (result.smallest_memory < 0 || p.memory.total() < result.smallest_memory) {
      result.smallest_memory = p.memory.total();
    }
    if (p.fits) result.ranked.push_back(p);
  }
  auto faster = [](const Prediction& a, const Prediction& b) { return a.step_s < b.step_s; };
  std::sort(result.ranked.begin(), result.ranked.end(), faster);
  result.variants = refine(model, cluster, options, result.ranked);
  std::sort(result.ranked.begin(), result.ranked.end(), faster);
  return result;
}

}  // namespace dtrain::plan
