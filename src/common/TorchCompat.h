// Where LibTorch 1.13 (Debian's, the default build) and 2.x (the pinned PyPI wheel) differ in
// what dtrain uses, the difference is settled here, once; no other file tests LibTorch's version.
// (The build side of the same: cmake/DtrainTorch.cmake.)
#pragma once

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

}  // namespace dtrain::compat
