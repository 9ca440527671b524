// Chooses the communication backend named in InitOptions (configure-time availability).
#include "dtrain/common/Error.h"
#include "dtrain/comm/Communicator.h"
#include "comm/gloo/GlooCommunicator.h"

namespace dtrain::comm {

CommunicatorPtr init(const InitOptions& options) {
  if (options.backend == "gloo") return gloo_backend::create_world(options);
  if (options.backend == "nccl") {
    DTRAIN_THROW(InputError,
                 "backend nccl is not available: this dtrain was built against a LibTorch "
                 "without CUDA (see src/comm/nccl/README.md); use --backend gloo");
  }
  DTRAIN_THROW(InputError, "unknown communication backend '", options.backend,
               "' (expected gloo or nccl)");
}

}  // namespace dtrain::comm
