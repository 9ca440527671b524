#include "parallel/pipeline/StageLink.h"

#include <ATen/ATen.h>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::pipeline {

namespace {

constexpr int kMaxDims = 8;
// Header: [ndim, sizes..., dtype]; on its own tag, sent once per direction.
constexpr int kHeaderLength = kMaxDims + 2;
int header_tag(int direction) { return comm::kMaxUserTag - 2 + direction; }
int data_tag(int direction, int micro_batch) { return micro_batch * 2 + direction; }

const char* direction_name(int direction) {
  return direction == StageLink::Activation ? "activation" : "gradient";
}

}  // namespace

StageLink::StageLink(comm::CommunicatorPtr pp) : pp_(std::move(pp)), stage_(pp_->rank()) {}

int StageLink::peer(Direction direction, bool sending) const {
  const bool to_next = (direction == Activation) == sending;
  return to_next ? stage_ + 1 : stage_ - 1;
}

std::string StageLink::describe(const Meta& meta) const {
  std::string out = "[";
  for (size_t i = 0; i < meta.sizes.size(); ++i) out += concat(i ? ", " : "", meta.sizes[i]);
  return concat(out, "] ", c10::toString(meta.dtype));
}

void StageLink::send(Direction direction, int micro_batch, const at::Tensor& tensor) {
  DTRAIN_CHECK(micro_batch * 2 + 1 < comm::kMaxUserTag - 2, "too many micro-batches");
  const int dst = peer(direction, true);
  const Meta meta{tensor.sizes().vec(), tensor.scalar_type()};
  if (!sent_[direction]) {
    DTRAIN_CHECK_INPUT(tensor.dim() <= kMaxDims, "pipeline stage ", stage_, " sends a ",
                       tensor.dim(), "-dimensional ", direction_name(direction), " (at most ",
                       kMaxDims, ")");
    at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
    header[0] = tensor.dim();
    for (int64_t i = 0; i < tensor.dim(); ++i) header[1 + i] = tensor.size(i);
    header[kHeaderLength - 1] = static_cast<int64_t>(tensor.scalar_type());
    sends_.emplace_back(header, pp_->send(header, dst, {header_tag(direction)}));
    sent_[direction] = meta;
  } else {
    const Meta& agreed = *sent_[direction];
    DTRAIN_CHECK_INPUT(agreed.sizes == meta.sizes && agreed.dtype == meta.dtype,
                       "pipeline stage ", stage_, ": the ", direction_name(direction),
                       " of micro-batch ", micro_batch, " for stage ", dst, " is ",
                       describe(meta), " but the stages agreed on ", describe(agreed),
                       " at the first micro-batch (every micro-batch must have the same shape)");
  }
  at::Tensor data = tensor.contiguous();
  sends_.emplace_back(data, pp_->send(data, dst, {data_tag(direction, micro_batch)}));
}

void StageLink::post_recv(Direction direction, int micro_batch) {
  if (!expected_[direction] || posted_.count({direction, micro_batch})) return;
  const Meta& meta = *expected_[direction];
  at::Tensor buffer = at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype));
  auto work = pp_->recv(buffer, peer(direction, false), {data_tag(direction, micro_batch)});
  posted_[{direction, micro_batch}] = {buffer, work};
}

at::Tensor StageLink::recv(Direction direction, int micro_batch) {
  if (!expected_[direction]) {
    at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
    pp_->recv(header, peer(direction, false), {header_tag(direction)})->wait();
    const int64_t dims = header[0].item<int64_t>();
    DTRAIN_CHECK(dims >= 0 && dims <= kMaxDims, "pipeline stage ", stage_,
                 " received a malformed ", direction_name(direction), " header");
    Meta meta;
    for (int64_t i = 0; i < dims; ++i) meta.sizes.push_back(header[1 + i].item<int64_t>());
    meta.dtype = static_cast<at::ScalarType>(header[kHeaderLength - 1].item<int64_t>());
    expected_[direction] = meta;
  }
  post_recv(direction, micro_batch);
  auto entry = posted_.extract({direction, micro_batch});
  entry.mapped().second->wait();
  return entry.mapped().first;
}

void StageLink::finish_sends() {
  for (auto& [tensor, work] : sends_) work->wait();
  sends_.clear();
}

}  // namespace dtrain::parallel::pipeline
