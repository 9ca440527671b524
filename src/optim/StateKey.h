// LibTorch keys an optimizer's per-parameter state by the parameter's TensorImpl: its address
// printed (1.13) or the pointer itself (2.x). The key type is read from the optimizer's map.
#pragma once

#include <torch/optim/optimizer.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace dtrain::optim {

using StateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <typename Key>  // a template so that the branch not taken is not compiled
Key key_as(const at::Tensor& parameter) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream address;  // as c10::guts::to_string did
    address << parameter.unsafeGetTensorImpl();
    return address.str();
  } else {
    return static_cast<Key>(parameter.unsafeGetTensorImpl());
  }
}

inline StateKey key_of(const at::Tensor& parameter) { return key_as<StateKey>(parameter); }

}  // namespace dtrain::optim
