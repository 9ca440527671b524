// Tensors to and from gRPC messages (dtrain/tensor.proto), shared by the parameter server and
// federated learning: a flat tensor is cut into chunks of raw little-endian bytes no larger
// than a limit, and chunks are checked field by field before anything is copied, so a malformed
// message is refused with a sentence naming the field and changes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

#include "dtrain/tensor.pb.h"

namespace dtrain::rpc {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "dtrain's wire format is little-endian raw bytes; this host is not");

/// Default and largest chunk payloads (gRPC refuses messages over 4 MB by default).
constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
constexpr int64_t kMaxChunkBytes = int64_t{3} << 20;

DType to_wire(at::ScalarType type);
/// InputError for a dtype dtrain does not send.
at::ScalarType from_wire(DType type);
const char* dtype_name(DType type);

/// Emits `flat` (1-D, contiguous) as chunks of at most `chunk_bytes` bytes whose offsets start
/// at `offset`; the first chunk carries `shape` (default: the flat length). Stops early when
/// `emit` returns false (a closed stream).
void for_each_chunk(const at::Tensor& flat, int64_t offset, const std::string& name,
                    int64_t chunk_bytes, const std::function<bool(TensorChunk&)>& emit,
                    const std::vector<int64_t>& shape = {});

/// What a receiver accepts: elements of `dtype` within [begin, end) of its index space, chunks
/// no larger than `max_bytes`.
struct ChunkRule {
  at::ScalarType dtype = at::kFloat;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t max_bytes = kMaxChunkBytes;
};

/// "" when `chunk` obeys `rule`, else one sentence naming the bad field (prefixed by `where`).
std::string check_chunk(const TensorChunk& chunk, const ChunkRule& rule, const std::string& where);
/// check_chunk for a chunk whose data (`bytes` long) travels beside it (BulkMessage.h).
std::string check_chunk_meta(const TensorChunk& chunk, int64_t bytes, const ChunkRule& rule,
                             const std::string& where);

/// Elements in a chunk that passed check_chunk.
int64_t chunk_elements(const TensorChunk& chunk);

/// Copies a checked chunk into `flat`, whose element 0 is index `base` of the index space.
void copy_chunk(const TensorChunk& chunk, const at::Tensor& flat, int64_t base);

}  // namespace dtrain::rpc
