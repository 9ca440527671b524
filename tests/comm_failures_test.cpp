// Communicator failures across ranks-as-threads: collectives that do not match (named by the
// check), timeouts naming the op, group and missing ranks, dead peers, and broken pipes that
// must not end the process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <signal.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <string>

#include "RankThreads.h"
#include "dtrain/comm/Communicator.h"

using namespace dtrain;
using namespace std::chrono_literals;
using comm::CommunicatorPtr;
using dtrain::test::run_ranks;

// DTRAIN_CHECK_COLLECTIVES=1: ranks calling a different op, size, dtype or skipping a
// collective get one error naming the group, the collective's index and each rank's call,
// instead of a hang or wrong numbers; one that skipped its last collective leaves the others
// with the check's timeout naming the op and the missing rank. Matching calls are unchanged.
TEST(Comm, MismatchedCollectivesAreNamed) {
  setenv("DTRAIN_CHECK_COLLECTIVES", "1", 1);
  struct Unset {
    ~Unset() { unsetenv("DTRAIN_CHECK_COLLECTIVES"); }
  } unset;
  using Call = std::function<void(const CommunicatorPtr&)>;
  auto sum4 = [](const CommunicatorPtr& c) { c->allreduce(torch::ones({4}))->wait(); };
  auto expect_named = [](const std::string& what, const Call& rank0, const Call& rank1,
                         const std::vector<std::string>& needles) {
    SCOPED_TRACE(what);
    std::array<std::string, 2> errors;
    run_ranks(2, [&](const CommunicatorPtr& comm) {
      try {
        comm->barrier()->wait();  // collective #0 matches
        (comm->rank() == 0 ? rank0 : rank1)(comm);
      } catch (const CommError& e) {
        errors[comm->rank()] = e.what();
      }
    });
    for (const auto& error : errors) {
      EXPECT_NE(error.find("collectives differ on group 'world' at its collective #1"),
                std::string::npos)
          << error;
      for (const auto& needle : needles) EXPECT_NE(error.find(needle), std::string::npos) << error;
    }
  };
  expect_named(
      "op", sum4, [](const CommunicatorPtr& c) { c->broadcast(torch::ones({4}))->wait(); },
      {"rank 0 calls allreduce(sum, 4 x Float)", "rank 1 calls broadcast(4 x Float from rank 0)"});
  expect_named("size", sum4,
               [](const CommunicatorPtr& c) { c->allreduce(torch::ones({8}))->wait(); },
               {"rank 1 calls allreduce(sum, 8 x Float)"});
  expect_named(
      "dtype", sum4,
      [](const CommunicatorPtr& c) { c->allreduce(torch::ones({4}, torch::kDouble))->wait(); },
      {"rank 1 calls allreduce(sum, 4 x Double)"});
  expect_named("skipped", sum4, [](const CommunicatorPtr& c) { c->barrier()->wait(); },
               {"rank 0 calls allreduce(sum, 4 x Float)", "rank 1 calls barrier"});
  // Skipped at the end: rank 0 waits in the check until its timeout, which names the op.
  std::string timed_out;
  run_ranks(
      2,
      [&](const CommunicatorPtr& comm) {
        if (comm->rank() == 1) return;
        try {
          sum4(comm);
        } catch (const CommError& e) {
          timed_out = e.what();
        }
      },
      2s);
  EXPECT_NE(timed_out.find("the collective check before allreduce(sum, 4 x Float)"),
            std::string::npos)
      << timed_out;
  // An all-to-all whose counts disagree: each rank names who sends what against what it expects.
  {
    std::array<std::string, 2> errors;
    run_ranks(2, [&](const CommunicatorPtr& comm) {
      comm::AllToAllOptions options;
      options.send_counts = {1, comm->rank() == 0 ? 3 : 1};
      options.recv_counts = {1, 1};
      if (comm->rank() == 1) options.recv_counts = {2, 1};
      const int64_t in = options.send_counts[0] + options.send_counts[1];
      const int64_t out = options.recv_counts[0] + options.recv_counts[1];
      try {
        comm->all_to_all(torch::empty({out}), torch::ones({in}), options)->wait();
      } catch (const CommError& e) {
        errors[comm->rank()] = e.what();
      }
    });
    for (const auto& error : errors) {
      EXPECT_NE(error.find("all_to_all counts differ on group 'world'"), std::string::npos)
          << error;
      EXPECT_NE(error.find("rank 0 sends 3 elements, rank 1 expects 2"), std::string::npos)
          << error;
    }
  }
  // Matching collectives: the same results.
  run_ranks(3, [](const CommunicatorPtr& comm) {
    auto t = torch::full({5}, static_cast<float>(comm->rank()));
    comm->allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({5}, 3.0f)));
    auto all = torch::empty({3});
    comm->allgather(all, torch::full({1}, static_cast<float>(comm->rank())))->wait();
    EXPECT_TRUE(torch::equal(all, torch::arange(3).to(torch::kFloat)));
  });
}

