// `dtrain plan --search`: every layout of the cluster's GPUs at a fixed global batch, the ones
// that fit ranked by predicted step time.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <functional>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Planner.h"
#include "plan/PlannedStrategies.h"

namespace dtrain::plan {

namespace pp = parallel::pipeline;

namespace {

std::vector<int> divisors(int64_t n, int64_t limit) {
  std::vector<int> out;
  for (int64_t d = 1; d <= std::min(n, limit); ++d) {
    if (n % d == 0) out.push_back(static_cast<int>(d));
  }
  return out;
}

/// The layout passes the planner's checks (dtrain train's rules for its strategy and schedule).
bool accepted(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  try {
    check_layout(model, cluster, layout);
    return true;
  } catch (const InputError&) {
    return false;
  }
}

/// Sequence parallelism applies to `layout`: tp > 1 dividing a sample's tokens, and dtrain train
/// takes it there (not with PipeDream's eager sync, not with zero3: check_layout says).
/// The context-parallel sizes to try: 1, and for long sequences (or those --cp names) each size
/// whose zigzag divides the sequence (the ring, inside the data-parallel ranks).
std::vector<int> context_parallel_sizes(const ModelCost& model, const SearchOptions& options) {
  std::vector<int> sizes{1};
  std::vector<int> tried = options.context_parallel;
  if (tried.empty() && model.heads > 0 && model.tokens_per_sample >= 8192) tried = {2, 4, 8, 16};
  for (int cp : tried) {
    if (cp > 1 && model.heads > 0 && model.tokens_per_sample % (2 * cp) == 0) sizes.push_back(cp);
  }
  return sizes;
}

bool sequence_parallel_fits(const ModelCost& model, const Cluster& cluster, const Layout& layout) {
  Layout with = layout;
  with.sequence_parallel = true;
  return accepted(model, cluster, with);
}

/// The pipeline schedules (and chunks per rank) to try with `pp` stages and `micro_batches`:
/// each of `names` as the registry describes it (interleaved ones at 2 chunks where the layers
/// allow and every deeper count the blocks divide into evenly, Megatron's rule blocks %
/// (pp x chunks) == 0; fixed-chunk ones at their count), those the builder accepts. With one
/// stage, one entry (the schedule does not matter).
std::vector<std::pair<std::string, int>> pipeline_schedules(const std::vector<std::string>& names,
                                                            int pp, int micro_batches, int layers,
                                                            int blocks) {
  if (pp == 1) return {{Layout{}.schedule, 1}};
  std::vector<std::pair<std::string, int>> out;
  auto add = [&](const std::string& name, int chunks) {
    if (chunks * pp > layers) return;
    try {
      pp::validate(pp::ScheduleSpec{name, pp, micro_batches, chunks});
      out.emplace_back(name, chunks);
    } catch (const InputError&) {
      // the builder's own rule (1F1B: M >= P; interleaved: M % P == 0)
    }
  };
  for (const std::string& name : names) {
    const pp::ScheduleInfo& info = pp::schedule_info(name);
    if (info.interleaves) {
      for (int chunks = 2; chunks * pp <= layers; ++chunks) {
        if (chunks == 2 || (blocks > 0 && blocks % (pp * chunks) == 0)) add(name, chunks);
      }
    } else {
      add(name, std::max(1, info.chunks));
    }
  }
  return out;
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
std::vector<Layout> step_variants(const ModelCost& model, const Cluster& cluster,
                                  const Layout& base, const SearchOptions& options) {
  std::vector<bool Layout::*> open;
  if (!options.sequence_parallel && sequence_parallel_fits(model, cluster, base)) {
    open.push_back(&Layout::sequence_parallel);
  }
  if (!options.tp_comm_overlap && base.tp > 1) open.push_back(&Layout::tp_comm_overlap);
  if (!options.overlap_param_gather && base.ep == 1 &&
      planned_strategy(base.strategy).cost.gathers_updated_shards()) {
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
    for (const Layout& v : step_variants(model, cluster, ranked[i].layout, options)) {
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
  const std::vector<std::string> strategies =
      options.strategies.empty() ? planned_strategies(true) : options.strategies;
  for (const std::string& name : strategies) planned_strategy(name);  // InputError: unknown
  const std::vector<std::string> schedules =
      options.schedules.empty() ? pp::schedule_names() : options.schedules;
  for (const std::string& name : schedules) pp::schedule_info(name);  // InputError: unknown
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
      // Only what the planner accepts: dtrain train's rules for the strategy, the schedule and
      // the sync (check_layout asks the registry), e.g. no zero2 stages, no flush-free zero1.
      if (accepted(model, cluster, layout)) layouts.push_back(layout);
    }
  };
  const std::vector<int> context_sizes = context_parallel_sizes(model, options);
  // Tensor parallelism stays inside a node (its all-reduces are on every layer's critical
  // path: Narayanan et al.'s first takeaway).
  for (int tp : divisors(gpus, splits ? cluster.per_node() : 1)) {
    if (model.heads > 0 && model.heads % tp != 0) continue;
    if (model.kv_heads > 0 && model.kv_heads % tp != 0 && tp % model.kv_heads != 0) continue;
    for (int pp : divisors(gpus / tp, layers)) {
      for (int cp : context_sizes) {
        if ((gpus / (tp * pp)) % cp != 0) continue;
        const int dp = gpus / (tp * pp * cp);
        if (options.global_batch % dp != 0) continue;
        const int64_t per_replica = options.global_batch / dp;
        for (int mbs : divisors(per_replica, options.max_micro_batch_size)) {
          const int micro_batches = static_cast<int>(per_replica / mbs);
          if (pp > 1 && micro_batches < pp) continue;  // stages idle through a whole step
          for (const auto& [schedule, chunks] :
               pipeline_schedules(schedules, pp, micro_batches, layers, blocks)) {
            for (const std::string& strategy : strategies) {
              const parallel::StrategyInfo& info = planned_strategy(strategy);
              // At one replica every strategy's step is the all-reducing one's: try that once.
              if (dp == 1 && info.cost.traffic != parallel::StepCost::Traffic::kAllReduce) continue;
              for (const std::string& sync : options.pipeline_syncs) {
                if (sync != "flush" && pp == 1) continue;  // (a sync of pipeline stages)
                // A mixture of experts' experts over every split of the data-parallel ranks
                // that divides them (torchtitan's and Megatron's rule: EP inside DP).
                for (int ep : divisors(dp, std::max(1, model.experts))) {
                  if (model.experts > 0 && model.experts % ep != 0) continue;
                  if (ep > 1 && cp > 1) continue;  // (not searched together yet)
                  add(mbs, micro_batches, [&](Layout& layout) {
                    layout.strategy = strategy;
                    layout.dp = dp;
                    layout.pp = pp;
                    layout.tp = tp;
                    layout.ep = ep;
                    layout.cp = cp;
                    layout.schedule = schedule;
                    layout.chunks = chunks;
                    layout.pipeline_sync = sync;
                    layout.sequence_parallel = options.sequence_parallel.value_or(true) &&
                                               sequence_parallel_fits(model, cluster, layout);
                    // (dtrain train overlaps no parameter gathers with experts split yet.)
                    layout.overlap_param_gather = options.overlap_param_gather.value_or(true) &&
                                                  info.cost.gathers_updated_shards() && ep == 1;
                    layout.tp_comm_overlap = options.tp_comm_overlap.value_or(true) && tp > 1;
                  });
                }
              }
            }
          }
        }
      }
    }
  }
  // PipeDream's layouts: P stages over the GPUs replicated unequally (the even splits are the
  // dp x pp grid's above), one data stream, a schedule that deals micro-batches to replicas
  // (1F1B), each strategy dtrain train replicates stages with (ddp).
  const auto replicable = std::find_if(schedules.begin(), schedules.end(), [](const auto& name) {
    return pp::schedule_info(name).build_replicated != nullptr;
  });
  if (options.replicated_stages && gpus <= 16 && replicable != schedules.end()) {
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
          for (const std::string& strategy : strategies) {
            add(mbs, micro_batches, [&](Layout& layout) {
              layout.strategy = strategy;
              layout.schedule = *replicable;
              layout.pp = stages;
              layout.stage_replicas = counts;
            });
          }
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
  std::vector<Layout> offloaded;  // layouts that do not fit, with the optimizer's state moved out
  const Hardware& hw = cluster.hardware;
  const bool host = options.allow_offload && !hw.shared_cores && hw.host_link_Bps > 0 &&
                    hw.host_memory_bandwidth_Bps > 0 && hw.host_memory_bytes > 0;
  const bool disk = options.allow_offload && hw.disk_read_Bps > 0 && hw.disk_write_Bps > 0 &&
                    (hw.shared_cores || host);
  for (const Prediction& p : predictions) {
    if (result.smallest_memory < 0 || p.memory.total() < result.smallest_memory) {
      result.smallest_memory = p.memory.total();
    }
    if (p.fits) {
      result.ranked.push_back(p);
      continue;
    }
    if (planned_strategy(p.layout.strategy).server_optimizer) continue;
    for (const char* where : {"host", "disk"}) {
      if ((where[0] == 'h' && !host) || (where[0] == 'd' && !disk)) continue;
      Layout moved = p.layout;
      moved.offload = where;
      offloaded.push_back(moved);
    }
  }
  for (const Prediction& p : predict_all(model, cluster, offloaded)) {
    if (p.fits) result.ranked.push_back(p);
  }
  result.considered += static_cast<int>(offloaded.size());
  // Fastest first (to the nanosecond); of layouts as fast (zero1 and zero2 often are, but for
  // rounding), the one that needs less memory, then the first by its description: the same
  // answer whatever order they were made in.
  auto faster = [](const Prediction& a, const Prediction& b) {
    const long long ta = std::llround(a.step_s * 1e9), tb = std::llround(b.step_s * 1e9);
    if (ta != tb) return ta < tb;
    if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
    return a.layout.describe() < b.layout.describe();
  };
  std::sort(result.ranked.begin(), result.ranked.end(), faster);
  result.variants = refine(model, cluster, options, result.ranked);
  std::sort(result.ranked.begin(), result.ranked.end(), faster);
  return result;
}

}  // namespace dtrain::plan
