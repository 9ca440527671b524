#include "parallel/pipeline/StageLink.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::pipeline {

namespace {

constexpr int kMaxDims = 8;
// Header: [ndim, sizes..., dtype].
constexpr int kHeaderLength = kMaxDims + 2;
// Reserved tags at the top of the user range, 4 per boundary: the training headers of each
// direction, then evaluation's header and data.
constexpr int kEvalHeader = 2;
constexpr int kEvalData = 3;

const char* direction_name(int direction) {
  return direction == StageLink::Activation ? "activation" : "gradient";
}

}  // namespace

StageLink::StageLink(comm::CommunicatorPtr pp, std::vector<std::vector<int>> stage_ranks,
                     bool shared_memory, c10::Device device)
    : pp_(std::move(pp)),
      device_(device),
      stage_(pp_->rank()),
      virtual_stages_(static_cast<int>(stage_ranks.size())),
      stage_ranks_(std::move(stage_ranks)) {
  const int ranks = pp_->size();
  for (const auto& replicas : stage_ranks_) {
    DTRAIN_CHECK(!replicas.empty(), "pipeline: a virtual stage on no rank");
    for (int rank : replicas) {
      DTRAIN_CHECK(rank >= 0 && rank < ranks, "pipeline: a virtual stage on rank ", rank, " of ",
                   ranks);
    }
  }
  if (shared_memory && ranks > 1 && device_.is_cpu()) {
    std::vector<std::pair<int, int>> pairs;
    for (int b = 0; b + 1 < virtual_stages_; ++b) {
      for (int lower : stage_ranks_[b]) {
        for (int upper : stage_ranks_[b + 1]) {
          if (lower == upper) continue;
          pairs.emplace_back(lower, upper);
          pairs.emplace_back(upper, lower);
        }
      }
    }
    shm_ = std::make_unique<comm::SharedMemoryChannel>(pp_, pairs);
  }
}

bool StageLink::shared_memory_with(int peer, bool sending) const {
  return shm_ && (sending ? shm_->connected(stage_, peer) : shm_->connected(peer, stage_));
}

int StageLink::peer(Direction direction, int boundary, bool sending, int micro_batch) const {
  // The activation goes from virtual stage `boundary` to `boundary + 1`.
  const bool from_lower = (direction == Activation) == sending;
  const auto& replicas = stage_ranks_[from_lower ? boundary + 1 : boundary];
  return replicas[micro_batch % static_cast<int>(replicas.size())];
}

int StageLink::header_tag(int channel, int boundary) const {
  return comm::kMaxUserTag - 1 - (boundary * 4 + channel);
}

int StageLink::data_tag(Direction direction, int boundary, int micro_batch) const {
  const int64_t boundaries = virtual_stages_ - 1;
  const int64_t tag = (micro_batch * boundaries + boundary) * 2 + direction;
  DTRAIN_CHECK_INPUT(tag < comm::kMaxUserTag - 4 * boundaries, "pipeline: ", micro_batch + 1,
                     " micro-batches over ", virtual_stages_,
                     " virtual stages exceed the point-to-point tag space");
  return static_cast<int>(tag);
}

std::string StageLink::describe(const Meta& meta) const {
  std::string out = "[";
  for (size_t i = 0; i < meta.sizes.size(); ++i) out += concat(i ? ", " : "", meta.sizes[i]);
  return concat(out, "] ", c10::toString(meta.dtype));
}

at::Tensor StageLink::header_of(const at::Tensor& tensor, Direction direction) const {
  DTRAIN_CHECK_INPUT(tensor.dim() <= kMaxDims, "pipeline stage ", stage_, " sends a ", tensor.dim(),
                     "-dimensional ", direction_name(direction), " (at most ", kMaxDims, ")");
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  auto* h = header.data_ptr<int64_t>();
  h[0] = tensor.dim();
  for (int64_t i = 0; i < tensor.dim(); ++i) h[1 + i] = tensor.size(i);
  h[kHeaderLength - 1] = static_cast<int64_t>(tensor.scalar_type());
  return header;
}

