// Where LibTorch 1.13 (Debian's, the default build) and 2.x (the pinned PyPI wheel) differ in
// what dtrain uses, the difference is settled here, once; no other file tests LibTorch's version.
// (The build side of the same: cmake/DtrainTorch.cmake.)
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#include <cstddef>

#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace dtrain::compat {

/// A CPU allocator for LibTorch 1.13 and 2.x alike: 2.x made at::Allocator::allocate non-const
/// and copy_data pure virtual. Derived classes implement allocate_bytes.
class Allocator : public at::Allocator {
 public:
  virtual at::DataPtr allocate_bytes(size_t n) const = 0;
#if DTRAIN_TORCH_AT_LEAST(2, 0)
  at::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  at::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif
};

/// Autocast's state for one device type (CPU or CUDA): 2.4 replaced the per-device functions
/// (is_cpu_enabled, get_autocast_gpu_dtype, ...) with ones taking the device type.
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
};

inline AutocastState autocast_state(c10::DeviceType device) {
#if DTRAIN_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CUDA) {
    return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  }
  return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
#endif
}

inline void set_autocast_state(c10::DeviceType device, AutocastState state) {
#if DTRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, state.dtype);
  at::autocast::set_autocast_enabled(device, state.enabled);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(state.dtype);
    at::autocast::set_enabled(state.enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(state.dtype);
    at::autocast::set_cpu_enabled(state.enabled);
  }
#endif
}

}  // namespace dtrain::compat
