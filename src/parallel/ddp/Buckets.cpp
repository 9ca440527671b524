#include "dtrain/parallel/ddp/Buckets.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ddp {

std::string module_of(const std::string& parameter_name) {
  const auto dot = parameter_name.rfind('.');
  return dot == std::string::npos ? std::string() : parameter_name.substr(0, dot);
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketedParameter>& parameters,
                                                const BucketRule& rule) {
  std::vector<std::vector<size_t>> groups;
  std::vector<int64_t> group_bytes;
  std::map<int, size_t> open;  // dtype -> group index
  for (size_t k = parameters.size(); k-- > 0;) {
    auto it = open.find(parameters[k].dtype);
    if (it == open.end()) {
      groups.emplace_back();
      group_bytes.push_back(0);
      it = open.emplace(parameters[k].dtype, groups.size() - 1).first;
    }
    const size_t index = it->second;
    groups[index].push_back(k);
    group_bytes[index] += parameters[k].bytes;
    const int64_t cap = index == 0 ? std::min(rule.first_bucket_cap_bytes, rule.bucket_cap_bytes)
                                   : rule.bucket_cap_bytes;
    if (group_bytes[index] >= cap) open.erase(it);
  }
  // The first layer's gradients arrive last, when backward is over: nothing hides their
  // allreduce. When the rest of their bucket is at least as large as they are, give them a
  // bucket of their own: the rest then launches while the first layer's backward still runs,
  // halving (or better) the exposed tail for the price of one more, overlapped, collective.
  if (rule.isolate_first_layer && !groups.empty()) {
    auto bytes_of = [&](auto begin, auto end) {
      int64_t total = 0;
      for (auto it = begin; it != end; ++it) total += parameters[*it].bytes;
      return total;
    };
    for (auto& group : groups) {
      if (group.back() != 0) continue;  // the bucket holding parameter 0
      const std::string& first_module = parameters[0].module;
      auto split = std::find_if(group.begin(), group.end(),
                                [&](size_t k) { return parameters[k].module == first_module; });
      const bool contiguous = std::all_of(
          split, group.end(), [&](size_t k) { return parameters[k].module == first_module; });
      if (split != group.begin() && contiguous &&
          bytes_of(group.begin(), split) >= bytes_of(split, group.end())) {
        std::vector<size_t> tail(split, group.end());
        group.erase(split, group.end());
        groups.push_back(std::move(tail));
      }
      break;
    }
  }
  return groups;
}

ShardLayout shard_layout(const std::vector<int64_t>& numels,
                         const std::vector<std::vector<size_t>>& groups, int ranks) {
  DTRAIN_CHECK(ranks >= 1, "shard_layout: ranks must be >= 1, got ", ranks);
  std::vector<std::vector<size_t>> sorted = groups;
  for (auto& group : sorted) std::sort(group.begin(), group.end());
  sorted.erase(std::remove_if(sorted.begin(), sorted.end(),
                              [](const std::vector<size_t>& g) { return g.empty(); }),
               sorted.end());
  std::sort(sorted.begin(), sorted.end());
  ShardLayout layout;
  layout.parameter_offset.assign(numels.size(), 0);
  layout.bucket_of.assign(numels.size(), 0);
  size_t next = 0;
  for (auto& group : sorted) {
    DTRAIN_CHECK(group.front() == next && group.back() - group.front() + 1 == group.size(),
                 "shard_layout: buckets must be contiguous runs covering parameters 0..",
                 numels.size(), " once; a bucket starts at ", group.front(), " where ", next,
                 " was expected");
    ShardedBucket bucket;
    bucket.flat_begin = layout.flat_numel;
    for (size_t k : group) {
      layout.parameter_offset[k] = layout.flat_numel + bucket.numel;
      layout.bucket_of[k] = layout.buckets.size();
      bucket.numel += numels[k];
    }
    bucket.part = (bucket.numel + ranks - 1) / ranks;
    bucket.shard_offset = layout.shard_numel;
    bucket.parameters = std::move(group);
    layout.flat_numel += bucket.part * ranks;
    layout.shard_numel += bucket.part;
    next = bucket.parameters.back() + 1;
    layout.buckets.push_back(std::move(bucket));
  }
  DTRAIN_CHECK(next == numels.size(), "shard_layout: the buckets cover parameters 0..", next,
               " of ", numels.size());
  return layout;
}

}  // namespace dtrain::parallel::ddp
