// Per-call options for communication ops, each with defaults (gloo's AllreduceOptions style).
// A timeout of zero means "the communicator's default timeout".
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace dtrain::comm {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* to_string(ReduceOp op);

struct AllreduceOptions {
  ReduceOp op = ReduceOp::Sum;
  std::chrono::milliseconds timeout{0};
};

struct BroadcastOptions {
  int root = 0;
  std::chrono::milliseconds timeout{0};
};

/// Allgather into one flat output. `counts[i]` = elements contributed by rank i; empty means
/// every rank contributes input.numel().
struct AllgatherOptions {
  std::vector<int64_t> counts;
  std::chrono::milliseconds timeout{0};
};

/// Reduce-scatter of one flat input. `counts[i]` = elements of the result kept by rank i;
/// empty means equal shares of input.numel() / size.
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::Sum;
  std::vector<int64_t> counts;
  std::chrono::milliseconds timeout{0};
  /// The input is scratch: the reduction may accumulate in it (no copy of the input), leaving
  /// it undefined afterwards. Ignored for 16-bit inputs, which accumulate in fp32.
  bool input_is_scratch = false;
};

/// All-to-all of one flat input into one flat output with variable splits (MPI_Alltoallv, torch's
/// all_to_all_single): the input holds send_counts[j] elements for rank j, in rank order; the
/// output receives recv_counts[i] elements from rank i, in rank order. Empty counts: equal shares
/// of the input (output) over the ranks. Rank i's send_counts[j] must equal rank j's
/// recv_counts[i] (checked by name under DTRAIN_CHECK_COLLECTIVES).
struct AllToAllOptions {
  std::vector<int64_t> send_counts;
  std::vector<int64_t> recv_counts;
  std::chrono::milliseconds timeout{0};
};

/// Point-to-point. User tags must be in [0, kMaxUserTag).
struct P2POptions {
  int tag = 0;
  std::chrono::milliseconds timeout{0};
};
constexpr int kMaxUserTag = 1 << 20;

struct BarrierOptions {
  std::chrono::milliseconds timeout{0};
};

}  // namespace dtrain::comm
