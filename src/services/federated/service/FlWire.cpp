#include "services/federated/service/FlWire.h"

#include <ATen/ops/empty.h>
#include <cmath>
#include <cstring>

#include "comm/rpc/BulkMessage.h"
#include "dtrain/common/Error.h"

namespace dtrain::services::federated::wire {

int64_t message_bytes(const google::protobuf::MessageLite& message) {
  return static_cast<int64_t>(message.ByteSizeLong()) + 5;
}

void for_each_chunk(const Parts& parts, int64_t chunk_bytes,
                    const std::function<void(dtrain::comm::rpc::TensorChunk&&)>& emit) {
  for (const auto& [name, tensor] : parts) {
    const at::Tensor flat = tensor.contiguous().view({-1});
    comm::rpc::for_each_bulk<dtrain::fl::UpdateChunk>(
        flat, 0, chunk_bytes, nullptr,
        [&](dtrain::fl::UpdateChunk& meta) { meta.mutable_chunk()->set_name(name); },
        [&](const comm::rpc::Bulk<dtrain::fl::UpdateChunk>& message) {
          comm::rpc::TensorChunk chunk = message.meta.chunk();
          chunk.set_data(message.data, static_cast<size_t>(message.bytes));
          emit(std::move(chunk));
          return true;
        });
  }
}

std::vector<dtrain::fl::UpdateChunk> update_messages(const comm::EncodedUpdate& update,
                                                     const std::string& client, int64_t round,
                                                     int64_t examples, double train_loss,
                                                     int64_t chunk_bytes) {
  std::vector<dtrain::fl::UpdateChunk> messages;
  for_each_chunk(update.parts, chunk_bytes, [&](comm::rpc::TensorChunk&& chunk) {
    dtrain::fl::UpdateChunk message;
    if (messages.empty()) {
      message.set_client_id(client);
      message.set_round(round);
      message.set_examples(examples);
      message.set_train_loss(train_loss);
      message.set_encoding(update.encoding);
    }
    *message.mutable_chunk() = std::move(chunk);
    messages.push_back(std::move(message));
  });
  return messages;
}

PartsReader::PartsReader(std::map<std::string, int64_t> limits) : limits_(std::move(limits)) {}

std::string PartsReader::add(const comm::rpc::TensorChunk& chunk, const std::string& where) {
  const auto limit = limits_.find(chunk.name());
  if (limit == limits_.end()) {
    return concat(where, ": field 'name' is '", chunk.name().substr(0, 64),
                  "', not a part this "
                  "message may carry");
  }
  const comm::rpc::DType d = chunk.dtype();
  if (d != comm::rpc::FLOAT32 && d != comm::rpc::FLOAT64 && d != comm::rpc::UINT8 &&
      d != comm::rpc::INT32 && d != comm::rpc::INT64) {
    return concat(where, ": field 'dtype' is ", comm::rpc::dtype_name(d),
                  " (FLOAT32, FLOAT64, UINT8, INT32 or INT64)");
  }
  auto found = parts_.find(chunk.name());
  if (found == parts_.end()) {
    if (chunk.shape_size() != 1 || chunk.shape(0) < 0 || chunk.shape(0) > limit->second) {
      return concat(where, ": field 'shape' of part '", chunk.name(),
                    "' must be one length in [0, ", limit->second, "]");
    }
    if (chunk.offset() != 0) {
      return concat(where, ": field 'offset' is ", chunk.offset(),
                    ", a part's first chunk starts at 0");
    }
    Part part;
    part.tensor = at::empty({chunk.shape(0)}, at::TensorOptions(comm::rpc::from_wire(d)));
    found = parts_.emplace(chunk.name(), std::move(part)).first;
    order_.push_back(chunk.name());
  } else if (chunk.offset() != found->second.next) {
    return concat(where, ": field 'offset' is ", chunk.offset(), ", part '", chunk.name(),
                  "' continues at ", found->second.next);
  }
  Part& part = found->second;
  comm::rpc::ChunkRule rule;
  rule.dtype = part.tensor.scalar_type();
  rule.begin = 0;
  rule.end = part.tensor.numel();
  const auto bytes = static_cast<int64_t>(chunk.data().size());
  std::string why = comm::rpc::check_chunk(chunk, bytes, rule, where);
  if (!why.empty()) return why;
  std::memcpy(static_cast<char*>(part.tensor.data_ptr()) + part.next * part.tensor.element_size(),
              chunk.data().data(), static_cast<size_t>(bytes));
  part.next += bytes / static_cast<int64_t>(part.tensor.element_size());
  return "";
}

std::string PartsReader::finish(Parts* parts) const {
  parts->clear();
  for (const auto& name : order_) {
    const Part& part = parts_.at(name);
    if (part.next != part.tensor.numel()) {
      return concat("part '", name, "' ended after ", part.next, " of its ", part.tensor.numel(),
                    " elements");
    }
    parts->emplace_back(name, part.tensor);
  }
  return "";
}

UpdateReader::UpdateReader(int64_t numel)
    // Every part an encoding may carry, none longer than the model.
    : parts_({{"delta", numel},
              {"q", numel},
              {"lo", numel},
              {"step", numel},
              {"indices", numel},
              {"values", numel},
              {"masked", numel + 2},
              {"control.delta", numel},
              {"control.q", numel},
              {"control.lo", numel},
              {"control.step", numel},
              {"control.indices", numel},
              {"control.values", numel}}) {}

std::string UpdateReader::add(const dtrain::fl::UpdateChunk& message) {
  if (messages_ == 0) {
    header_ = message;
    header_.clear_chunk();
  }
  return parts_.add(message.chunk(), concat("update chunk ", messages_++));
}

std::string UpdateReader::finish(comm::EncodedUpdate* update) const {
  if (messages_ == 0) return "an upload without messages";
  update->encoding = header_.encoding();
  return parts_.finish(&update->parts);
}

comm::EncodedUpdate split_control(comm::EncodedUpdate* update) {
  comm::EncodedUpdate control;
  control.encoding = update->encoding;
  Parts rest;
  for (auto& [name, tensor] : update->parts) {
    if (name.rfind(kControlPrefix, 0) == 0) {
      control.parts.emplace_back(name.substr(std::strlen(kControlPrefix)), std::move(tensor));
    } else {
      rest.emplace_back(std::move(name), std::move(tensor));
    }
  }
  update->parts = std::move(rest);
  return control;
}

void append_control(comm::EncodedUpdate* update, const comm::EncodedUpdate& control) {
  for (const auto& [name, tensor] : control.parts) {
    update->parts.emplace_back(kControlPrefix + name, tensor);
  }
}

std::string read_update(const std::vector<dtrain::fl::UpdateChunk>& messages, int64_t numel,
                        dtrain::fl::UpdateChunk* header, comm::EncodedUpdate* update) {
  UpdateReader reader(numel);
  for (const auto& message : messages) {
    const std::string why = reader.add(message);
    if (!why.empty()) return why;
  }
  *header = reader.header();
  return reader.finish(update);
}

std::string needed_seconds(int64_t done, int64_t planned, int64_t ms) {
  if (done <= 0) return concat("more than ", static_cast<double>(ms) / 1000.0);
  return concat("about ", std::llround(static_cast<double>(ms) / 1000.0 *
                                       static_cast<double>(planned) / static_cast<double>(done)));
}

}  // namespace dtrain::services::federated::wire
