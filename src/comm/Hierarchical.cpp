// Hierarchical allreduce: local reduce-scatter, cross-host allreduce, local allgather.
#include "dtrain/comm/Hierarchical.h"

#include <ATen/ATen.h>

#include <vector>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

HierarchicalAllreduce::HierarchicalAllreduce(const CommunicatorPtr& comm, int ranks_per_host) {
  DTRAIN_CHECK_INPUT(ranks_per_host >= 1, "ranks per host must be >= 1, got ", ranks_per_host);
  const int host = comm->global_ranks()[comm->rank()] / ranks_per_host;
  local_ = comm->split(host, comm->rank(), concat(comm->name(), "/host"));
  // Every host must hold the same number of the group's ranks: a local rank's peers are the
  // same local rank elsewhere.
  at::Tensor sizes = at::zeros({2}, at::kLong);
  sizes[0] = local_->size();
  sizes[1] = -local_->size();
  comm->allreduce(sizes, {ReduceOp::Max})->wait();
  const int64_t most = sizes[0].item<int64_t>(), fewest = -sizes[1].item<int64_t>();
  DTRAIN_CHECK_INPUT(most == fewest, "hierarchical allreduce on group '", comm->name(),
                     "': hosts hold ", fewest, " to ", most, " of its ranks (", ranks_per_host,
                     " ranks per host); every host needs the same number");
  cross_ = comm->split(local_->rank(), comm->rank(), concat(comm->name(), "/cross"));
  thread_ = std::thread([this] { thread_main(); });
}

HierarchicalAllreduce::~HierarchicalAllreduce() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

WorkPtr HierarchicalAllreduce::allreduce(at::Tensor tensor) {
  DTRAIN_CHECK(tensor.is_contiguous(), "hierarchical allreduce needs a contiguous tensor");
  auto work = std::make_shared<PromiseWork>(
      concat("hierarchical allreduce(", tensor.numel(), " elements) on groups '", local_->name(),
             "' and '", cross_->name(), "'"),
      local_->timeout() + cross_->timeout());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back([this, tensor, work] {
      try {
        run(tensor);
        work->finish();
      } catch (...) {
        work->finish(std::current_exception());
      }
    });
  }
  cv_.notify_all();
  return work;
}

void HierarchicalAllreduce::run(const at::Tensor& tensor) {
  const at::Tensor flat = tensor.view({-1});
  const int L = local_->size();
  std::vector<int64_t> counts(L, flat.numel() / L);
  for (int64_t r = 0; r < flat.numel() % L; ++r) ++counts[r];
  int64_t offset = 0;
  for (int r = 0; r < local_->rank(); ++r) offset += counts[r];
  at::Tensor share = flat.narrow(0, offset, counts[local_->rank()]).clone();
  ReduceScatterOptions scatter;
  scatter.counts = counts;
  local_->reduce_scatter(share, flat, scatter)->wait();
  cross_->allreduce(share)->wait();
  AllgatherOptions gather;
  gather.counts = counts;
  local_->allgather(flat, share, gather)->wait();
}

void HierarchicalAllreduce::thread_main() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

}  // namespace dtrain::comm
