// Wraps c10d's ProcessGroupGloo: native allreduce/broadcast/barrier/send/recv, with dtrain's
// timeouts and error messages; AVG and bfloat16 (which Gloo 1.13 lacks) are added here, and CUDA
// tensors travel through pinned host memory (Gloo reads and writes host memory).
#include "comm/gloo/GlooCommunicator.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>

#include "comm/C10dWork.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"

namespace dtrain::comm::gloo {

namespace {

bool gloo_reduces(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// The host tensor Gloo works on: the tensor itself when it is a contiguous CPU tensor, else a
// contiguous copy; a CUDA tensor's is pinned, filled (`fill`) by a copy that waits for the
// device's pending work on it. The caller copies results back once the op completes.
at::Tensor host_buffer(const at::Tensor& tensor, bool fill = true) {
  if (tensor.is_cpu()) return tensor.is_contiguous() ? tensor : tensor.contiguous();
  at::Tensor host =
      at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(true));
  if (fill) host.copy_(tensor);
  return host;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Gloo's TCP pairs write with writev, which raises SIGPIPE when the peer has closed its end (a
// replica that died or was fenced, a group abandoned by its members); its default action ends
// the process before Gloo can report the broken pair as an error. Python ignores SIGPIPE, which
// is why PyTorch never meets it; a C++ process must do it itself. A handler the program set
// (anything but the default) is left alone.
void ignore_broken_pipes() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      sigaction(SIGPIPE, &ignore, nullptr);
    }
  });
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Milliseconds timeout,
    const std::shared_ptr<::gloo::transport::Device>& device, int threads,
    const std::string& what) {
  ignore_broken_pipes();
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  options->threads = threads;
  try {
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    // Gloo's connect returns on one side of a pair before the other side has finished its
    // handshake; a member that then drops the group at once (a test body ending, a group
    // used for nothing) closes the socket under the peer, which fails with "connection
    // closed by peer". Nobody leaves until every member is connected.
    if (size > 1) {
      c10d::BarrierOptions barrier;
      barrier.timeout = timeout;
      group->barrier(barrier)->wait(timeout);
    }
    return group;
  } catch (const std::exception& e) {
    DTRAIN_THROW(CommError, "connecting ", what, " (rank ", rank, " of ", size,
                 ") failed: ", first_line(e.what()));
  }
}

// A key's value without blocking, atomically: compare-and-set with a value no key holds
// returns the key's value, or that value when the key is absent (and sets nothing). A check
// then a get would block for the store's whole timeout when another rank deletes the key in
// between (the fault-tolerant replicas remove join and decision keys while others read them).
std::optional<std::string> read_key(c10d::Store& store, const std::string& key) {
  static const std::vector<uint8_t> kAbsent = {0,   'd', 't', 'r', 'a', 'i', 'n', '-',
                                               'a', 'b', 's', 'e', 'n', 't', 0};
  const std::vector<uint8_t> bytes = store.compareSet(key, kAbsent, kAbsent);
  if (bytes == kAbsent) return std::nullopt;
  return std::string(bytes.begin(), bytes.end());
}

