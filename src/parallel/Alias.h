// A plain tensor on another tensor's storage (not an autograd view), so it can be a leaf
// parameter, an optimizer's parameter or a .grad that optimizers may detach_() and zero_().
#pragma once

#include <ATen/ATen.h>

namespace dtrain::parallel {

/// Shares `base`'s storage at elements [offset, offset + numel(sizes)), contiguous.
inline at::Tensor alias_storage(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor out = at::empty({0}, base.options());
  out.set_(base.storage(), base.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return out;
}

/// The same for a `base` whose storage has no memory yet (nn::placeholder): no bounds are
/// checked and nothing is allocated; the alias sees the memory the storage is given later.
inline at::Tensor alias_unallocated(const at::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor out = at::empty({0}, base.options());
  at::TensorImpl* impl = out.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(base.storage());
  impl->set_storage_offset(base.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return out;
}

}  // namespace dtrain::parallel
