// The network lab's delay line (scripts/netlab): the router namespace routes every packet
// between lab hosts through the TUN device this program holds; it keeps each packet for the
// delay of its path (the sender's uplink plus the receiver's downlink) and writes it back, and
// the kernel routes it on. For kernels without netem (this project's machine has none).
//
// Usage: delay_line TUN UP_US,DOWN_US [UP_US,DOWN_US ...]
//   one pair per host i (IPv4 10.X.i.2: the third byte of the address names the host).
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <time.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <queue>
#include <string>
#include <vector>

namespace {

struct Packet {
  int64_t release_us;
  uint64_t sequence;  // FIFO among packets released at the same microsecond
  std::vector<char> bytes;
  bool operator>(const Packet& other) const {
    return release_us != other.release_us ? release_us > other.release_us
                                          : sequence > other.sequence;
  }
};

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: delay_line TUN UP_US,DOWN_US [UP_US,DOWN_US ...]\n");
    return 2;
  }
  std::vector<int64_t> up, down;
  for (int i = 2; i < argc; ++i) {
    long long u = 0, d = 0;
    if (std::sscanf(argv[i], "%lld,%lld", &u, &d) != 2 || u < 0 || d < 0) {
      std::fprintf(stderr, "delay_line: '%s' is not UP_US,DOWN_US\n", argv[i]);
      return 2;
    }
    up.push_back(u);
    down.push_back(d);
  }
  const int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
  if (fd < 0) {
    std::perror("delay_line: /dev/net/tun");
    return 1;
  }
  ifreq request{};
  request.ifr_flags = IFF_TUN | IFF_NO_PI;
  std::strncpy(request.ifr_name, argv[1], IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &request) < 0) {
    std::perror("delay_line: TUNSETIFF");
    return 1;
  }
  // A router's buffer: beyond it packets are dropped (TCP then backs off, as on a real link).
  const size_t capacity = 64u << 20;
  size_t held = 0;
  uint64_t sequence = 0;
  std::priority_queue<Packet, std::vector<Packet>, std::greater<Packet>> line;
  std::vector<char> buffer(65536);
  for (;;) {
    int64_t now = now_us();
    while (!line.empty() && line.top().release_us <= now) {
      const Packet& p = line.top();
      if (write(fd, p.bytes.data(), p.bytes.size()) < 0 && errno != EAGAIN) {
        std::perror("delay_line: write");
      }
      held -= p.bytes.size();
      line.pop();
    }
    const int64_t wait_us =
        line.empty() ? 1000000 : std::max<int64_t>(0, line.top().release_us - now);
    const timespec timeout{static_cast<time_t>(wait_us / 1000000),
                           static_cast<long>(wait_us % 1000000) * 1000};
    pollfd poll_fd{fd, POLLIN, 0};
    if (ppoll(&poll_fd, 1, &timeout, nullptr) < 0 && errno != EINTR) {
      std::perror("delay_line: poll");
      return 1;
    }
    for (;;) {
      const ssize_t n = read(fd, buffer.data(), buffer.size());
      if (n <= 0) break;
      int64_t delay = 0;
      if (n >= 20 && (buffer[0] >> 4) == 4) {
        const auto src = static_cast<unsigned char>(buffer[14]);
        const auto dst = static_cast<unsigned char>(buffer[18]);
        if (src < up.size()) delay += up[src];
        if (dst < down.size()) delay += down[dst];
      }
      if (held + n > capacity) continue;  // dropped
      held += n;
      line.push({now_us() + delay, sequence++, std::vector<char>(buffer.begin(), buffer.begin() + n)});
    }
  }
}