StageLink::Meta StageLink::read_header(const at::Tensor& header, const char* what) const {
  const auto* h = header.data_ptr<int64_t>();
  const int64_t dims = h[0];
  const int64_t dtype = h[kHeaderLength - 1];
  DTRAIN_CHECK(dims >= 0 && dims <= kMaxDims && dtype >= 0 &&
                   dtype < static_cast<int64_t>(at::ScalarType::NumOptions),
               "pipeline stage ", stage_, " received a malformed ", what, " header");
  Meta meta;
  for (int64_t i = 0; i < dims; ++i) meta.sizes.push_back(h[1 + i]);
  meta.dtype = static_cast<at::ScalarType>(dtype);
  return meta;
}

void StageLink::send(Direction direction, int boundary, int micro_batch, const at::Tensor& tensor) {
  release_sends([](const Send& send) { return send.work->is_completed(); });
  const int dst = peer(direction, boundary, true, micro_batch);
  if (dst == stage_) {
    local_[std::make_tuple(static_cast<int>(direction), boundary, micro_batch)] = tensor;
    return;
  }
  const bool shared = shared_memory_with(dst, true);
  const Meta meta{tensor.sizes().vec(), tensor.scalar_type()};
  const auto key = std::make_tuple(static_cast<int>(direction), boundary, dst);
  const auto agreed = sent_.find(key);
  if (agreed == sent_.end()) {
    at::Tensor header = header_of(tensor, direction);
    if (shared) {
      shm_->send(dst, header_tag(direction, boundary), header,
                 concat("pipeline send of the ", direction_name(direction), " header at boundary ",
                        boundary));
    } else {
      sends_.push_back({-1, boundary, micro_batch, header,
                        pp_->send(header, dst, {header_tag(direction, boundary)})});
    }
    sent_.emplace(key, meta);
  } else {
    DTRAIN_CHECK_INPUT(agreed->second.sizes == meta.sizes && agreed->second.dtype == meta.dtype,
                       "pipeline stage ", direction == Activation ? boundary : boundary + 1,
                       ": the ", direction_name(direction), " of micro-batch ", micro_batch,
                       " for stage ", direction == Activation ? boundary + 1 : boundary, " is ",
                       describe(meta), " but the stages agreed on ", describe(agreed->second),
                       " at the first micro-batch (every micro-batch must have the same shape)");
  }
  at::Tensor data = tensor.contiguous();
  if (shared) {
    shm_->send(dst, data_tag(direction, boundary, micro_batch), data,
               concat("pipeline send of the ", direction_name(direction), " of micro-batch ",
                      micro_batch, " at boundary ", boundary));
    return;
  }
  sends_.push_back({direction, boundary, micro_batch, data,
                    pp_->send(data, dst, {data_tag(direction, boundary, micro_batch)})});
}

void StageLink::post_recv(Direction direction, int boundary, int micro_batch) {
  const int src = peer(direction, boundary, false, micro_batch);
  if (src == stage_) return;
  const auto expected = expected_.find({static_cast<int>(direction), boundary, src});
  if (expected == expected_.end()) return;
  // Shared memory needs nothing posted: the sender's copy is already in the ring.
  if (shared_memory_with(src, false)) return;
  const auto key = std::make_tuple(static_cast<int>(direction), boundary, micro_batch);
  if (posted_.count(key)) return;
  const Meta& meta = expected->second;
  at::Tensor buffer = at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_));
  auto work = pp_->recv(buffer, src, {data_tag(direction, boundary, micro_batch)});
  posted_[key] = {buffer, work};
}

