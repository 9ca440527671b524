// Federated learning's update compression is the library's (dtrain/comm/Compression.h), which
// DiLoCo's outer gradients share: one compression library.
#pragma once

#include "dtrain/comm/Compression.h"

namespace dtrain::federated {

using comm::all_finite;
using comm::CompressionSpec;
using comm::decode_update;
using comm::encode_update;
using comm::EncodedUpdate;
using comm::kQuantBlock;
using comm::parse_compression;
using comm::to_string;

}  // namespace dtrain::federated
