#include "common/Straggler.h"

#include <chrono>
#include <thread>

namespace dtrain {

void straggle(double seconds, bool spin) {
  if (seconds <= 0) return;
  const auto duration = std::chrono::duration<double>(seconds);
  if (!spin) {
    std::this_thread::sleep_for(duration);
    return;
  }
  const auto until = std::chrono::steady_clock::now() + duration;
  volatile double sink = 1.0;
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 1000; ++i) sink = sink * 1.0000001 + 1e-9;
  }
}

}  // namespace dtrain
