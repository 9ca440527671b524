#include "comm/rpc/TensorMessage.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::comm::rpc {

DType to_wire(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return FLOAT32;
    case at::kDouble:
      return FLOAT64;
    case at::kBFloat16:
      return BFLOAT16;
    case at::kHalf:
      return FLOAT16;
    case at::kLong:
      return INT64;
    case at::kInt:
      return INT32;
    case at::kByte:
      return UINT8;
    case at::kChar:
      return INT8;
    default:
      break;
  }
  DTRAIN_THROW(InputError, "tensors of ", type,
               " cannot be sent (dtrain/tensor.proto has no such dtype)");
}

at::ScalarType from_wire(DType type) {
  switch (type) {
    case FLOAT32:
      return at::kFloat;
    case FLOAT64:
      return at::kDouble;
    case BFLOAT16:
      return at::kBFloat16;
    case FLOAT16:
      return at::kHalf;
    case INT64:
      return at::kLong;
    case INT32:
      return at::kInt;
    case UINT8:
      return at::kByte;
    case INT8:
      return at::kChar;
    default:
      break;
  }
  DTRAIN_THROW(InputError, "unknown wire dtype ", static_cast<int>(type));
}

const char* dtype_name(DType type) {
  return DType_IsValid(type) ? DType_Name(type).c_str() : "(invalid)";
}

std::string check_chunk(const TensorChunk& chunk, int64_t bytes, const ChunkRule& rule,
                        const std::string& where) {
  const DType expected = to_wire(rule.dtype);
  if (chunk.dtype() != expected) {
    return concat(where, ": field 'dtype' is ", dtype_name(chunk.dtype()), ", expected ",
                  dtype_name(expected));
  }
  if (bytes > rule.max_bytes) {
    return concat(where, ": field 'data' holds ", bytes, " bytes, more than the ", rule.max_bytes,
                  " a chunk may");
  }
  const int64_t item = static_cast<int64_t>(c10::elementSize(rule.dtype));
  if (bytes % item != 0) {
    return concat(where, ": field 'data' holds ", bytes, " bytes, not a whole number of ",
                  dtype_name(expected), " elements");
  }
  const int64_t count = bytes / item;
  if (chunk.offset() < rule.begin || chunk.offset() > rule.end ||
      count > rule.end - chunk.offset()) {
    return concat(where, ": field 'offset' ", chunk.offset(), " with ", count,
                  " elements is outside [", rule.begin, ", ", rule.end, ")");
  }
  return "";
}

}  // namespace dtrain::comm::rpc