TEST(Comm, TimeoutNamesOpGroupAndRank) {
  std::atomic<bool> timed_out{false};
  run_ranks(2, [&](const comm::CommunicatorPtr& comm) {
    if (comm->rank() == 0) {
      auto t = torch::ones({4});
      try {
        comm->allreduce(t)->wait(200ms);  // rank 1 never joins this allreduce
        ADD_FAILURE() << "allreduce without a peer did not time out";
      } catch (const TimeoutError& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("allreduce"), std::string::npos) << message;
        EXPECT_NE(message.find("'world'"), std::string::npos) << message;
        EXPECT_NE(message.find("world ranks [0,1]"), std::string::npos) << message;
        EXPECT_NE(message.find("at rank 0"), std::string::npos) << message;
      }
      timed_out = true;
    } else {
      // Stay connected until rank 0 has seen its timeout (bounded), then leave: closing the
      // connections ends rank 0's pending Gloo op.
      for (int i = 0; i < 1000 && !timed_out; ++i) std::this_thread::sleep_for(10ms);
      EXPECT_TRUE(timed_out);
    }
  });
}

// A rank that never arrives at a collective is named by the ranks that time out in it, with
// how far it got (each rank's count of collectives, published to the store once a second).
TEST(Comm, ATimedOutCollectiveNamesTheRanksThatDidNotArrive) {
  std::atomic<int> timed_out{0};
  run_ranks(3, [&](const comm::CommunicatorPtr& comm) {
    auto t = torch::ones({4});
    comm->allreduce(t)->wait();
    if (comm->rank() == 2) {  // stops here; stays connected until the others have timed out
      for (int i = 0; i < 2000 && timed_out < 2; ++i) std::this_thread::sleep_for(10ms);
      EXPECT_EQ(timed_out, 2);
      return;
    }
    try {
      comm->allreduce(t)->wait(1500ms);
      ADD_FAILURE() << "allreduce without rank 2 did not time out";
    } catch (const TimeoutError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("did not arrive: rank 2 (world rank 2) has issued 1 collectives on "
                             "this group, this one is #2 (its last: allreduce(sum, 4 x Float))"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("arrived: ranks " + std::to_string(1 - comm->rank())),
                std::string::npos)
          << message;
    }
    ++timed_out;
  });
}

TEST(Comm, DeadPeerNamesThePeer) {
  run_ranks(2, [](CommunicatorPtr comm) {
    if (comm->rank() == 1) {
      comm.reset();  // closes rank 1's connections, as a crashed process would
      return;
    }
    std::this_thread::sleep_for(200ms);
    auto out = torch::empty({8});
    try {
      comm->allgather(out, torch::ones({4}))->wait();
      ADD_FAILURE() << "allgather with a dead peer succeeded";
    } catch (const CommError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("allgather"), std::string::npos) << message;
      EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    }
  });
}

// Gloo writes to a peer that closed its end (a dead replica, a group its members abandoned) with
// writev, which raises SIGPIPE; its default action ends the process before Gloo can report the
// broken pair as an error the survivors catch (seen in FaultTolerance.ASilentReplica... once
// in ten runs). Forming a group ignores SIGPIPE.
TEST(Comm, ABrokenPipeAfterAGroupFormedIsNotTheEndOfTheProcess) {
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &before), 0);
  ASSERT_EQ(before.sa_handler, SIG_DFL);
  run_ranks(2, [](const CommunicatorPtr& comm) { comm->barrier()->wait(); });
  ASSERT_EQ(raise(SIGPIPE), 0);  // with the default action the test process ends here
}

// ctest runs each test in a process of its own: here no group formed before the handler is set.
TEST(Comm, AProgramsOwnSigpipeHandlerIsLeftInPlace) {
  static volatile sig_atomic_t handled = 0;
  struct sigaction own {};
  own.sa_handler = [](int) { handled = 1; };
  sigemptyset(&own.sa_mask);
  ASSERT_EQ(sigaction(SIGPIPE, &own, nullptr), 0);
  run_ranks(2, [](const CommunicatorPtr& comm) { comm->barrier()->wait(); });
  ASSERT_EQ(raise(SIGPIPE), 0);
  EXPECT_EQ(handled, 1);
  signal(SIGPIPE, SIG_DFL);
}
