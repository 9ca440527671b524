// Small networking helpers shared by the launcher and tests.
#pragma once

#include <string>

namespace dtrain {

/// The local end of the route to `host`: the address this machine would send from, and the
/// interface that carries it ("" when no interface holds that address). InputError when `host`
/// does not resolve; Error when there is no route.
struct LocalRoute {
  std::string address;
  std::string interface;
};
LocalRoute route_to(const std::string& host);

/// Whether `host` resolves to a loopback address (127.0.0.0/8, ::1).
bool is_loopback(const std::string& host);

/// Whether `host` resolves to an address of this machine's own interfaces other than loopback
/// (the route to it starts from it). InputError when `host` does not resolve.
bool is_local_address(const std::string& host);

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it).
int free_port();

}  // namespace dtrain
