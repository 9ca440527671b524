#include "comm/SharedMemoryChannel.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x64747273;  // "dtrs"
constexpr int64_t kControlBytes = 4096;
constexpr auto kAliveCheck = std::chrono::milliseconds(200);

// The ring's control block, at the start of the shared file; the data follows at kControlBytes.
struct Control {
  alignas(64) std::atomic<uint64_t> written{0};
  alignas(64) std::atomic<uint64_t> read{0};
  alignas(64) std::atomic<uint32_t> data_seq{0};   // futex word: bumped after every write
  alignas(64) std::atomic<uint32_t> space_seq{0};  // futex word: bumped after every read
  uint64_t capacity = 0;
  uint32_t magic = 0;
};
static_assert(sizeof(Control) <= kControlBytes, "control block fits its page");
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

struct MessageHeader {
  int64_t tag;
  int64_t bytes;
};

// Futex on a word other processes map too (so not FUTEX_PRIVATE).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string pid_namespace() {
  char buffer[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string("?");
}

std::string random_token() {
  std::random_device device;
  std::ostringstream out;
  out << std::hex << device() << device() << device() << device();
  return out.str();
}

}  // namespace

struct SharedMemoryChannel::Ring {
  std::string path;
  int fd = -1;
  void* base = nullptr;
  size_t map_bytes = 0;
  Control* control = nullptr;
  char* data = nullptr;
  uint64_t capacity = 0;
  // Receiving side: the message being read.
  MessageHeader header{};
  int64_t header_filled = 0;
  at::Tensor payload;
  int64_t payload_filled = 0;

  ~Ring() {
    if (base) ::munmap(base, map_bytes);
    if (fd >= 0) ::close(fd);
  }

  bool map(int flags, int64_t ring_bytes, bool create) {
    fd = ::open(path.c_str(), flags, 0600);
    if (fd < 0) return false;
    if (create && ::ftruncate(fd, kControlBytes + ring_bytes) != 0) return false;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size <= kControlBytes) return false;
    map_bytes = static_cast<size_t>(st.st_size);
    base = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      base = nullptr;
      return false;
    }
    control = static_cast<Control*>(base);
    data = static_cast<char*>(base) + kControlBytes;
    if (create) {
      new (control) Control();
      control->capacity = static_cast<uint64_t>(ring_bytes);
      std::atomic_thread_fence(std::memory_order_release);
      control->magic = kMagic;
    }
    capacity = control->capacity;
    if (control->magic != kMagic || capacity != map_bytes - kControlBytes) return false;
    // Fault every page in now, not on the first transfers: a first touch of a shared page costs
    // ~2 us (a 512 KB message took 1 ms instead of 0.03), and MAP_POPULATE does not map shared
    // pages for writing. The creator allocates them (writes), the other end maps them (reads).
    if (create) {
      std::memset(data, 0, capacity);
    } else {
      volatile char sink = 0;
      for (uint64_t i = 0; i < capacity; i += 4096) sink = sink + data[i];
    }
    return true;
  }

  // Copies up to `n` bytes in; returns how many fitted.
  uint64_t write_some(const char* from, uint64_t n) {
    const uint64_t w = control->written.load(std::memory_order_relaxed);
    const uint64_t r = control->read.load(std::memory_order_acquire);
    const uint64_t k = std::min(n, capacity - (w - r));
    if (k == 0) return 0;
    const uint64_t offset = w % capacity;
    const uint64_t first = std::min(k, capacity - offset);
    std::memcpy(data + offset, from, first);
    std::memcpy(data, from + first, k - first);
    control->written.store(w + k, std::memory_order_release);
    control->data_seq.fetch_add(1, std::memory_order_release);
    futex_wake(&control->data_seq);
    return k;
  }

  // Copies up to `n` available bytes out; returns how many.
  uint64_t read_some(char* to, uint64_t n) {
    const uint64_t r = control->read.load(std::memory_order_relaxed);
    const uint64_t w = control->written.load(std::memory_order_acquire);
    const uint64_t k = std::min(n, w - r);
    if (k == 0) return 0;
    const uint64_t offset = r % capacity;
    const uint64_t first = std::min(k, capacity - offset);
    std::memcpy(to, data + offset, first);
    std::memcpy(to + first, data, k - first);
    control->read.store(r + k, std::memory_order_release);
    control->space_seq.fetch_add(1, std::memory_order_release);
    futex_wake(&control->space_seq);
    return k;
  }

  // Reads what is available of the current message; returns it once complete (else undefined).
  at::Tensor pump(bool* progressed) {
    *progressed = false;
    auto* header_bytes = reinterpret_cast<char*>(&header);
    while (header_filled < static_cast<int64_t>(sizeof(header))) {
      const uint64_t got = read_some(header_bytes + header_filled, sizeof(header) - header_filled);
      if (got == 0) return {};
      *progressed = true;
      header_filled += static_cast<int64_t>(got);
      if (header_filled == static_cast<int64_t>(sizeof(header))) {
        DTRAIN_CHECK(header.bytes >= 0, "shared-memory ring ", path, ": corrupt message header");
        payload = at::empty({header.bytes}, at::kByte);
        payload_filled = 0;
      }
    }
    while (payload_filled < header.bytes) {
      const uint64_t got = read_some(reinterpret_cast<char*>(payload.data_ptr()) + payload_filled,
                                     header.bytes - payload_filled);
      if (got == 0) return {};
      *progressed = true;
      payload_filled += static_cast<int64_t>(got);
    }
    header_filled = 0;
    at::Tensor done = std::move(payload);
    payload = at::Tensor();
    return done;
  }
};

