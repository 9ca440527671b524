// Block-quantized collectives (ZeRO++'s qwZ and qgZ, Wang et al. 2023): values travel as int8
// codes with one float32 scale (absolute maximum / 127) per block of elements, about 4x fewer
// bytes than float32. The allgather quantizes each rank's share once and every rank
// dequantizes all of them (the gathered copies agree across ranks); the reduce-scatter sends
// each destination its quantized segment directly (an all-to-all over point-to-point ops), so
// every value is quantized once, not once per hop as a ring would, and sums in float.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::comm {

struct BlockQuantization {
  /// Elements per scale; 0 = off (the plain collectives).
  int64_t block = 0;
  /// Tests: the same exchanges with the values sent as they are (equal to the plain
  /// collectives up to the order of the sums).
  bool identity = false;
  bool enabled() const { return block > 0; }
};

/// Allgather of equal shares: `output` (input.numel() x size elements) gets every rank's
/// `input`, each through int8 codes (this rank's own share too, so that every rank holds the
/// same values). Dequantizes when waited for.
WorkPtr quantized_allgather(Communicator& comm, at::Tensor output, at::Tensor input,
                            const BlockQuantization& quantization);

/// Sum reduce-scatter of the flat `input` (`counts[i]` elements for rank i; empty: equal
/// shares): `output` gets this rank's exact segment plus every other rank's, dequantized.
/// Sums when waited for.
WorkPtr quantized_reduce_scatter(Communicator& comm, at::Tensor output, at::Tensor input,
                                 std::vector<int64_t> counts,
                                 const BlockQuantization& quantization);

/// Bytes one quantized message of `numel` elements takes (codes and scales).
int64_t quantized_bytes(int64_t numel, const BlockQuantization& quantization, int64_t element_size);

}  // namespace dtrain::comm