// The progress board in the rendezvous store.
class StoreBoard : public ProgressBoard {
 public:
  explicit StoreBoard(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void publish(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::optional<std::string> read(const std::string& key) override {
    return read_key(*store_, key);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// The store's keys for protocols above the collectives.
class StoreKeyValue : public KeyValue {
 public:
  explicit StoreKeyValue(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    guard("set", key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::optional<std::string> read(const std::string& key) override {
    std::optional<std::string> value;
    guard("read", key, [&] { value = read_key(*store_, key); });
    return value;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t sum = 0;
    guard("add", key, [&] { sum = store_->add(key, delta); });
    return sum;
  }
  std::string set_if_absent(const std::string& key, const std::string& value) override {
    std::string held;
    guard("set_if_absent", key, [&] {
      const auto bytes =
          store_->compareSet(key, {}, std::vector<uint8_t>(value.begin(), value.end()));
      held.assign(bytes.begin(), bytes.end());
    });
    return held;
  }
  void remove(const std::string& key) override {
    guard("remove", key, [&] { store_->deleteKey(key); });
  }

 private:
  template <typename Fn>
  void guard(const char* op, const std::string& key, Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      DTRAIN_THROW(CommError, "the rendezvous store failed (", op, " '", key,
                   "'): ", first_line(e.what()));
    }
  }
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> root_store,
                                   std::string store_prefix, int rank, int size, std::string name,
                                   std::vector<int> global_ranks, Milliseconds timeout,
                                   std::shared_ptr<::gloo::transport::Device> device, int threads,
                                   bool connect)
    : Communicator(rank, size, std::move(name), std::move(global_ranks), timeout),
      root_store_(std::move(root_store)),
      store_prefix_(std::move(store_prefix)),
      device_(std::move(device)),
      threads_(threads) {
  if (connect) {
    auto store = c10::make_intrusive<c10d::PrefixStore>(store_prefix_, root_store_);
    group_ = make_group(store, rank, size, timeout, device_, threads_,
                        concat("group '", this->name(), "'"));
  }
  track_progress(std::make_shared<StoreBoard>(root_store_),
                 concat("progress/", store_prefix_, "/"));
}

GlooCommunicator::~GlooCommunicator() = default;

c10d::ProcessGroupGloo& GlooCommunicator::connected(const std::string& what) const {
  DTRAIN_CHECK(group_, describe(what), ": world rank ", global_ranks()[rank()],
               " joined as a replacement replica (--fault-tolerance replicas): group '", name(),
               "' never formed here; only the replica group it was admitted to carries its "
               "collectives");
  return *group_;
}

WorkPtr GlooCommunicator::allreduce(at::Tensor tensor, const AllreduceOptions& options) {
  const std::string what =
      concat("allreduce(", to_string(options.op), ", ", shape_string(tensor), ")");
  const auto timeout = resolve(options.timeout);
  const bool floating = at::isFloatingType(tensor.scalar_type());
  DTRAIN_CHECK(options.op != ReduceOp::Avg || floating, describe(what),
               ": avg needs a floating-point tensor");
  if (size() == 1) return completed_work(describe(what));
  check_matching(what);
  count_collective("allreduce", tensor.numel(), tensor.element_size());
  if (!gloo_reduces(tensor.scalar_type())) {
    DTRAIN_CHECK(floating, "backend gloo does not support ", describe(what));
    return ring_allreduce(tensor, options.op, timeout, what);  // bfloat16
  }
  at::Tensor buffer = host_buffer(tensor);
  std::vector<at::Tensor> tensors{buffer};
  c10d::AllreduceOptions c10d_options;
  c10d_options.reduceOp = to_c10d(options.op);
  c10d_options.timeout = timeout;
  auto work =
      issue(describe(what), [&] { return connected(what).allreduce(tensors, c10d_options); });
  const int world = size();
  const bool average = options.op == ReduceOp::Avg;
  auto result = std::make_shared<C10dWork>(work, describe(what), timeout, [=]() mutable {
    if (average) buffer.div_(world);
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  });
  note_collective(what, *result);
  return result;
}

WorkPtr GlooCommunicator::broadcast(at::Tensor tensor, const BroadcastOptions& options) {
  const std::string what =
      concat("broadcast(", shape_string(tensor), " from rank ", options.root, ")");
  DTRAIN_CHECK(options.root >= 0 && options.root < size(), describe(what), ": bad root");
  const auto timeout = resolve(options.timeout);
  if (size() == 1) return completed_work(describe(what));
  check_matching(what);
  count_collective("broadcast", tensor.numel(), tensor.element_size());
  at::Tensor buffer = host_buffer(tensor, /*fill=*/options.root == rank());
  // Broadcast moves bytes only, so dtypes Gloo cannot reduce travel as a same-size type.
  at::Tensor wire = buffer;
  if (!gloo_reduces(buffer.scalar_type())) {
    switch (buffer.element_size()) {
      case 1:
        wire = buffer.view(at::kByte);
        break;
      case 2:
        wire = buffer.view(at::kHalf);
        break;
      case 4:
        wire = buffer.view(at::kInt);
        break;
      case 8:
        wire = buffer.view(at::kLong);
        break;
      default:
        DTRAIN_THROW(Error, "backend gloo does not support ", describe(what));
    }
  }
  std::vector<at::Tensor> tensors{wire};
  c10d::BroadcastOptions c10d_options;
  c10d_options.rootRank = options.root;
  c10d_options.timeout = timeout;
  auto work =
      issue(describe(what), [&] { return connected(what).broadcast(tensors, c10d_options); });
  auto result = std::make_shared<C10dWork>(work, describe(what), timeout, [=]() mutable {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  });
  note_collective(what, *result);
  return result;
}

WorkPtr GlooCommunicator::barrier(const BarrierOptions& options) {
  const auto timeout = resolve(options.timeout);
  if (size() == 1) return completed_work(describe("barrier"));
  check_matching("barrier");
  c10d::BarrierOptions c10d_options;
  c10d_options.timeout = timeout;
  auto work =
      issue(describe("barrier"), [&] { return connected("barrier").barrier(c10d_options); });
  auto result = std::make_shared<C10dWork>(work, describe("barrier"), timeout);
  note_collective("barrier", *result);
  return result;
}

WorkPtr GlooCommunicator::send_tagged(at::Tensor tensor, int dst, int tag, Milliseconds timeout) {
  std::vector<at::Tensor> tensors{tensor.is_cpu() ? tensor : host_buffer(tensor)};
  const std::string what =
      concat("send(", shape_string(tensor), " to rank ", dst, ", tag ", tag, ")");
  auto work = issue(describe(what), [&] { return connected(what).send(tensors, dst, tag); });
  return std::make_shared<C10dWork>(work, describe(what), timeout);
}

WorkPtr GlooCommunicator::recv_tagged(at::Tensor tensor, int src, int tag, Milliseconds timeout) {
  const at::Tensor buffer = tensor.is_cpu() ? tensor : host_buffer(tensor, /*fill=*/false);
  std::vector<at::Tensor> tensors{buffer};
  const std::string what =
      concat("recv(", shape_string(tensor), " from rank ", src, ", tag ", tag, ")");
  auto work = issue(describe(what), [&] { return connected(what).recv(tensors, src, tag); });
  return std::make_shared<C10dWork>(work, describe(what), timeout, [=]() mutable {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
  });
}

CommunicatorPtr GlooCommunicator::new_group(const std::vector<int>& ranks,
                                            const std::string& name) {
  const int index = groups_created_++;
  DTRAIN_CHECK(!ranks.empty(), "new_group('", name, "') with no ranks on group '", this->name(),
               "'");
  int my_rank = -1;
  std::vector<int> global;
  for (size_t i = 0; i < ranks.size(); ++i) {
    DTRAIN_CHECK(ranks[i] >= 0 && ranks[i] < size(), "new_group('", name, "'): rank ", ranks[i],
                 " is not in group '", this->name(), "' of size ", size());
    if (ranks[i] == rank()) my_rank = static_cast<int>(i);
    global.push_back(global_ranks()[ranks[i]]);
  }
  if (my_rank < 0) return nullptr;
  // Cut from a group that never formed (a replacement's world): it does not form either, unless
  // it is this rank alone.
  auto group = std::make_shared<GlooCommunicator>(
      root_store_, concat(store_prefix_, "/", index), my_rank, static_cast<int>(ranks.size()),
      name.empty() ? concat("group", index) : name, global, timeout(), device_, threads_,
      formed() || ranks.size() == 1);
  group->share_wire_count(*this);
  return group;
}

std::shared_ptr<KeyValue> GlooCommunicator::key_value() const {
  return std::make_shared<StoreKeyValue>(root_store_);
}

CommunicatorPtr GlooCommunicator::regroup(const std::vector<int>& world_ranks,
                                          const std::string& key, const std::string& name) {
  const auto mine = std::find(world_ranks.begin(), world_ranks.end(), global_ranks()[rank()]);
  DTRAIN_CHECK(mine != world_ranks.end(), "regroup('", name, "'): world rank ",
               global_ranks()[rank()], " is not among the ranks of the new group");
  auto group = std::make_shared<GlooCommunicator>(
      root_store_, concat("regroup/", key), static_cast<int>(mine - world_ranks.begin()),
      static_cast<int>(world_ranks.size()), name, world_ranks, timeout(), device_, threads_);
  group->share_wire_count(*this);
  return group;
}

std::shared_ptr<GlooCommunicator> create_world(const InitOptions& options) {
  DTRAIN_CHECK_INPUT(options.world_size >= 1, "world size must be >= 1, got ", options.world_size);
  DTRAIN_CHECK_INPUT(options.rank >= 0 && options.rank < options.world_size, "rank ", options.rank,
                     " is outside the world of size ", options.world_size);
  DTRAIN_CHECK_INPUT(options.master_port > 0 && options.master_port < 65536,
                     "master port must be in 1..65535, got ", options.master_port);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(options.master_port);
  store_options.isServer = options.rank == 0 && !options.store_hosted_by_launcher;
  store_options.numWorkers = options.world_size;
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.master_addr, store_options);
  } catch (const std::exception& e) {
    DTRAIN_THROW(CommError, "rank ", options.rank, " could not ",
                 store_options.isServer ? "host" : "reach", " the rendezvous store at ",
                 options.master_addr, ":", options.master_port, " within ",
                 options.timeout.count() / 1000.0, " s: ", first_line(e.what()));
  }
  if (!options.store_prefix.empty()) {
    store = c10::make_intrusive<c10d::PrefixStore>(options.store_prefix, store);
  }
  std::shared_ptr<::gloo::transport::Device> device;
  std::string interface = options.interface;
  if (interface.empty()) {
    if (const char* env = std::getenv("GLOO_SOCKET_IFNAME")) interface = env;
  }
  if (!interface.empty()) {
    device = c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  } else if (is_loopback(options.master_addr)) {
    device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  } else {
    // Not the host name (Debian maps it to 127.0.1.1, which the other hosts cannot reach): the
    // address this host reaches the master from.
    const LocalRoute route = route_to(options.master_addr);
    const char* local_rank = std::getenv("LOCAL_RANK");
    if (local_rank == nullptr || std::string(local_rank) == "0") {
      std::fprintf(stderr,
                   "dtrain: rank %d reaches %s from %s%s%s (set --interface or "
                   "GLOO_SOCKET_IFNAME to choose another)\n",
                   options.rank, options.master_addr.c_str(), route.address.c_str(),
                   route.interface.empty() ? "" : " on ", route.interface.c_str());
    }
    device = c10d::ProcessGroupGloo::createDeviceForHostname(route.address);
  }
  std::vector<int> global(options.world_size);
  for (int r = 0; r < options.world_size; ++r) global[r] = r;
  // A replacement replica (--fault-tolerance replicas; its launcher says so) starts while the
  // others train: the world never forms again. It meets them in the replica group that admits
  // it (GlooCommunicator::regroup), through the same store.
  const bool replacement = std::getenv("DTRAIN_FT_REPLACEMENT") != nullptr;
  return std::make_shared<GlooCommunicator>(store, "world", options.rank, options.world_size,
                                            "world", global, options.timeout, device,
                                            options.backend_threads, !replacement);
}

}  // namespace dtrain::comm::gloo