SharedMemoryChannel::SharedMemoryChannel(const CommunicatorPtr& group,
                                         const std::vector<std::pair<int, int>>& pairs,
                                         int64_t ring_bytes)
    : group_(group) {
  DTRAIN_CHECK(ring_bytes >= 4096, "shared-memory ring of ", ring_bytes, " bytes (at least 4096)");
  const int me = group_->rank();
  const std::string mine = concat(random_token(), " ", ::getpid(), " ", pid_namespace());
  const std::vector<std::string> everyone = allgather_strings(*group_, mine);
  std::vector<std::string> namespaces;
  for (const auto& entry : everyone) {
    std::istringstream in(entry);
    std::string token, ns;
    int64_t pid = 0;
    in >> token >> pid >> ns;
    pids_.push_back(pid);
    namespaces.push_back(ns);
  }
  // A dead peer is noticed by its pid, where it means the same process as here.
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (namespaces[r] != namespaces[me]) pids_[r] = 0;
  }
  const std::string token = everyone[0].substr(0, everyone[0].find(' '));
  auto path_of = [&](int src, int dst) {
    return concat("/dev/shm/dtrain-", token, "-", group_->name(), "-", src, "-", dst);
  };
  std::map<std::pair<int, int>, std::unique_ptr<Ring>> made;
  for (const auto& [src, dst] : pairs) {
    if (src != me || src == dst || made.count({src, dst})) continue;
    auto ring = std::make_unique<Ring>();
    ring->path = path_of(src, dst);
    if (ring->map(O_RDWR | O_CREAT | O_EXCL, ring_bytes, true)) made[{src, dst}] = std::move(ring);
  }
  group_->barrier()->wait();
  std::string opened;
  for (const auto& [src, dst] : pairs) {
    if (dst != me || src == dst || made.count({src, dst})) continue;
    auto ring = std::make_unique<Ring>();
    ring->path = path_of(src, dst);
    if (ring->map(O_RDWR, 0, false)) {
      made[{src, dst}] = std::move(ring);
      opened += concat(src, "-", dst, " ");
    }
  }
  // Both ends keep a ring only if the receiver could map it; then the name can go.
  const std::vector<std::string> receivers = allgather_strings(*group_, opened);
  for (auto& [key, ring] : made) {
    const bool both =
        receivers[key.second].find(concat(key.first, "-", key.second, " ")) != std::string::npos;
    if (key.first == me) ::unlink(ring->path.c_str());
    if (both) rings_[key] = std::move(ring);
  }
}

SharedMemoryChannel::~SharedMemoryChannel() = default;

bool SharedMemoryChannel::connected(int src, int dst) const { return rings_.count({src, dst}) > 0; }

SharedMemoryChannel::Ring* SharedMemoryChannel::ring(int src, int dst) const {
  const auto it = rings_.find({src, dst});
  DTRAIN_CHECK(it != rings_.end(), "no shared-memory ring from rank ", src, " to rank ", dst,
               " of group '", group_->name(), "'");
  return it->second.get();
}

std::string SharedMemoryChannel::describe(const std::string& what, int peer) const {
  return concat(what, " (shared memory, group '", group_->name(), "', rank ", group_->rank(),
                " with rank ", peer, " = world rank ", group_->global_ranks()[peer], ")");
}

