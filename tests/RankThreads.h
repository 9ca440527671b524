// Runs N ranks as threads of one process over 127.0.0.1 (gloo's base_test style): each thread
// joins a fresh world and runs the body; the first failure is rethrown with its rank.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"

namespace dtrain::test {

inline void run_ranks(int world_size, const std::function<void(const comm::CommunicatorPtr&)>& body,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  const int port = free_port();
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        comm::InitOptions options;
        options.rank = rank;
        options.world_size = world_size;
        options.master_port = port;
        options.timeout = timeout;
        options.backend_threads = 1;
        auto world = comm::init(options);
        body(world);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  // Every failing rank's error: the first one is often only a peer's disconnection.
  std::string report;
  for (int rank = 0; rank < world_size; ++rank) {
    if (!errors[rank]) continue;
    try {
      std::rethrow_exception(errors[rank]);
    } catch (const std::exception& e) {
      report += (report.empty() ? "" : "\n") + std::string("rank ") + std::to_string(rank) + ": " +
                e.what();
    }
  }
  if (!report.empty()) throw std::runtime_error(report);
}

}  // namespace dtrain::test
