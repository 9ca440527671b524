// Chooses the communication backend named in InitOptions (configure-time availability).
#include "comm/gloo/GlooCommunicator.h"
#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#ifdef DTRAIN_CUDA
#include "comm/nccl/NcclCommunicator.h"
#endif

namespace dtrain::comm {

CommunicatorPtr init(const InitOptions& options) {
  if (options.backend == "gloo") return gloo::create_world(options);
  if (options.backend == "nccl") {
#ifdef DTRAIN_CUDA
    return nccl::create_world(options);
#else
    DTRAIN_THROW(InputError,
                 "backend nccl is not available: this dtrain was built without "
                 "-DDTRAIN_CUDA=ON (it needs a CUDA build of LibTorch); use --backend gloo");
#endif
  }
  DTRAIN_THROW(InputError, "unknown communication backend '", options.backend,
               "' (expected gloo or nccl)");
}

}  // namespace dtrain::comm
