// Asks the kernel for a free TCP port by binding port 0.
#include "dtrain/common/Net.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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

}  // namespace dtrain
