// The c10d ProcessGroupNCCL backend, compiled only with -DDTRAIN_CUDA=ON against a CUDA build
// of LibTorch. CUDA tensors travel through NCCL; CPU tensors (a step's loss, checkpoint
// decisions, barriers) through a Gloo group over the same ranks and store, as PyTorch's
// "cpu:gloo,cuda:nccl" backend does. Uneven reduce-scatters and allgathers (ZeRO's shards) run
// as NCCL's even ones over padded buffers, so every CUDA collective is NCCL's own, ordered on its
// stream after the caller's current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>

#include "comm/C10dWork.h"
#include "comm/PaddedShares.h"
#include "comm/gloo/GlooCommunicator.h"
#include "comm/nccl/NcclCommunicator.h"
#include "dtrain/common/Error.h"

namespace dtrain::comm::nccl {

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    case ReduceOp::Avg:
      return c10d::ReduceOp::AVG;
    case ReduceOp::Sum:
      return c10d::ReduceOp::SUM;
  }
  return c10d::ReduceOp::SUM;
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<gloo::GlooCommunicator> cpu, int rank, int size,
                   std::string name, std::vector<int> global, Milliseconds timeout)
      : Communicator(rank, size, std::move(name), std::move(global), timeout),
        cpu_(std::move(cpu)) {
    share_wire_count(*cpu_);  // CPU tensors' collectives go through cpu_: one count for both
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    group_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>(concat("nccl/", cpu_->store_prefix()),
                                               cpu_->store()),
        rank, size, options);
  }
  std::string backend_name() const override { return "nccl"; }

  WorkPtr allreduce(at::Tensor tensor, const AllreduceOptions& options) override {
    if (!tensor.is_cuda()) return cpu_->allreduce(tensor, options);
    const auto what =
        describe(concat("allreduce(", to_string(options.op), ", ", shape_string(tensor), ")"));
    count_collective("allreduce", tensor.numel(), tensor.element_size());
    at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(options.op);
    return finish(group_->allreduce(tensors, o), what, options.timeout, buffer, tensor);
  }
  WorkPtr broadcast(at::Tensor tensor, const BroadcastOptions& options) override {
    if (!tensor.is_cuda()) return cpu_->broadcast(tensor, options);
    const auto what = describe(concat("broadcast(", shape_string(tensor), ")"));
    count_collective("broadcast", tensor.numel(), tensor.element_size());
    at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
    std::vector<at::Tensor> tensors{buffer};
    c10d::BroadcastOptions o;
    o.rootRank = options.root;
    return finish(group_->broadcast(tensors, o), what, options.timeout, buffer, tensor);
  }
  WorkPtr allgather(at::Tensor output, at::Tensor input, const AllgatherOptions& options) override {
    if (!output.is_cuda()) return cpu_->allgather(output, input, options);
    const auto what = describe(concat("allgather(", shape_string(input), ")"));
    count_collective("allgather", output.numel(), output.element_size());
    const std::vector<int64_t> counts = share_counts(options.counts, output.numel(), size());
    const int64_t most = largest_share(counts);
    const bool direct = even_shares(counts) && output.is_contiguous();
    at::Tensor gathered = direct ? output.view({-1}) : at::empty({most * size()}, output.options());
    at::Tensor mine = input.reshape({-1});
    if (mine.numel() != most)
      mine = at::cat({mine, at::zeros({most - mine.numel()}, mine.options())});
    mine = mine.contiguous();
    auto work = group_->_allgather_base(gathered, mine);
    auto result = std::make_shared<C10dWork>(work, what, resolve(options.timeout), [=]() mutable {
      if (!direct) unpad_shares(gathered, counts, output);
    });
    note_collective(what, *result);
    return result;
  }
  WorkPtr reduce_scatter(at::Tensor output, at::Tensor input,
                         const ReduceScatterOptions& options) override {
    if (!input.is_cuda()) return cpu_->reduce_scatter(output, input, options);
    const auto what =
        describe(concat("reduce_scatter(", to_string(options.op), ", ", shape_string(input), ")"));
    count_collective("reduce_scatter", input.numel(), input.element_size());
    const std::vector<int64_t> counts = share_counts(options.counts, input.numel(), size());
    at::Tensor received = at::empty({largest_share(counts)}, output.options());
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(options.op);
    at::Tensor padded = pad_shares(input, counts);
    auto work = group_->_reduce_scatter_base(received, padded, o);
    const int64_t mine = counts[rank()];
    auto result = std::make_shared<C10dWork>(work, what, resolve(options.timeout), [=]() mutable {
      output.view({-1}).copy_(received.narrow(0, 0, mine));
    });
    note_collective(what, *result);
    return result;
  }
  WorkPtr all_to_all(at::Tensor output, at::Tensor input, const AllToAllOptions& options) override {
    if (!input.is_cuda()) return cpu_->all_to_all(output, input, options);
    const std::string op = concat("all_to_all(", input.scalar_type(), ")");
    const AllToAllCounts counts = prepare_all_to_all(output, input, options, op);
    const auto what = describe(op);
    const bool direct = output.is_contiguous();
    at::Tensor out = direct ? output.view({-1}) : at::empty({output.numel()}, output.options());
    at::Tensor in = input.reshape({-1}).contiguous();
    c10d::AllToAllOptions o;
    std::vector<int64_t> recv = counts.recv, send = counts.send;  // (c10d takes them by reference)
    auto work = group_->alltoall_base(out, in, recv, send, o);
    auto result = std::make_shared<C10dWork>(work, what, resolve(options.timeout), [=]() mutable {
      if (!direct) output.copy_(out.view(output.sizes()));
    });
    note_collective(what, *result);
    return result;
  }
  WorkPtr barrier(const BarrierOptions& options) override { return cpu_->barrier(options); }
  CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& name) override {
    auto cpu = std::dynamic_pointer_cast<gloo::GlooCommunicator>(cpu_->new_group(ranks, name));
    if (!cpu) return nullptr;
    std::vector<int> global;
    for (int r : ranks) global.push_back(global_ranks()[r]);
    return std::make_shared<NcclCommunicator>(cpu, cpu->rank(), cpu->size(), cpu->name(), global,
                                              timeout());
  }

 protected:
  WorkPtr send_tagged(at::Tensor tensor, int dst, int tag, Milliseconds timeout) override {
    if (!tensor.is_cuda()) return cpu_->send_internal(tensor, dst, tag, timeout);
    std::vector<at::Tensor> tensors{tensor};
    return std::make_shared<C10dWork>(group_->send(tensors, dst, tag),
                                      describe(concat("send to rank ", dst)), timeout);
  }
  WorkPtr recv_tagged(at::Tensor tensor, int src, int tag, Milliseconds timeout) override {
    if (!tensor.is_cuda()) return cpu_->recv_internal(tensor, src, tag, timeout);
    std::vector<at::Tensor> tensors{tensor};
    return std::make_shared<C10dWork>(group_->recv(tensors, src, tag),
                                      describe(concat("recv from rank ", src)), timeout);
  }

 private:
  WorkPtr finish(c10::intrusive_ptr<c10d::Work> work, const std::string& what, Milliseconds timeout,
                 at::Tensor buffer, at::Tensor tensor) {
    auto result = std::make_shared<C10dWork>(work, what, resolve(timeout), [=]() mutable {
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    });
    note_collective(what, *result);
    return result;
  }

  std::shared_ptr<gloo::GlooCommunicator> cpu_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group_;
};

}  // namespace

CommunicatorPtr create_world(const InitOptions& options) {
  // Without a device NCCL would fail deep inside c10d (or crash): one line instead.
  const int devices = static_cast<int>(c10::cuda::device_count());
  DTRAIN_CHECK_INPUT(devices > 0, "backend nccl needs a CUDA device; none is visible to rank ",
                     options.rank, " (CUDA_VISIBLE_DEVICES='",
                     std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "",
                     "'); use --backend gloo");
  // One device per local rank, as torchrun's LOCAL_RANK convention has it.
  const char* local = std::getenv("LOCAL_RANK");
  const int local_rank = local ? std::atoi(local) : options.rank;
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank % devices));
  // The Gloo world hosts (or reaches) the rendezvous store; NCCL's groups rendezvous there too.
  auto cpu = gloo::create_world(options);
  return std::make_shared<NcclCommunicator>(cpu, options.rank, options.world_size, "world",
                                            cpu->global_ranks(), options.timeout);
}

}  // namespace dtrain::comm::nccl
