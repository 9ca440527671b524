// Asks the kernel for a free TCP port by binding port 0, and for the route to a host.
#include "dtrain/common/Net.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>

#include <cerrno>
#include <cstring>

#include "dtrain/common/Error.h"

namespace dtrain {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  DTRAIN_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  DTRAIN_CHECK(ok, "could not find a free port: ", std::strerror(error));
  return ntohs(address.sin_port);
}

namespace {

// The first IPv4 address of `host`.
sockaddr_in resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int code = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  DTRAIN_CHECK_INPUT(code == 0 && found != nullptr, "address '", host,
                     "' does not resolve: ", ::gai_strerror(code));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  return *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
}

}  // namespace

bool is_loopback(const std::string& host) {
  if (host == "::1" || host == "localhost") return true;
  const sockaddr_in address = resolve(host);
  return (ntohl(address.sin_addr.s_addr) >> 24) == 127;
}

bool is_local_address(const std::string& host) {
  if (is_loopback(host)) return false;
  const sockaddr_in address = resolve(host);
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return route_to(host).address == text;
}

LocalRoute route_to(const std::string& host) {
  sockaddr_in remote = resolve(host);
  remote.sin_port = htons(9);  // connect() on UDP sends nothing: it only picks the route
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  DTRAIN_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&remote), sizeof(remote)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  const int error = errno;
  ::close(fd);
  DTRAIN_CHECK(ok, "no route to ", host, ": ", std::strerror(error));
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
  LocalRoute route{text, ""};
  ifaddrs* interfaces = nullptr;
  if (::getifaddrs(&interfaces) == 0) {
    for (ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      const auto* address = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if (address->sin_addr.s_addr == local.sin_addr.s_addr) {
        route.interface = i->ifa_name;
        break;
      }
    }
    ::freeifaddrs(interfaces);
  }
  return route;
}

}  // namespace dtrain
