// Tensor payloads beside protobuf: a gRPC message holding a TensorChunk (dtrain/tensor.proto)
// whose `data` bytes go straight between the tensor and gRPC's slices. On the wire it is the
// same protobuf message (any protobuf peer reads it), but a sender copies the payload once (or
// not at all, given its `owner`) instead of into the message and again into slices, a receiver
// parses every other field with protobuf and copies the payload once, from the slices to where
// `place` says, instead of into a string and again into the tensor. Used with gRPC's codegen
// handlers and readers in place of the generated message type (grpc::SerializationTraits).
#pragma once

#include <grpcpp/impl/serialization_traits.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/rpc/TensorMessage.h"

namespace dtrain::comm::rpc {

/// The field number of the TensorChunk in message type M (specialized per message).
template <class M>
struct ChunkField;

template <class M>
struct Bulk {
  /// Every field; the chunk's `data` stays empty (the payload travels below).
  M meta;
  /// Sending: the payload. With an `owner` (what keeps `data` valid: a tensor, a pooled
  /// buffer), gRPC's slices point at it and hold the owner until gRPC is done with them; without
  /// one, the payload is copied when the message is serialized.
  const char* data = nullptr;
  int64_t bytes = 0;
  std::shared_ptr<const void> owner;
  /// Receiving: after the other fields are parsed, says where the payload of `bytes` goes
  /// (nullptr and a reason in *why to refuse the message: the read then fails).
  std::function<char*(const M& meta, int64_t bytes, std::string* why)> place;
  /// Receiving: the payload's size, and why `place` refused it ("" when it did not).
  int64_t received = 0;
  std::string refused;
};

/// Cuts `flat` (1-D, contiguous; its element 0 is index `offset` of the index space) into
/// Bulk<M> messages of at most `chunk_bytes` (and kMaxChunkBytes) whose payloads point into it,
/// kept alive by `owner`; `fill` sets each message's other fields, the first chunk carries the
/// flat length as its shape, an empty tensor is one empty chunk. Stops when `emit` returns
/// false (a closed stream).
template <class M, class Fill, class Emit>
void for_each_bulk(const at::Tensor& flat, int64_t offset, int64_t chunk_bytes,
                   const std::shared_ptr<const void>& owner, const Fill& fill, const Emit& emit) {
  const auto item = static_cast<int64_t>(flat.element_size());
  const int64_t per_chunk = std::max<int64_t>(1, std::min(chunk_bytes, kMaxChunkBytes) / item);
  const auto* bytes = static_cast<const char*>(flat.data_ptr());
  const int64_t n = flat.numel();
  int64_t start = 0;
  do {
    Bulk<M> message;
    fill(message.meta);
    TensorChunk* chunk = message.meta.mutable_chunk();
    chunk->set_dtype(to_wire(flat.scalar_type()));
    chunk->set_offset(offset + start);
    if (start == 0) chunk->add_shape(n);
    message.data = bytes + start * item;
    message.bytes = std::min(per_chunk, n - start) * item;
    message.owner = owner;
    if (!emit(message)) return;
    start += per_chunk;
  } while (start < n);
}

/// Wire encoding of a message: `rest` (its serialized fields but the chunk), the chunk field's
/// number, the chunk without data (`chunk`), then the payload.
grpc::Status encode_bulk(const std::string& rest, int chunk_field, const std::string& chunk,
                         const char* data, int64_t bytes, const std::shared_ptr<const void>& owner,
                         grpc::ByteBuffer* out);

/// Splits a received message into `rest` (its fields but the chunk), `chunk` (the chunk's fields
/// but data) and the payload's position; `copy_payload(dst)` then copies it. INTERNAL status
/// when the bytes are not a well-formed message.
class BulkReader {
 public:
  grpc::Status parse(grpc::ByteBuffer* buffer, int chunk_field, std::string* rest,
                     std::string* chunk);
  int64_t payload_bytes() const { return payload_bytes_; }
  void copy_payload(char* dst) const;

 private:
  std::vector<grpc::Slice> slices_;
  size_t payload_slice_ = 0, payload_pos_ = 0;
  int64_t payload_bytes_ = 0;
};

}  // namespace dtrain::comm::rpc

namespace grpc {

template <class M>
class SerializationTraits<dtrain::comm::rpc::Bulk<M>, void> {
 public:
  static Status Serialize(const dtrain::comm::rpc::Bulk<M>& message, ByteBuffer* buffer,
                          bool* own_buffer) {
    *own_buffer = true;
    M rest = message.meta;
    const dtrain::comm::rpc::TensorChunk chunk = rest.chunk();
    rest.clear_chunk();
    return dtrain::comm::rpc::encode_bulk(
        rest.SerializeAsString(), dtrain::comm::rpc::ChunkField<M>::value,
        chunk.SerializeAsString(), message.data, message.bytes, message.owner, buffer);
  }
  static Status Deserialize(ByteBuffer* buffer, dtrain::comm::rpc::Bulk<M>* message) {
    dtrain::comm::rpc::BulkReader reader;
    std::string rest, chunk;
    Status status = reader.parse(buffer, dtrain::comm::rpc::ChunkField<M>::value, &rest, &chunk);
    buffer->Clear();
    if (!status.ok()) return status;
    if (!message->meta.ParseFromString(rest) ||
        !message->meta.mutable_chunk()->ParseFromString(chunk)) {
      return Status(StatusCode::INTERNAL, "a message that does not parse");
    }
    message->received = reader.payload_bytes();
    message->refused.clear();
    if (reader.payload_bytes() == 0) return Status::OK;
    char* dst = message->place
                    ? message->place(message->meta, reader.payload_bytes(), &message->refused)
                    : nullptr;
    if (dst == nullptr) {
      if (message->refused.empty()) message->refused = "a payload nobody expected";
      // The message is well formed: the reader sees `refused` and answers for it.
      return Status::OK;
    }
    reader.copy_payload(dst);
    return Status::OK;
  }
};

}  // namespace grpc
