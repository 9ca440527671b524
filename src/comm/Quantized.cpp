// Block-quantized allgather and reduce-scatter (see dtrain/comm/Quantized.h).
#include "dtrain/comm/Quantized.h"

#include <ATen/ATen.h>

#include <mutex>
#include <numeric>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

namespace {

// Tag of the reduce-scatter's point-to-point messages (below the pipeline's StageLink tags, which
// count down from kMaxUserTag).
constexpr int kQuantizedTag = kMaxUserTag / 2 + 17;

int64_t blocks_of(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

/// `values` (1-D) as one byte message: int8 codes then float32 scales (identity: the values'
/// own bytes).
at::Tensor pack(const at::Tensor& values, const BlockQuantization& q) {
  if (q.identity) return values.contiguous().view(at::kByte).clone();
  const int64_t numel = values.numel();
  const int64_t blocks = blocks_of(numel, q.block);
  at::Tensor padded = at::zeros({blocks * q.block}, values.options().dtype(at::kFloat));
  padded.narrow(0, 0, numel).copy_(values);
  padded = padded.view({blocks, q.block});
  const at::Tensor scales = padded.abs().amax(1).div_(127.0);
  const at::Tensor inverse = at::where(scales > 0, scales.reciprocal(), at::zeros_like(scales));
  at::Tensor message =
      at::empty({blocks * q.block + blocks * 4}, values.options().dtype(at::kByte));
  message.narrow(0, 0, blocks * q.block)
      .copy_(padded.mul(inverse.unsqueeze(1))
                 .round_()
                 .clamp_(-127, 127)
                 .to(at::kChar)
                 .view({-1})
                 .view(at::kByte));
  message.narrow(0, blocks * q.block, blocks * 4).copy_(scales.view(at::kByte));
  return message;
}

/// The values of a message of `numel` elements, in `like`'s dtype and device.
at::Tensor unpack(const at::Tensor& message, int64_t numel, const BlockQuantization& q,
                  const at::Tensor& like) {
  if (q.identity) return message.view(like.scalar_type());
  const int64_t blocks = blocks_of(numel, q.block);
  const at::Tensor codes = message.narrow(0, 0, blocks * q.block).view(at::kChar);
  const at::Tensor scales = message.narrow(0, blocks * q.block, blocks * 4).view(at::kFloat);
  return codes.to(at::kFloat)
      .view({blocks, q.block})
      .mul_(scales.unsqueeze(1))
      .view({-1})
      .narrow(0, 0, numel)
      .to(like.scalar_type());
}

/// Several works and what to do once they are all done (run once, by the first wait()).
class ThenWork : public Work {
 public:
  ThenWork(std::vector<WorkPtr> inner, std::function<void()> then, std::string description,
           Milliseconds timeout)
      : inner_(std::move(inner)),
        then_(std::move(then)),
        description_(std::move(description)),
        timeout_(timeout) {}
  void wait(Milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    for (auto& work : inner_) work->wait(timeout);
    then_();
    done_ = true;
  }
  bool is_completed() override {
    for (auto& work : inner_) {
      if (!work->is_completed()) return false;
    }
    return true;
  }
  const std::string& description() const override { return description_; }
  Milliseconds default_timeout() const override { return timeout_; }

 private:
  std::vector<WorkPtr> inner_;
  std::function<void()> then_;
  std::string description_;
  Milliseconds timeout_;
  std::mutex mutex_;
  bool done_ = false;
};

}  // namespace

int64_t quantized_bytes(int64_t numel, const BlockQuantization& q, int64_t element_size) {
  if (q.identity) return numel * element_size;
  const int64_t blocks = blocks_of(numel, q.block);
  return blocks * q.block + blocks * 4;
}

WorkPtr quantized_allgather(Communicator& comm, at::Tensor output, at::Tensor input,
                            const BlockQuantization& q) {
  DTRAIN_CHECK(q.enabled(), "quantized_allgather needs a block size");
  const int64_t share = input.numel();
  DTRAIN_CHECK(output.numel() == share * comm.size() && output.is_contiguous(),
               "quantized_allgather on group '", comm.name(), "': output of ", output.numel(),
               " elements for ", comm.size(), " shares of ", share);
  const at::Tensor message = pack(input.reshape({-1}), q);
  at::Tensor gathered = at::empty({message.numel() * comm.size()}, message.options());
  WorkPtr work = comm.allgather(gathered, message);
  const int64_t bytes = message.numel();
  const int ranks = comm.size();
  auto then = [=]() mutable {
    at::Tensor flat = output.view({-1});
    for (int r = 0; r < ranks; ++r) {
      flat.narrow(0, r * share, share)
          .copy_(unpack(gathered.narrow(0, r * bytes, bytes), share, q, output));
    }
  };
  return std::make_shared<ThenWork>(std::vector<WorkPtr>{work}, then,
                                    work->description() + " [int8 blocks]",
                                    work->default_timeout());
}

WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, at::Tensor input,
                                 std::vector<int64_t> counts, const BlockQuantization& q) {
  DTRAIN_CHECK(q.enabled(), "quantized_reduce_scatter needs a block size");
  const int ranks = comm.size();
  const int me = comm.rank();
  if (counts.empty()) {
    DTRAIN_CHECK(input.numel() % ranks == 0, "quantized_reduce_scatter on group '", comm.name(),
                 "': ", input.numel(), " elements do not split evenly over ", ranks, " ranks");
    counts.assign(ranks, input.numel() / ranks);
  }
  DTRAIN_CHECK(static_cast<int>(counts.size()) == ranks &&
                   std::accumulate(counts.begin(), counts.end(), int64_t{0}) == input.numel() &&
                   output.numel() == counts[me],
               "quantized_reduce_scatter on group '", comm.name(), "': counts do not match");
  const at::Tensor flat = input.reshape({-1});
  std::vector<int64_t> offsets(ranks + 1, 0);
  for (int r = 0; r < ranks; ++r) offsets[r + 1] = offsets[r] + counts[r];
  // Every send is posted before any receive is waited for: no rank waits on another's order.
  std::vector<WorkPtr> works;
  std::vector<at::Tensor> keep;  // messages in flight
  for (int r = 0; r < ranks; ++r) {
    if (r == me || counts[r] == 0) continue;
    keep.push_back(pack(flat.narrow(0, offsets[r], counts[r]), q));
    works.push_back(comm.send(keep.back(), r, {kQuantizedTag}));
  }
  const int64_t mine = counts[me];
  const int64_t bytes = quantized_bytes(mine, q, input.element_size());
  std::vector<at::Tensor> received(ranks);
  if (mine > 0) {
    for (int r = 0; r < ranks; ++r) {
      if (r == me) continue;
      received[r] = at::empty({bytes}, input.options().dtype(at::kByte));
      works.push_back(comm.recv(received[r], r, {kQuantizedTag}));
    }
  }
  const at::Tensor own = flat.narrow(0, offsets[me], mine).clone();
  auto then = [=]() mutable {
    at::Tensor sum = own;
    for (int r = 0; r < ranks; ++r) {
      if (received[r].defined()) sum.add_(unpack(received[r], mine, q, own));
    }
    output.view({-1}).copy_(sum);
    keep.clear();
  };
  return std::make_shared<ThenWork>(works, then,
                                    concat("quantized reduce_scatter(", input.numel(),
                                           " elements) on group '", comm.name(), "' at rank ", me),
                                    comm.timeout());
}

}  // namespace dtrain::comm
