// The c10d ProcessGroupNCCL backend (CUDA builds only; see NcclCommunicator.cpp).
#pragma once

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm::nccl {

CommunicatorPtr create_world(const InitOptions& options);

}  // namespace dtrain::comm::nccl