namespace {

// Waits on `word` (a futex bumped by the peer) until it moves, the slice ends or the deadline
// passes; checks that the peer process lives. Throws on timeout or a dead peer.
void wait_on(std::atomic<uint32_t>* word, uint32_t seen, Clock::time_point deadline,
             std::chrono::nanoseconds slice, int64_t peer_pid, const std::string& what,
             Milliseconds timeout) {
  const auto now = Clock::now();
  if (now >= deadline) {
    DTRAIN_THROW(TimeoutError, what, " timed out after ", timeout.count(), " ms");
  }
  if (peer_pid > 0 && ::kill(static_cast<pid_t>(peer_pid), 0) != 0 && errno == ESRCH) {
    DTRAIN_THROW(CommError, what, " failed: the peer process (pid ", peer_pid, ") has exited");
  }
  futex_wait(word, seen, std::min<std::chrono::nanoseconds>(slice, deadline - now));
}

}  // namespace

void SharedMemoryChannel::send(int dst, int64_t tag, const at::Tensor& tensor,
                               const std::string& what) {
  DTRAIN_CHECK(tensor.is_contiguous(), "shared-memory send of a non-contiguous tensor");
  Ring* out = ring(group_->rank(), dst);
  Ring* back = connected(dst, group_->rank()) ? ring(dst, group_->rank()) : nullptr;
  const MessageHeader header{tag, static_cast<int64_t>(tensor.nbytes())};
  const Milliseconds timeout = group_->timeout();
  const auto deadline = Clock::now() + timeout;
  const std::string where = describe(what, dst);
  const std::pair<const char*, uint64_t> parts[] = {
      {reinterpret_cast<const char*>(&header), sizeof(header)},
      {static_cast<const char*>(tensor.data_ptr()), tensor.nbytes()}};
  for (auto [from, left] : parts) {
    while (left > 0) {
      const uint32_t seen = out->control->space_seq.load(std::memory_order_acquire);
      const uint64_t k = out->write_some(from, left);
      from += k;
      left -= k;
      if (left == 0 || k > 0) continue;
      // The ring is full: take in what the peer sends meanwhile (it may be blocked sending to
      // us), then wait a short slice for space.
      bool progressed = false;
      if (back) {
        at::Tensor message = back->pump(&progressed);
        if (message.defined()) stash_[{dst, back->header.tag}].push_back(message);
      }
      if (!progressed) {
        wait_on(&out->control->space_seq, seen, deadline,
                back ? std::chrono::nanoseconds(std::chrono::milliseconds(1)) : kAliveCheck,
                pids_[dst], where, timeout);
      }
    }
  }
}

at::Tensor SharedMemoryChannel::take(int src, int64_t tag, const std::string& what) {
  Ring* in = ring(src, group_->rank());
  const Milliseconds timeout = group_->timeout();
  const auto deadline = Clock::now() + timeout;
  const std::string where = describe(what, src);
  for (;;) {
    auto it = stash_.find({src, tag});
    if (it != stash_.end() && !it->second.empty()) {
      at::Tensor message = std::move(it->second.front());
      it->second.erase(it->second.begin());
      if (it->second.empty()) stash_.erase(it);
      return message;
    }
    const uint32_t seen = in->control->data_seq.load(std::memory_order_acquire);
    bool progressed = false;
    at::Tensor message = in->pump(&progressed);
    if (message.defined()) {
      // The header of a completed message stays readable until the next one starts.
      if (in->header.tag == tag) return message;
      stash_[{src, in->header.tag}].push_back(message);
      continue;
    }
    if (!progressed)
      wait_on(&in->control->data_seq, seen, deadline, kAliveCheck, pids_[src], where, timeout);
  }
}

at::Tensor SharedMemoryChannel::recv_bytes(int src, int64_t tag, const std::string& what) {
  return take(src, tag, what);
}

at::Tensor SharedMemoryChannel::recv(int src, int64_t tag, at::IntArrayRef sizes,
                                     at::ScalarType dtype, const std::string& what) {
  at::Tensor bytes = take(src, tag, what);
  const int64_t expected =
      c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  DTRAIN_CHECK_T(CommError, bytes.numel() == expected, describe(what, src), ": received ",
                 bytes.numel(), " bytes, expected ", expected);
  if (expected == 0) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  return bytes.view(dtype).view(sizes);
}

}  // namespace dtrain::comm
