// The federated service's tensors on the wire (dtrain/federated.proto): named tensors (the
// model; an update's parts) cut into dtrain.rpc.TensorChunk runs and put back together with
// every chunk checked before anything is copied. Shared by the server, the client and the
// simulation (which sends its updates through the same encoding to measure their bytes).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/Compression.h"
#include "dtrain/federated.pb.h"

namespace dtrain::services::federated::wire {

using Parts = std::vector<std::pair<std::string, at::Tensor>>;

/// A message's bytes as gRPC carries it: the serialized message and its 5-byte length prefix.
int64_t message_bytes(const google::protobuf::MessageLite& message);

/// Calls `emit` with each chunk of each part (at most `chunk_bytes` of data; the first chunk of
/// a part carries its length as the shape, an empty part is one empty chunk).
void for_each_chunk(const Parts& parts, int64_t chunk_bytes,
                    const std::function<void(dtrain::comm::rpc::TensorChunk&&)>& emit);

/// The messages of an upload: the header in the first, one chunk each.
std::vector<dtrain::fl::UpdateChunk> update_messages(const comm::EncodedUpdate& update,
                                                     const std::string& client, int64_t round,
                                                     int64_t examples, double train_loss,
                                                     int64_t chunk_bytes);

/// Reassembles parts from chunks: only the names in `limits` (each at most that many
/// elements), dtypes float32/float64/uint8/int32/int64, each part's chunks in order.
class PartsReader {
 public:
  explicit PartsReader(std::map<std::string, int64_t> limits);
  /// "" or why the chunk is refused (naming the field; prefixed by `where`).
  std::string add(const dtrain::comm::rpc::TensorChunk& chunk, const std::string& where);
  /// "" and the parts, in the order they began, or why they are incomplete.
  std::string finish(Parts* parts) const;

 private:
  struct Part {
    at::Tensor tensor;
    int64_t next = 0;
  };
  std::map<std::string, int64_t> limits_;
  std::map<std::string, Part> parts_;
  std::vector<std::string> order_;
};

/// An upload read message by message (the server's and the simulation's path): the header from
/// the first, the parts of an update of a model of `numel` parameters from all.
class UpdateReader {
 public:
  explicit UpdateReader(int64_t numel);
  /// "" or why the message is refused (naming the field).
  std::string add(const dtrain::fl::UpdateChunk& message);
  const dtrain::fl::UpdateChunk& header() const { return header_; }
  int64_t messages() const { return messages_; }
  /// "" and the encoded update, or why it is incomplete.
  std::string finish(comm::EncodedUpdate* update) const;

 private:
  dtrain::fl::UpdateChunk header_;
  PartsReader parts_;
  int64_t messages_ = 0;
};

/// How many seconds all `planned` local steps take at the pace of `done` steps in `ms` ("about
/// 5", or "more than 2.5" when none was done): what a client out of time says, and the server
/// it reports to.
std::string needed_seconds(int64_t done, int64_t planned, int64_t ms);

/// SCAFFOLD's control-variate change travels in the update's upload as parts named
/// "control.<part>", encoded as the update is.
constexpr const char* kControlPrefix = "control.";
/// Moves the "control." parts out of `update` into their own update (no parts: none sent).
comm::EncodedUpdate split_control(comm::EncodedUpdate* update);
/// Adds `control`'s parts to `update` under "control." names.
void append_control(comm::EncodedUpdate* update, const comm::EncodedUpdate& control);

/// All of an upload's messages through an UpdateReader.
std::string read_update(const std::vector<dtrain::fl::UpdateChunk>& messages, int64_t numel,
                        dtrain::fl::UpdateChunk* header, comm::EncodedUpdate* update);

}  // namespace dtrain::services::federated::wire
