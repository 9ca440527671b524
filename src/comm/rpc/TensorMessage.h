// Tensors to and from gRPC messages (dtrain/tensor.proto), shared by the parameter server and
// federated learning: a flat tensor travels as chunks of raw little-endian bytes no larger than
// a limit (cut and sent by BulkMessage.h), and chunks are checked field by field before anything
// is copied, so a malformed message is refused with a sentence naming the field and changes
// nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "dtrain/tensor.pb.h"

namespace dtrain::comm::rpc {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "dtrain's wire format is little-endian raw bytes; this host is not");

/// Default and largest chunk payloads (gRPC refuses messages over 4 MB by default).
constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
constexpr int64_t kMaxChunkBytes = int64_t{3} << 20;

DType to_wire(at::ScalarType type);
/// InputError for a dtype dtrain does not send.
at::ScalarType from_wire(DType type);
const char* dtype_name(DType type);

/// What a receiver accepts: elements of `dtype` within [begin, end) of its index space, chunks
/// no larger than `max_bytes`.
struct ChunkRule {
  at::ScalarType dtype = at::kFloat;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t max_bytes = kMaxChunkBytes;
};

/// "" when `chunk`, whose data is `bytes` long (it travels beside the chunk's fields:
/// BulkMessage.h), obeys `rule`, else one sentence naming the bad field (prefixed by `where`).
std::string check_chunk(const TensorChunk& chunk, int64_t bytes, const ChunkRule& rule,
                        const std::string& where);

}  // namespace dtrain::comm::rpc
