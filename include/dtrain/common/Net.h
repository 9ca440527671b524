// Small networking helpers shared by the launcher and tests.
#pragma once

namespace dtrain {

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it).
int free_port();

}  // namespace dtrain
