// Token files of dtrain's gRPC services (parameter server, federated learning): one shared
// secret per file (--auth-token-file).
#pragma once

#include <string>

namespace dtrain::comm::rpc {

/// The token in `path`, surrounding whitespace removed (InputError naming the file when it
/// cannot be read or holds no token).
std::string read_token_file(const std::string& path);

}  // namespace dtrain::comm::rpc
