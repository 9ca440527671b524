// Tests of bad input: the message an InputError carries, and the Python peers' interpreter.
#pragma once

#include <functional>
#include <string>

#include "dtrain/common/Error.h"

namespace dtrain::test {

/// The InputError `fn` throws (its message), or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.message();
  }
  return "(no error)";
}

#ifdef DTRAIN_SOURCE_DIR
/// .venv-torch's interpreter (scripts/setup --torch pip): PyTorch 2.x and the PyPI peers.
inline std::string peer_python() {
  return std::string(DTRAIN_SOURCE_DIR) + "/.venv-torch/bin/python";
}
#endif

}  // namespace dtrain::test
