#include "dtrain/parallel/ddp/Buckets.h"

#include <algorithm>
#include <map>

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

}  // namespace dtrain::parallel::ddp
