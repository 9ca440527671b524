// DualPipe-V (DeepSeek-V3's DualPipe cut to one direction, the "V" of Sea AI Lab's note; PyTorch's
// ScheduleDualPipeV): ZB-V's placement (rank r holds virtual stages r and 2P - 1 - r) with its
// steady state made of pairs, one chunk's forward of a micro-batch run together with the other
// chunk's backward of another, so that a mixture of experts' all-to-alls in one hide behind the
// other's compute. The phases follow DeepSeek's reference (dualpipev.py), counted per rank.
#include <deque>
#include <utility>

#include "dtrain/common/Error.h"
#include "parallel/pipeline/ScheduleBuilders.h"

namespace dtrain::parallel::pipeline {

std::vector<Action> dual_pipe_v_schedule(const ScheduleSpec& spec, int rank) {
  const int p = spec.stages, m = spec.micro_batches, r = rank;
  int forwards[2] = {0, 0}, backwards[2] = {0, 0};
  std::deque<std::pair<int, int>> waiting;  // (chunk, micro-batch) whose W has not run
  std::vector<Action> actions;
  auto forward = [&](int chunk, bool overlapped) {
    actions.push_back({Action::Forward, forwards[chunk]++, chunk, overlapped});
  };
  // A whole backward is its B followed by its W; a split one leaves its W for later.
  auto backward = [&](int chunk, bool whole) {
    const int micro_batch = backwards[chunk]++;
    actions.push_back({Action::Backward, micro_batch, chunk});
    if (whole) {
      actions.push_back({Action::Weight, micro_batch, chunk});
    } else {
      waiting.emplace_back(chunk, micro_batch);
    }
  };
  auto weight = [&] {
    if (waiting.empty()) return;
    actions.push_back({Action::Weight, waiting.front().second, waiting.front().first});
    waiting.pop_front();
  };
  auto pair = [&](int forward_chunk, int backward_chunk) {
    forward(forward_chunk, true);
    backward(backward_chunk, true);
  };
  // 1. Chunk 0's forwards that fill the V down to this rank's turn; 2. both chunks' forwards.
  for (int k = 0; k < 2 * (p - r - 1); ++k) forward(0, false);
  for (int k = 0; k <= r; ++k) {
    forward(0, false);
    forward(1, false);
  }
  // 3. Chunk 1's first backwards (zero bubble: B, then the oldest W), each with a forward.
  for (int k = 0; k < p - r - 1; ++k) {
    backward(1, false);
    weight();
    forward(1, false);
  }
  // 4. The steady state: F0 with B1, then F1 with B0 (the last rank runs its first F0 and B1
  // apart, which the reference found shortens the bubble).
  for (int i = 0; i < m - 2 * p + r + 1; ++i) {
    if (i == 0 && r == p - 1) {
      forward(0, false);
      backward(1, true);
    } else {
      pair(0, 1);
    }
    pair(1, 0);
  }
  // 5. Chunk 1's last forwards, each paired with a backward of chunk 0.
  for (int k = 0; k < p - r - 1; ++k) {
    backward(1, true);
    pair(1, 0);
  }
  // 6. The cool-down's backwards of both chunks, the second half split (zero bubble), from the
  // middle on, odd ranks from their B1, even ones from their B0.
  bool split = false;
  for (int i = 0; i <= r; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) split = true;
    backward(1, !split);
    if (i == (r + 1) / 2 && r % 2 == 0) split = true;
    backward(0, !split);
  }
  // 7. Chunk 0's last backwards, each after a waiting W; 8. the W's left.
  for (int k = 0; k < p - r - 1; ++k) {
    weight();
    backward(0, !split);
  }
  while (!waiting.empty()) weight();
  DTRAIN_CHECK(forwards[0] == m && forwards[1] == m && backwards[0] == m && backwards[1] == m,
               "the dualpipev construction is incomplete on rank ", rank);
  return actions;
}

}  // namespace dtrain::parallel::pipeline
