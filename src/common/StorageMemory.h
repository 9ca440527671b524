// Tensors whose storage is given memory and takes it back while the tensor (and every view of
// its storage) stays the same object: ZeRO-3's gathered units and gradient shard, the master
// weights kept in an offload file, a placeholder parameter before it is drawn.
#pragma once

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <vector>

namespace dtrain {

/// A contiguous tensor of `shape` whose storage has no memory yet (give_memory gives it).
inline at::Tensor tensor_without_memory(const std::vector<int64_t>& shape,
                                        const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

/// Gives `t`'s storage fresh, uninitialized memory for its elements (from its device's
/// allocator); every tensor on that storage sees it.
inline void give_memory(const at::Tensor& t) {
  c10::Storage storage = t.storage();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  storage.set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(nbytes));
  storage.set_nbytes(nbytes);
}

/// Takes the memory out of `t`'s storage; it is freed with the returned pointer.
inline at::DataPtr take_memory(const at::Tensor& t) {
  c10::Storage storage = t.storage();
  at::DataPtr ptr = storage.set_data_ptr(at::DataPtr(nullptr, storage.device()));
  storage.set_nbytes(0);
  return ptr;
}

}  // namespace dtrain
