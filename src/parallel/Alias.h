// A plain tensor on another tensor's storage (not an autograd view), so it can be a leaf
// parameter, an optimizer's parameter or a .grad that optimizers may detach_() and zero_().
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace dtrain::parallel {

/// Shares `base`'s storage at elements [offset, offset + numel(sizes)), contiguous.
inline at::Tensor alias_storage(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor out = at::empty({0}, base.options());
  out.set_(base.storage(), base.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return out;
}

/// Points `t` (kept the same tensor: a parameter stays the module's) at `base`'s storage at
/// element `offset`, contiguous, with its own sizes, where `base`'s storage may have no memory
/// yet (nn::placeholder): no bounds are checked and nothing is allocated; `t` sees the memory
/// the storage is given later.
inline void point_into(const at::Tensor& t, const at::Tensor& base, int64_t offset) {
  const std::vector<int64_t> sizes = t.sizes().vec();
  at::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(base.storage());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
}

/// alias_storage for a `base` whose storage may have no memory yet (see point_into).
inline at::Tensor alias_unallocated(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor out = at::empty({0}, base.options());
  out.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  point_into(out, base, offset);
  return out;
}

}  // namespace dtrain::parallel
