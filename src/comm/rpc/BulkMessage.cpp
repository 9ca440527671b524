#include "comm/rpc/BulkMessage.h"

#include <grpc/slice.h>
#include <grpcpp/support/slice.h>

#include <cstring>
#include <vector>

namespace dtrain::comm::rpc {

namespace {

constexpr int kDataField = 5;  // TensorChunk.data
constexpr int kLengthDelimited = 2;

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

size_t varint_size(uint64_t value) {
  size_t n = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++n;
  }
  return n;
}

// Reads bytes across a message's slices.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { settle(); }
  bool done() const { return slice_ >= slices_.size(); }
  bool byte(uint8_t* out) {
    if (done()) return false;
    *out = slices_[slice_].begin()[pos_++];
    settle();
    return true;
  }
  bool varint(uint64_t* out) {
    *out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!byte(&b)) return false;
      *out |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  /// Appends the next n bytes to `out` (nullptr: skips them).
  bool take(uint64_t n, std::string* out) {
    while (n > 0) {
      if (done()) return false;
      const size_t here = std::min<uint64_t>(n, slices_[slice_].size() - pos_);
      if (out) out->append(reinterpret_cast<const char*>(slices_[slice_].begin() + pos_), here);
      pos_ += here;
      n -= here;
      settle();
    }
    return true;
  }
  size_t slice() const { return slice_; }
  size_t pos() const { return pos_; }

 private:
  void settle() {
    while (slice_ < slices_.size() && pos_ >= slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
  }
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0, pos_ = 0;
};

grpc::Status malformed(const char* what) {
  return grpc::Status(grpc::StatusCode::INTERNAL, std::string("a malformed message: ") + what);
}

// Copies one field (its tag already read) to `out` (nullptr: skips it).
bool copy_field(Cursor& in, uint64_t tag, std::string* out) {
  if (out) put_varint(*out, tag);
  uint64_t value = 0;
  switch (tag & 7) {
    case 0:
      if (!in.varint(&value)) return false;
      if (out) put_varint(*out, value);
      return true;
    case 1:
      return in.take(8, out);
    case 5:
      return in.take(4, out);
    case kLengthDelimited:
      if (!in.varint(&value)) return false;
      if (out) put_varint(*out, value);
      return in.take(value, out);
    default:
      return false;  // groups are not used by dtrain's messages
  }
}

}  // namespace

grpc::Status encode_bulk(const std::string& rest, int chunk_field, const std::string& chunk,
                         const char* data, int64_t bytes, const std::shared_ptr<const void>& owner,
                         grpc::ByteBuffer* out) {
  std::string head = rest;
  const uint64_t payload = static_cast<uint64_t>(bytes);
  const uint64_t data_field = bytes > 0 ? 1 + varint_size(payload) + payload : 0;
  put_varint(head, (static_cast<uint64_t>(chunk_field) << 3) | kLengthDelimited);
  put_varint(head, chunk.size() + data_field);
  head += chunk;
  if (bytes > 0) {
    put_varint(head, (static_cast<uint64_t>(kDataField) << 3) | kLengthDelimited);
    put_varint(head, payload);
  }
  std::vector<grpc::Slice> slices;
  slices.emplace_back(head.data(), head.size());
  if (bytes > 0) {
    if (owner) {
      // The slice holds a reference to the owner until gRPC releases it.
      auto* hold = new std::shared_ptr<const void>(owner);
      slices.emplace_back(
          const_cast<char*>(data), static_cast<size_t>(bytes),
          [](void* held) { delete static_cast<std::shared_ptr<const void>*>(held); }, hold);
    } else {
      grpc_slice copy = grpc_slice_malloc(static_cast<size_t>(bytes));
      std::memcpy(GRPC_SLICE_START_PTR(copy), data, static_cast<size_t>(bytes));
      slices.emplace_back(copy, grpc::Slice::STEAL_REF);
    }
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  out->Swap(&buffer);
  return grpc::Status::OK;
}

grpc::Status BulkReader::parse(grpc::ByteBuffer* buffer, int chunk_field, std::string* rest,
                               std::string* chunk) {
  slices_.clear();
  payload_bytes_ = 0;
  if (!buffer->Dump(&slices_).ok()) return malformed("its bytes cannot be read");
  Cursor in(slices_);
  bool seen_chunk = false;
  while (!in.done()) {
    uint64_t tag = 0;
    if (!in.varint(&tag)) return malformed("a truncated tag");
    if ((tag >> 3) != static_cast<uint64_t>(chunk_field) || (tag & 7) != kLengthDelimited) {
      if (!copy_field(in, tag, rest)) return malformed("a truncated field");
      continue;
    }
    if (seen_chunk) return malformed("two chunks in one message");
    seen_chunk = true;
    uint64_t length = 0;
    if (!in.varint(&length)) return malformed("a truncated chunk length");
    // The chunk's fields: all but data are kept for protobuf; data's place is remembered.
    const size_t start_slice = in.slice(), start_pos = in.pos();
    uint64_t consumed = 0;
    auto offset_of = [&](const Cursor& c) {
      uint64_t n = 0;
      for (size_t s = start_slice; s < c.slice(); ++s) n += slices_[s].size();
      return n + c.pos() - start_pos;
    };
    while (consumed < length) {
      uint64_t field = 0;
      if (!in.varint(&field)) return malformed("a truncated chunk field");
      if ((field >> 3) == static_cast<uint64_t>(kDataField) && (field & 7) == kLengthDelimited) {
        uint64_t n = 0;
        if (!in.varint(&n)) return malformed("a truncated data length");
        payload_slice_ = in.slice();
        payload_pos_ = in.pos();
        payload_bytes_ = static_cast<int64_t>(n);
        if (!in.take(n, nullptr)) return malformed("truncated data");
      } else if (!copy_field(in, field, chunk)) {
        return malformed("a truncated chunk field");
      }
      consumed = offset_of(in);
    }
    if (consumed != length) return malformed("a chunk longer than its length");
  }
  return grpc::Status::OK;
}

void BulkReader::copy_payload(char* dst) const {
  size_t slice = payload_slice_, pos = payload_pos_;
  int64_t left = payload_bytes_;
  while (left > 0 && slice < slices_.size()) {
    const size_t here = std::min<size_t>(static_cast<size_t>(left), slices_[slice].size() - pos);
    std::memcpy(dst, slices_[slice].begin() + pos, here);
    dst += here;
    left -= static_cast<int64_t>(here);
    ++slice;
    pos = 0;
  }
}

}  // namespace dtrain::comm::rpc
