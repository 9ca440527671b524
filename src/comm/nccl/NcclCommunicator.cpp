// The c10d ProcessGroupNCCL backend, compiled only with -DDTRAIN_CUDA=ON against a CUDA build
// of LibTorch. Collectives run on CUDA tensors through NCCL; the ring algorithms of the
// Communicator base class (reduce-scatter, uneven allgather) run over NCCL send/recv.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/C10dWork.h"
#include "comm/nccl/NcclCommunicator.h"
#include "dtrain/common/Error.h"

#include <cstdlib>

namespace dtrain::comm::nccl_backend {

namespace {

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int size,
                   std::string name, std::vector<int> global, Milliseconds timeout)
      : Communicator(rank, size, std::move(name), std::move(global), timeout),
        store_(std::move(store)),
        prefix_(std::move(prefix)) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    group_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>(prefix_, store_), rank, size, options);
  }
  std::string backend_name() const override { return "nccl"; }
  WorkPtr allreduce(at::Tensor tensor, const AllreduceOptions& options) override {
    const auto what =
        describe(concat("allreduce(", to_string(options.op), ", ", shape_string(tensor), ")"));
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = options.op == ReduceOp::Max   ? c10d::ReduceOp::MAX
                 : options.op == ReduceOp::Min ? c10d::ReduceOp::MIN
                 : options.op == ReduceOp::Avg ? c10d::ReduceOp::AVG
                                               : c10d::ReduceOp::SUM;
    return std::make_shared<C10dWork>(group_->allreduce(tensors, o), what,
                                      resolve(options.timeout));
  }
  WorkPtr broadcast(at::Tensor tensor, const BroadcastOptions& options) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = options.root;
    return std::make_shared<C10dWork>(group_->broadcast(tensors, o),
                                      describe(concat("broadcast(", shape_string(tensor), ")")),
                                      resolve(options.timeout));
  }
  WorkPtr barrier(const BarrierOptions& options) override {
    return std::make_shared<C10dWork>(group_->barrier(), describe("barrier"),
                                      resolve(options.timeout));
  }
  CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& name) override {
    const int index = groups_++;
    int mine = -1;
    std::vector<int> global;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank()) mine = static_cast<int>(i);
      global.push_back(global_ranks()[ranks[i]]);
    }
    if (mine < 0) return nullptr;
    return std::make_shared<NcclCommunicator>(store_, concat(prefix_, "/", index), mine,
                                              static_cast<int>(ranks.size()), name, global,
                                              timeout());
  }

 protected:
  WorkPtr send_tagged(at::Tensor tensor, int dst, int tag, Milliseconds timeout) override {
    std::vector<at::Tensor> tensors{tensor};
    return std::make_shared<C10dWork>(group_->send(tensors, dst, tag),
                                      describe(concat("send to rank ", dst)), timeout);
  }
  WorkPtr recv_tagged(at::Tensor tensor, int src, int tag, Milliseconds timeout) override {
    std::vector<at::Tensor> tensors{tensor};
    return std::make_shared<C10dWork>(group_->recv(tensors, src, tag),
                                      describe(concat("recv from rank ", src)), timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int groups_ = 0;
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
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(options.master_port);
  store_options.isServer = options.rank == 0;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, store_options);
  std::vector<int> global(options.world_size);
  for (int r = 0; r < options.world_size; ++r) global[r] = r;
  return std::make_shared<NcclCommunicator>(store, "world", options.rank, options.world_size,
                                            "world", global, options.timeout);
}

}  // namespace dtrain::comm::nccl_backend
