// `dtrain plan --search`: every layout of the cluster's GPUs at a fixed global batch, the ones
// that fit ranked by predicted step time.
#include <algorithm>
#include <atomic>
#include <exception>
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

}  // namespace

SearchResult search(const ModelCost& model, const Cluster& cluster, const SearchOptions& options) {
  DTRAIN_CHECK_INPUT(options.global_batch > 0, "--search needs a global batch > 0");
  SearchResult result;
  std::vector<Layout> layouts;
  const int gpus = cluster.gpus();
  const int layers = static_cast<int>(model.layers.size());
  const bool splits = std::any_of(model.layers.begin(), model.layers.end(),
                                  [](const Layer& l) { return l.tensor_parallel; });
  // Tensor parallelism stays inside a node (its all-reduces are on every layer's critical
  // path: Narayanan et al.'s first takeaway).
  for (int tp : divisors(gpus, splits ? cluster.per_node() : 1)) {
    if (model.heads > 0 && model.heads % tp != 0) continue;
    for (int pp : divisors(gpus / tp, layers)) {
      const int dp = gpus / (tp * pp);
      if (options.global_batch % dp != 0) continue;
      const int64_t per_replica = options.global_batch / dp;
      for (int mbs : divisors(per_replica, options.max_micro_batch_size)) {
        const int micro_batches = static_cast<int>(per_replica / mbs);
        std::vector<std::pair<std::string, int>> schedules = {{"1f1b", 1}};
        if (pp > 1) {
          if (micro_batches < pp) continue;  // 1F1B cannot fill its warm-up
          if (micro_batches % pp == 0 && layers >= 2 * pp) schedules.push_back({"interleaved", 2});
        }
        for (const auto& [schedule, chunks] : schedules) {
          for (const std::string& strategy : options.strategies) {
            if (strategy == "zero3" && pp > 1) continue;
            if (dp == 1 && strategy != "ddp") continue;  // nothing to shard
            for (const std::string& sync : options.pipeline_syncs) {
              // PipeDream's flush-free steps: 1F1B with ddp replicas.
              if (sync != "flush" && (pp == 1 || schedule != "1f1b" || strategy != "ddp")) {
                continue;
              }
              for (bool checkpointing : {false, true}) {
                if (checkpointing && !options.allow_checkpointing) continue;
                Layout layout;
                layout.strategy = strategy;
                layout.dp = dp;
                layout.pp = pp;
                layout.tp = tp;
                layout.micro_batch_size = mbs;
                layout.micro_batches = micro_batches;
                layout.schedule = schedule;
                layout.chunks = chunks;
                layout.pipeline_sync = sync;
                layout.precision = options.precision;
                layout.optimizer = options.optimizer;
                layout.checkpointing = checkpointing;
                layout.sequence_parallel = options.sequence_parallel && tp > 1;
                layouts.push_back(layout);
              }
            }
          }
        }
      }
    }
  }
  // Simulate them on every core.
  result.considered = static_cast<int>(layouts.size());
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
    if (failure) std::rethrow_exception(failure);  // a layout the enumeration should not make
  }
  result.smallest_memory = -1;
  for (const Prediction& p : predictions) {
    if (result.smallest_memory < 0 || p.memory.total() < result.smallest_memory) {
      result.smallest_memory = p.memory.total();
    }
    if (p.fits) result.ranked.push_back(p);
  }
  std::sort(result.ranked.begin(), result.ranked.end(),
            [](const Prediction& a, const Prediction& b) { return a.step_s < b.step_s; });
  return result;
}

}  // namespace dtrain::plan