at::Tensor StageLink::recv(Direction direction, int boundary, int micro_batch) {
  const int src = peer(direction, boundary, false, micro_batch);
  const auto key = std::make_tuple(static_cast<int>(direction), boundary, src);
  if (src == stage_) {
    auto entry = local_.extract(std::make_tuple(std::get<0>(key), boundary, micro_batch));
    DTRAIN_CHECK(!entry.empty(), "pipeline rank ", stage_, ": the ", direction_name(direction),
                 " of micro-batch ", micro_batch, " at boundary ", boundary,
                 " is received before this rank produced it");
    return entry.mapped();
  }
  const bool shared = shared_memory_with(src, false);
  if (!expected_.count(key)) {
    at::Tensor header;
    if (shared) {
      header = shm_->recv(src, header_tag(direction, boundary), {kHeaderLength}, at::kLong,
                          concat("pipeline receive of the ", direction_name(direction),
                                 " header at boundary ", boundary));
    } else {
      header = at::zeros({kHeaderLength}, at::kLong);
      pp_->recv(header, src, {header_tag(direction, boundary)})->wait();
    }
    expected_.emplace(key, read_header(header, direction_name(direction)));
  }
  if (shared) {
    const Meta& meta = expected_.at(key);
    return shm_->recv(src, data_tag(direction, boundary, micro_batch), meta.sizes, meta.dtype,
                      concat("pipeline receive of the ", direction_name(direction),
                             " of micro-batch ", micro_batch, " at boundary ", boundary));
  }
  post_recv(direction, boundary, micro_batch);
  auto entry = posted_.extract(std::make_tuple(std::get<0>(key), boundary, micro_batch));
  entry.mapped().second->wait();
  if (direction == Gradient) {
    // The next stage used this micro-batch's activation before sending its gradient: that send
    // is done and its buffer (an activation) can go now, not at the end of the step. (Gloo's
    // send work reports completion only when waited for.)
    release_sends([&](const Send& send) {
      return send.direction == Activation && send.boundary == boundary &&
             send.micro_batch == micro_batch;
    });
  }
  return entry.mapped().first;
}

void StageLink::release_sends(const std::function<bool(const Send&)>& done) {
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                              [&](Send& send) {
                                if (!done(send)) return false;
                                send.work->wait();  // immediate; surfaces a failure
                                return true;
                              }),
               sends_.end());
}

void StageLink::finish_sends() {
  for (auto& send : sends_) send.work->wait();
  sends_.clear();
}

void StageLink::send_any(int boundary, const at::Tensor& tensor) {
  const int dst = peer(Activation, boundary, true, 0);
  if (dst == stage_) {
    local_[std::make_tuple(static_cast<int>(kEvalData), boundary, -1)] = tensor;
    return;
  }
  at::Tensor header = header_of(tensor, Activation);
  at::Tensor data = tensor.contiguous();
  if (shared_memory_with(dst, true)) {
    const std::string what = concat("pipeline evaluation send at boundary ", boundary);
    shm_->send(dst, header_tag(kEvalHeader, boundary), header, what);
    shm_->send(dst, header_tag(kEvalData, boundary), data, what);
    return;
  }
  auto header_work = pp_->send(header, dst, {header_tag(kEvalHeader, boundary)});
  auto data_work = pp_->send(data, dst, {header_tag(kEvalData, boundary)});
  header_work->wait();
  data_work->wait();
}

at::Tensor StageLink::recv_any(int boundary) {
  const int src = peer(Activation, boundary, false, 0);
  if (src == stage_) {
    auto entry = local_.extract(std::make_tuple(static_cast<int>(kEvalData), boundary, -1));
    DTRAIN_CHECK(!entry.empty(), "pipeline rank ", stage_, ": evaluation at boundary ", boundary,
                 " receives before this rank produced it");
    return entry.mapped();
  }
  if (shared_memory_with(src, false)) {
    const std::string what = concat("pipeline evaluation receive at boundary ", boundary);
    const Meta meta = read_header(
        shm_->recv(src, header_tag(kEvalHeader, boundary), {kHeaderLength}, at::kLong, what),
        "evaluation");
    return shm_->recv(src, header_tag(kEvalData, boundary), meta.sizes, meta.dtype, what);
  }
  at::Tensor header = at::zeros({kHeaderLength}, at::kLong);
  pp_->recv(header, src, {header_tag(kEvalHeader, boundary)})->wait();
  const Meta meta = read_header(header, "evaluation");
  at::Tensor data = at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_));
  pp_->recv(data, src, {header_tag(kEvalData, boundary)})->wait();
  return data;
}

}  // namespace dtrain::parallel::pipeline
