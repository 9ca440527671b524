// Options of a registry entry's own (a strategy's, a model's or a data set's defined outside the
// library): one struct per type, kept beside the shared ones without their owner knowing it.
#pragma once

#include <any>
#include <map>
#include <typeindex>

namespace dtrain {

class OwnOptions {
 public:
  /// The entry's own options struct (default-constructed on first use).
  template <typename T>
  T& of() {
    std::any& slot = own_[std::type_index(typeid(T))];
    if (!slot.has_value()) slot = T{};
    return std::any_cast<T&>(slot);
  }
  /// Its defaults when never set.
  template <typename T>
  const T& of() const {
    static const T defaults{};
    const auto found = own_.find(std::type_index(typeid(T)));
    return found == own_.end() ? defaults : std::any_cast<const T&>(found->second);
  }

 private:
  std::map<std::type_index, std::any> own_;
};

}  // namespace dtrain
