// One template behind dtrain's registries (strategies, models, data sets, federated
// aggregators): entries found by name, built-in ones first, more added by code outside the
// library. An unknown name is an InputError naming the flag and every registered name; a name
// registered twice is refused.
#pragma once

#include <deque>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/common/Error.h"

namespace dtrain {

/// Entries of type Info (each has a `std::string name`). Lookups and registration lock; an
/// entry keeps its address once added (a deque), so references to it stay valid.
template <typename Info>
class Registry {
 public:
  /// `kind` names an entry in messages ("strategy"), `flag` the option that names one
  /// ("--strategy"); `built_in` are the library's own entries, in order.
  Registry(std::string kind, std::string flag, std::vector<Info> built_in)
      : kind_(std::move(kind)),
        flag_(std::move(flag)),
        entries_(built_in.begin(), built_in.end()) {}

  /// Every entry, built-in ones first. Register before a run starts: iterating this while
  /// another thread adds an entry is not safe.
  const std::deque<Info>& all() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_;
  }

  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& info : entries_) out.push_back(info.name);
    return out;
  }

  /// nullptr for an unknown name.
  const Info* find(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& info : entries_) {
      if (info.name == name) return &info;
    }
    return nullptr;
  }

  /// InputError "<flag>: unknown <kind> 'name' (available: a, b or c)" for an unknown name.
  const Info& at(const std::string& name) const {
    if (const Info* info = find(name)) return *info;
    DTRAIN_THROW(InputError, flag_, ": unknown ", kind_, " '", name,
                 "' (available: ", joined(names(), " or "), ")");
  }

  /// Adds an entry; InputError when its name is empty or taken.
  void add(Info info) {
    DTRAIN_CHECK_INPUT(!info.name.empty(), "registering a ", kind_, ": it needs a name");
    DTRAIN_CHECK_INPUT(find(info.name) == nullptr, "registering a ", kind_, ": one named '",
                       info.name, "' is registered already");
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back(std::move(info));
  }

  /// "a, b or c" (`last` between the last two).
  static std::string joined(const std::vector<std::string>& names, const char* last) {
    std::string out;
    for (size_t i = 0; i < names.size(); ++i) {
      if (i > 0) out += i + 1 == names.size() ? last : ", ";
      out += names[i];
    }
    return out;
  }

 private:
  std::string kind_;
  std::string flag_;
  mutable std::mutex mutex_;
  std::deque<Info> entries_;
};

}  // namespace dtrain
