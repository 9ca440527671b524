// The parameter server's wire details shared by the shard and its client: which field of each
// streamed message is its TensorChunk (for payloads that travel beside protobuf, BulkMessage.h)
// and the methods' full names (the service is registered by hand, ShardServer.cpp), and how a
// refusal a worker can survive is marked.
#pragma once

#include "comm/rpc/BulkMessage.h"
#include "dtrain/ps.pb.h"

namespace dtrain::comm::rpc {
template <>
struct ChunkField<dtrain::ps::PullChunk> {
  static constexpr int value = 2;  // PullChunk.chunk
};
template <>
struct ChunkField<dtrain::ps::PushChunk> {
  static constexpr int value = 4;  // PushChunk.chunk
};
}  // namespace dtrain::comm::rpc

namespace dtrain::parallel::ps {

enum PsMethod { kDescribe, kInitialize, kPull, kPush, kDone, kVector };
inline constexpr const char* kPsMethodName[] = {
    "/dtrain.ps.ParameterServer/Describe", "/dtrain.ps.ParameterServer/Initialize",
    "/dtrain.ps.ParameterServer/Pull",     "/dtrain.ps.ParameterServer/Push",
    "/dtrain.ps.ParameterServer/Done",     "/dtrain.ps.ParameterServer/Vector"};

/// The error details of a Push refused for a gradient holding NaN or Inf (INVALID_ARGUMENT):
/// the update is lost, the worker may go on.
inline constexpr const char* kNonFiniteDetails = "non-finite";

}  // namespace dtrain::parallel::ps
