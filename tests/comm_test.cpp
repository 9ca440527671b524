// Communicator ops across ranks-as-threads: every op, dtypes incl. bfloat16, uneven sizes,
// subgroups, the process grid, ring traffic volume (failures: comm_failures_test.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <numeric>
#include <optional>

#include "RankThreads.h"
#include "comm/PaddedShares.h"
#include "comm/SharedMemoryChannel.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/comm/Quantized.h"

using namespace dtrain;
using namespace std::chrono_literals;
using comm::CommunicatorPtr;
using dtrain::test::run_ranks;

namespace {

// Rank-dependent data every rank can also compute for the others.
torch::Tensor data_of(int rank, int64_t numel, torch::Dtype dtype) {
  return (torch::arange(numel, torch::kDouble) * 0.5 + rank * 3 + 1).to(dtype);
}

double tolerance(torch::Dtype dtype) {
  return dtype == torch::kBFloat16 ? 0.1 : dtype == torch::kHalf ? 0.05 : 1e-6;
}

}  // namespace

class AllreduceTest : public ::testing::TestWithParam<std::tuple<int, torch::Dtype>> {};

TEST_P(AllreduceTest, SumAvgMaxMatchLocalReduction) {
  const auto [world, dtype] = GetParam();
  for (int64_t numel : {1, 7, 1000}) {  // 7 and 1000 do not split evenly over 3 or 4 ranks
    run_ranks(world, [&, world = world, dtype = dtype](const CommunicatorPtr& comm) {
      torch::Tensor expected_sum = torch::zeros({numel}, torch::kDouble);
      torch::Tensor expected_max = torch::full({numel}, -1e9, torch::kDouble);
      for (int r = 0; r < world; ++r) {
        expected_sum += data_of(r, numel, dtype).to(torch::kDouble);
        expected_max = torch::maximum(expected_max, data_of(r, numel, dtype).to(torch::kDouble));
      }
      auto sum = data_of(comm->rank(), numel, dtype);
      comm->allreduce(sum)->wait();
      EXPECT_TRUE(torch::allclose(sum.to(torch::kDouble), expected_sum, 0.01, tolerance(dtype)))
          << dtype << " sum numel " << numel;
      if (torch::isFloatingType(dtype)) {
        auto avg = data_of(comm->rank(), numel, dtype);
        comm->allreduce(avg, {comm::ReduceOp::Avg})->wait();
        EXPECT_TRUE(
            torch::allclose(avg.to(torch::kDouble), expected_sum / world, 0.01, tolerance(dtype)));
      }
      auto max = data_of(comm->rank(), numel, dtype);
      comm->allreduce(max, {comm::ReduceOp::Max})->wait();
      EXPECT_TRUE(torch::allclose(max.to(torch::kDouble), expected_max));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AllreduceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(torch::kFloat, torch::kDouble,
                                                              torch::kLong, torch::kHalf,
                                                              torch::kBFloat16)));

// NCCL's uneven reduce-scatter and allgather are its even ones over padded shares
// (comm/PaddedShares.h): done here by hand over 3 ranks' tensors, they give what the uneven
// collectives would.
TEST(Comm, PaddedSharesGiveTheUnevenCollectives) {
  const std::vector<int64_t> counts = {2, 5, 3};
  const int64_t total = 10, most = 5;
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < 3; ++r) inputs.push_back(at::randn({total}, at::kDouble));
  // reduce-scatter: the sum of the padded inputs, rank r's padded slot, its first counts[r]
  at::Tensor padded_sum = at::zeros({3 * most}, at::kDouble);
  for (const auto& input : inputs) {
    const at::Tensor padded = comm::pad_shares(input, counts);
    ASSERT_EQ(padded.numel(), 3 * most);
    padded_sum += padded;
  }
  const at::Tensor sum = inputs[0] + inputs[1] + inputs[2];
  int64_t offset = 0;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(padded_sum.narrow(0, r * most, counts[r]).equal(sum.narrow(0, offset, counts[r])));
    EXPECT_TRUE(
        padded_sum.narrow(0, r * most + counts[r], most - counts[r]).eq(0).all().item<bool>());
    offset += counts[r];
  }
  // allgather: every rank's share padded to the largest, gathered, unpadded in rank order
  at::Tensor gathered = at::zeros({3 * most}, at::kDouble);
  std::vector<at::Tensor> shares;
  for (int r = 0; r < 3; ++r) {
    shares.push_back(at::randn({counts[r]}, at::kDouble));
    gathered.narrow(0, r * most, counts[r]).copy_(shares[r]);
  }
  at::Tensor output = at::zeros({total}, at::kDouble);
  comm::unpad_shares(gathered, counts, output);
  EXPECT_TRUE(output.equal(at::cat(shares)));
  // even shares pass through without a copy
  const at::Tensor even = at::randn({9});
  EXPECT_EQ(comm::pad_shares(even, comm::share_counts({}, 9, 3)).data_ptr(), even.data_ptr());
}

TEST(Comm, AllreduceNonContiguousWritesBack) {
  run_ranks(2, [](const CommunicatorPtr& comm) {
    auto base = torch::ones({4, 6}) * (comm->rank() + 1);
    auto view = base.t();  // non-contiguous
    comm->allreduce(view)->wait();
    EXPECT_TRUE(torch::allclose(base, torch::full({4, 6}, 3.0)));
  });
}

TEST(Comm, BroadcastFromEveryRootIncludingBFloat16) {
  run_ranks(3, [](const CommunicatorPtr& comm) {
    for (int root = 0; root < 3; ++root) {
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kLong}) {
        auto t = data_of(comm->rank(), 33, dtype);
        comm->broadcast(t, {root})->wait();
        EXPECT_TRUE(torch::equal(t, data_of(root, 33, dtype))) << root << " " << dtype;
      }
    }
  });
}

TEST(Comm, AllgatherEqualAndUnevenCounts) {
  run_ranks(3, [](const CommunicatorPtr& comm) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      auto out = torch::empty({3 * 5}, dtype);
      comm->allgather(out, data_of(comm->rank(), 5, dtype))->wait();
      for (int r = 0; r < 3; ++r) {
        EXPECT_TRUE(torch::equal(out.narrow(0, 5 * r, 5), data_of(r, 5, dtype)));
      }
    }
    const std::vector<int64_t> counts{2, 0, 5};
    auto out = torch::empty({7});
    comm->allgather(out, data_of(comm->rank(), counts[comm->rank()], torch::kFloat), {counts})
        ->wait();
    EXPECT_TRUE(torch::equal(out.narrow(0, 0, 2), data_of(0, 2, torch::kFloat)));
    EXPECT_TRUE(torch::equal(out.narrow(0, 2, 5), data_of(2, 5, torch::kFloat)));
  });
}

TEST(Comm, ReduceScatterMatchesAllreduceShareAndMovesRingBytes) {
  for (int world : {2, 4}) {
    run_ranks(world, [world](const CommunicatorPtr& comm) {
      const int64_t share = 1000;
      torch::Tensor full_sum = torch::zeros({share * world});
      for (int r = 0; r < world; ++r) full_sum += data_of(r, share * world, torch::kFloat);
      auto input = data_of(comm->rank(), share * world, torch::kFloat);
      auto output = torch::empty({share});
      const int64_t before = comm->bytes_sent();
      comm->reduce_scatter(output, input)->wait();
      const int64_t sent = comm->bytes_sent() - before;
      EXPECT_TRUE(torch::allclose(output, full_sum.narrow(0, share * comm->rank(), share)));
      // A ring reduce-scatter sends (N-1)/N of the input; an allreduce would send twice that.
      EXPECT_EQ(sent, (world - 1) * share * 4);

      auto avg = torch::empty({share});
      comm::ReduceScatterOptions average;
      average.op = comm::ReduceOp::Avg;
      comm->reduce_scatter(avg, input, average)->wait();
      EXPECT_TRUE(torch::allclose(avg, output / world));

      comm::ReduceScatterOptions scratch;  // may accumulate in the input: same result, no copy
      scratch.input_is_scratch = true;
      auto in_place = torch::empty({share});
      comm->reduce_scatter(in_place, input.clone(), scratch)->wait();
      EXPECT_TRUE(torch::equal(in_place, output));
    });
  }
}

TEST(Comm, ReduceScatterUnevenCountsAndBFloat16) {
  run_ranks(3, [](const CommunicatorPtr& comm) {
    const std::vector<int64_t> counts{4, 1, 6};
    torch::Tensor full_sum = torch::zeros({11}, torch::kDouble);
    for (int r = 0; r < 3; ++r) full_sum += data_of(r, 11, torch::kBFloat16).to(torch::kDouble);
    int64_t offset = 0;
    for (int r = 0; r < comm->rank(); ++r) offset += counts[r];
    auto output = torch::empty({counts[comm->rank()]}, torch::kBFloat16);
    comm->reduce_scatter(output, data_of(comm->rank(), 11, torch::kBFloat16),
                         {comm::ReduceOp::Sum, counts})
        ->wait();
    EXPECT_TRUE(torch::allclose(output.to(torch::kDouble),
                                full_sum.narrow(0, offset, counts[comm->rank()]), 0.01, 0.1));
  });
}

TEST(Comm, ReduceScatterRejectsBadShapes) {
  run_ranks(2, [](const CommunicatorPtr& comm) {
    auto output = torch::empty({3});
    EXPECT_THROW(comm->reduce_scatter(output, torch::ones({7})), Error);
    EXPECT_THROW(comm->reduce_scatter(output, torch::ones({8})), Error);
  });
}

TEST(Comm, SendRecvWithTagsAndBFloat16) {
  run_ranks(2, [](const CommunicatorPtr& comm) {
    if (comm->rank() == 0) {
      comm->send(torch::arange(5, torch::kFloat), 1, {7})->wait();
      comm->send(torch::full({3}, 2.5, torch::kBFloat16), 1, {8})->wait();
    } else {
      auto a = torch::empty({5});
      auto b = torch::empty({3}, torch::kBFloat16);
      auto wb = comm->recv(b, 0, {8});  // posted out of order: tags keep them apart
      auto wa = comm->recv(a, 0, {7});
      wa->wait();
      wb->wait();
      EXPECT_TRUE(torch::equal(a, torch::arange(5, torch::kFloat)));
      EXPECT_TRUE(torch::equal(b, torch::full({3}, 2.5, torch::kBFloat16)));
    }
    EXPECT_THROW(comm->send(torch::ones({1}), 1 - comm->rank(), {comm::kMaxUserTag}), Error);
  });
}

TEST(Comm, NewGroupAndSplit) {
  run_ranks(4, [](const CommunicatorPtr& comm) {
    auto evens = comm->new_group({0, 2}, "evens");
    EXPECT_EQ(evens != nullptr, comm->rank() % 2 == 0);
    if (evens) {
      EXPECT_EQ(evens->size(), 2);
      EXPECT_EQ(evens->rank(), comm->rank() / 2);
      auto t = torch::full({3}, static_cast<float>(comm->rank()));
      evens->allreduce(t)->wait();
      EXPECT_TRUE(torch::allclose(t, torch::full({3}, 2.0f)));
    }
    // Split by parity, ordered by descending rank.
    auto half = comm->split(comm->rank() % 2, -comm->rank(), "parity");
    ASSERT_TRUE(half);
    EXPECT_EQ(half->size(), 2);
    EXPECT_EQ(half->rank(), comm->rank() < 2 ? 1 : 0);
    auto t = torch::full({1}, static_cast<float>(comm->rank()));
    half->allreduce(t)->wait();
    EXPECT_FLOAT_EQ(t.item<float>(), comm->rank() % 2 == 0 ? 2.0f : 4.0f);
    auto none = comm->split(comm->rank() == 3 ? -1 : 0, 0, "most");
    EXPECT_EQ(none == nullptr, comm->rank() == 3);
  });
}

// What each rank sends, counted as a ring algorithm sends it (2 (n-1)/n of an allreduce's bytes,
// (n-1)/n of the others'), in one count for the world and every group made from it.
// All-to-all with variable splits (a mixture of experts' dispatch): rank r sends (r + j) % 3
// elements to rank j, some of them none; every rank receives each sender's part in rank order,
// in float32, bfloat16 and float64, and counts on the wire only what left it. Even shares by
// default; counts that do not fit the tensors are refused naming the group.
TEST(Comm, AllToAllWithVariableAndEmptySplits) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](const CommunicatorPtr& comm) {
      const int me = comm->rank();
      auto part = [](int from, int to, int64_t n, torch::Dtype dtype) {
        return (torch::arange(n, torch::kDouble) + 100 * from + 10 * to).to(dtype);
      };
      auto sent = [world](int from, int to) { return static_cast<int64_t>((from + to) % world); };
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
        comm::AllToAllOptions options;
        std::vector<torch::Tensor> parts;
        for (int j = 0; j < world; ++j) {
          options.send_counts.push_back(sent(me, j));
          options.recv_counts.push_back(sent(j, me));
          parts.push_back(part(me, j, sent(me, j), dtype));
        }
        const torch::Tensor input = torch::cat(parts);
        torch::Tensor output = torch::full(
            {std::accumulate(options.recv_counts.begin(), options.recv_counts.end(), int64_t{0})},
            -1, dtype);
        const int64_t before = comm->wire_bytes();
        comm->all_to_all(output, input, options)->wait();
        std::vector<torch::Tensor> expected;
        for (int i = 0; i < world; ++i) expected.push_back(part(i, me, sent(i, me), dtype));
        EXPECT_TRUE(torch::equal(output, torch::cat(expected))) << world << " " << dtype;
        EXPECT_EQ(comm->wire_bytes() - before,
                  (input.numel() - sent(me, me)) * input.element_size());
      }
      // Even shares, into a non-contiguous output.
      const torch::Tensor input = torch::arange(2 * world, torch::kFloat) + 100 * me;
      torch::Tensor output = torch::empty({2, world}).t();  // [world, 2], transposed
      comm->all_to_all(output, input)->wait();
      for (int i = 0; i < world; ++i) {
        EXPECT_TRUE(
            torch::equal(output[i], torch::arange(2 * me, 2 * me + 2, torch::kFloat) + 100 * i));
      }
      EXPECT_EQ(comm->tally().at("all_to_all").count, 4);
      comm::AllToAllOptions bad;
      bad.send_counts.assign(world, 1);
      bad.recv_counts.assign(world, 2);
      try {
        comm->all_to_all(torch::empty({world}), torch::empty({world}), bad);
        ADD_FAILURE() << "counts that do not fit the output were accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("recv_counts add up to"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("'world'"), std::string::npos) << e.what();
      }
    });
  }
}

// Lanes (DualPipe-V's two threads): the expert group's second lane is a group of the same ranks
// whose ops are ordered apart from the first's. Rank 0 issues A on the expert group, then B on
// its lane; rank 1 issues B first: each exchange meets its own (on one group they would meet the
// other's, of another size). Outside a LaneScope on_lane gives the group itself.
TEST(Comm, TheExpertGroupsSecondLaneOrdersItsOpsApart) {
  run_ranks(2, [](const CommunicatorPtr& world) {
    comm::ProcessGrid grid(world);
    grid.split_experts(2);
    ASSERT_FALSE(grid.ep_lane());
    grid.add_lanes();
    ASSERT_TRUE(grid.ep_lane());
    EXPECT_NE(grid.ep_lane().get(), grid.ep().get());
    EXPECT_EQ(grid.ep_lane()->size(), 2);
    EXPECT_EQ(comm::on_lane(grid.ep()).get(), grid.ep().get());
    const int me = world->rank();
    auto exchange = [&](int64_t per_peer, bool on_lane) {
      std::optional<comm::LaneScope> scope;
      if (on_lane)
        scope.emplace(std::vector<std::pair<const comm::Communicator*, CommunicatorPtr>>{
            {grid.ep().get(), grid.ep_lane()}});
      const torch::Tensor input = torch::full({2 * per_peer}, 10.0 * me + per_peer);
      torch::Tensor output = torch::empty({2 * per_peer});
      return std::make_pair(output, comm::on_lane(grid.ep())->all_to_all(output, input));
    };
    std::pair<torch::Tensor, comm::WorkPtr> a, b;
    if (me == 0) {
      a = exchange(3, false);
      b = exchange(5, true);
    } else {
      b = exchange(5, true);
      a = exchange(3, false);
    }
    a.second->wait();
    b.second->wait();
    for (int from = 0; from < 2; ++from) {
      EXPECT_TRUE(torch::equal(a.first.narrow(0, 3 * from, 3), torch::full({3}, 10.0 * from + 3)));
      EXPECT_TRUE(torch::equal(b.first.narrow(0, 5 * from, 5), torch::full({5}, 10.0 * from + 5)));
    }
  });
}

TEST(Comm, WireBytesCountEveryCollectiveOfTheWorldAndItsGroups) {
  run_ranks(4, [](const CommunicatorPtr& comm) {
    auto pair = comm->split(comm->rank() / 2, comm->rank(), "pairs");
    const int64_t before = comm->wire_bytes();
    comm->allreduce(torch::ones({1000}))->wait();                             // 2 x 3/4 x 4000
    comm->allgather(torch::empty({4000}), torch::ones({1000}))->wait();       // 3/4 x 16000
    comm->reduce_scatter(torch::empty({1000}), torch::ones({4000}))->wait();  // 3/4 x 16000
    pair->allreduce(torch::ones({100}, torch::kDouble))->wait();              // 2 x 1/2 x 800
    if (comm->rank() == 0) comm->send(torch::ones({10}), 1)->wait();          // 40
    if (comm->rank() == 1) comm->recv(torch::empty({10}), 0)->wait();
    const int64_t expected = 6000 + 12000 + 12000 + 800 + (comm->rank() == 0 ? 40 : 0);
    EXPECT_EQ(comm->wire_bytes() - before, expected);
    EXPECT_EQ(pair->wire_bytes(), comm->wire_bytes());
    const auto tally = comm->tally();
    EXPECT_EQ(tally.at("allreduce").bytes, 4000);
    EXPECT_EQ(tally.at("allreduce").wire_bytes, 6000);
    EXPECT_EQ(pair->tally().at("allreduce").wire_bytes, 800);
  });
}

// Block-quantized collectives: every value within half a quantization step of its block
// (absolute maximum / 254) per rank it came from, the gathered copies the same on every rank,
// uneven and empty shares, and identity quantization equal to the plain collectives.
TEST(Comm, QuantizedAllgatherAndReduceScatterStayWithinHalfAStep) {
  run_ranks(4, [](const CommunicatorPtr& comm) {
    const int world = comm->size();
    const int me = comm->rank();
    comm::BlockQuantization q{64};
    auto mine = data_of(me, 300, torch::kFloat);  // 300: a last block of 44
    auto gathered = torch::empty({300 * world});
    comm::quantized_allgather(*comm, gathered, mine, q)->wait();
    for (int r = 0; r < world; ++r) {
      const auto exact = data_of(r, 300, torch::kFloat);
      const double step = exact.abs().max().item<double>() / 127;
      EXPECT_LE((gathered.narrow(0, r * 300, 300) - exact).abs().max().item<double>(),
                0.5 * step + 1e-6);
    }
    auto first = gathered.clone();  // every rank holds the same values
    comm->broadcast(first)->wait();
    EXPECT_TRUE(torch::equal(first, gathered));

    const std::vector<int64_t> counts{100, 0, 250, 50};
    auto input = data_of(me, 400, torch::kDouble);
    torch::Tensor sum = torch::zeros({400}, torch::kDouble);
    double bound = 0;
    for (int r = 0; r < world; ++r) {
      const auto other = data_of(r, 400, torch::kDouble);
      sum += other;
      if (r != me) bound += 0.5 * other.abs().max().item<double>() / 127;
    }
    int64_t offset = 0;
    for (int r = 0; r < me; ++r) offset += counts[r];
    auto out = torch::empty({counts[me]}, torch::kDouble);
    comm::quantized_reduce_scatter(*comm, out, input, counts, q)->wait();
    if (counts[me] > 0) {
      const auto expected = sum.narrow(0, offset, counts[me]);
      EXPECT_LE((out - expected).abs().max().item<double>(), bound + 1e-6);
      EXPECT_GT((out - expected).abs().max().item<double>(), 0.0) << "not quantized?";
      auto exact = torch::empty({counts[me]}, torch::kDouble);
      comm::quantized_reduce_scatter(*comm, exact, input, counts, {64, /*identity=*/true})->wait();
      EXPECT_LE((exact - expected).abs().max().item<double>(), 1e-12);
    } else {
      comm::quantized_reduce_scatter(*comm, out, input, counts, {64, true})->wait();
    }
  });
}

TEST(Comm, ProcessGridTwoByTwoByTwo) {
  run_ranks(
      8,
      [](const CommunicatorPtr& world) {
        comm::ProcessGrid grid(world, /*tp=*/2, /*pp=*/2);
        const int r = world->rank();
        EXPECT_EQ(grid.dp_size(), 2);
        const auto c = grid.coordinates();
        EXPECT_EQ(grid.world_rank_of(c), r);
        EXPECT_EQ(c.tp, r % 2);
        EXPECT_EQ(c.dp, (r / 2) % 2);
        EXPECT_EQ(c.pp, r / 4);
        // Each group's members: sum of world ranks tells exactly who is in it.
        auto sum_over = [&](const CommunicatorPtr& group) {
          auto t = torch::full({1}, static_cast<float>(r));
          group->allreduce(t)->wait();
          return static_cast<int>(t.item<float>());
        };
        EXPECT_EQ(sum_over(grid.tp()), 2 * (r - r % 2) + 1);    // {r, r^1}
        EXPECT_EQ(sum_over(grid.dp()), 2 * (r - (r & 2)) + 2);  // {r, r^2}
        EXPECT_EQ(sum_over(grid.pp()), 2 * (r - (r & 4)) + 4);  // {r, r^4}
        EXPECT_EQ(grid.tp()->global_ranks()[grid.tp()->rank()], r);
        EXPECT_EQ(grid.next_stage_world_rank(), c.pp == 0 ? r + 4 : -1);
        EXPECT_EQ(grid.prev_stage_world_rank(), c.pp == 1 ? r - 4 : -1);
      },
      60s);
}

// The replica-major order (--fault-tolerance replicas): world rank = dp x (pp x tp) + pp x tp +
// tp, so each data-parallel replica (both stages, both TP ranks) is 4 consecutive ranks.
TEST(Comm, ProcessGridReplicaByReplica) {
  run_ranks(
      8,
      [](const CommunicatorPtr& world) {
        comm::ProcessGrid grid(world, /*tp=*/2, /*pp=*/2, comm::GridOrder::kTpPpDp);
        const int r = world->rank();
        EXPECT_EQ(grid.order(), comm::GridOrder::kTpPpDp);
        const auto c = grid.coordinates();
        EXPECT_EQ(grid.world_rank_of(c), r);
        EXPECT_EQ(c.tp, r % 2);
        EXPECT_EQ(c.pp, (r / 2) % 2);
        EXPECT_EQ(c.dp, r / 4);
        auto sum_over = [&](const CommunicatorPtr& group) {
          auto t = torch::full({1}, static_cast<float>(r));
          group->allreduce(t)->wait();
          return static_cast<int>(t.item<float>());
        };
        EXPECT_EQ(sum_over(grid.tp()), 2 * (r - r % 2) + 1);    // {r, r^1}
        EXPECT_EQ(sum_over(grid.pp()), 2 * (r - (r & 2)) + 2);  // {r, r^2}
        EXPECT_EQ(sum_over(grid.dp()), 2 * (r - (r & 4)) + 4);  // {r, r^4}
        EXPECT_EQ(grid.next_stage_world_rank(), c.pp == 0 ? r + 2 : -1);
        EXPECT_EQ(grid.prev_stage_world_rank(), c.pp == 1 ? r - 2 : -1);
        EXPECT_EQ(grid.data_parallel_rank(), r / 4);
      },
      60s);
}

// PipeDream's layouts: stages replicated 2, 1 and 3 times on 6 ranks, stage by stage; dp() is
// the stage's replicas, pp() the whole pipeline, and the data is one stream.
TEST(Comm, ProcessGridOfReplicatedStages) {
  run_ranks(
      6,
      [](const CommunicatorPtr& world) {
        comm::ProcessGrid grid(world, 1, std::vector<int>{2, 1, 3});
        const int r = world->rank();
        const int stage = r < 2 ? 0 : r < 3 ? 1 : 2;
        const int first = r < 2 ? 0 : r < 3 ? 2 : 3;
        const auto c = grid.coordinates();
        EXPECT_EQ(c.pp, stage);
        EXPECT_EQ(c.dp, r - first);
        EXPECT_EQ(grid.world_rank_of(c), r);
        EXPECT_EQ(grid.pp_size(), 3);
        EXPECT_EQ(grid.dp_size(), stage == 0 ? 2 : stage == 1 ? 1 : 3);
        EXPECT_EQ(grid.data_parallel_size(), 1);
        EXPECT_EQ(grid.data_parallel_rank(), 0);
        EXPECT_EQ(grid.pp_rank_of(2, 1), 4);
        auto sum_over = [&](const CommunicatorPtr& group) {
          auto t = torch::full({1}, static_cast<float>(r));
          group->allreduce(t)->wait();
          return static_cast<int>(t.item<float>());
        };
        EXPECT_EQ(sum_over(grid.dp()), stage == 0 ? 1 : stage == 1 ? 2 : 12);
        EXPECT_EQ(sum_over(grid.pp()), 15);
        EXPECT_EQ(grid.pp()->rank(), r);
      },
      60s);
  run_ranks(3, [](const CommunicatorPtr& world) {
    EXPECT_THROW(comm::ProcessGrid(world, 1, std::vector<int>{2, 2}), InputError);
  });
}

TEST(Comm, OneRankWorldIsAValidGrid) {
  run_ranks(1, [](const CommunicatorPtr& world) {
    comm::ProcessGrid grid(world);
    auto t = torch::ones({3});
    grid.dp()->allreduce(t, {comm::ReduceOp::Avg})->wait();
    EXPECT_TRUE(torch::equal(t, torch::ones({3})));
    auto out = torch::empty({3});
    grid.dp()->reduce_scatter(out, t)->wait();
    EXPECT_TRUE(torch::equal(out, t));
  });
}

TEST(Comm, UnknownBackendIsAnInputError) {
  comm::InitOptions options;
  options.backend = "mpi";
  EXPECT_THROW(comm::init(options), InputError);
  // nccl: not built in (Debian's LibTorch) or no CUDA device here; with a device the GPU
  // checks (scripts/gpu-check) run it.
  options.backend = "nccl";
  if (torch::cuda::device_count() == 0) {
    EXPECT_THROW(comm::init(options), InputError);
  }
}

// Shared-memory point-to-point (the pipeline's same-machine transport): messages found by tag
// in any order, messages far larger than the ring streamed through it, both ends sending large
// messages to each other at once (each takes in the other's while its ring is full, so neither
// blocks forever), a length mismatch and a missing message named.
TEST(SharedMemoryChannel, DeliversByTagThroughASmallRingInBothDirectionsAtOnce) {
  run_ranks(2, [](const CommunicatorPtr& comm) {
    comm::SharedMemoryChannel channel(comm, {{0, 1}, {1, 0}}, /*ring_bytes=*/4096);
    ASSERT_TRUE(channel.connected(0, 1));
    ASSERT_TRUE(channel.connected(1, 0));
    const int me = comm->rank(), other = 1 - me;
    const auto big = [](int rank) { return data_of(rank, 300000, torch::kFloat); };
    // Out of order: the receiver asks for the small message first; the big one is kept.
    if (me == 0) {
      channel.send(1, 5, big(0), "big");
      channel.send(1, 6, data_of(7, 3, torch::kLong), "small");
    } else {
      EXPECT_TRUE(torch::equal(channel.recv(0, 6, {3}, torch::kLong, "small"),
                               data_of(7, 3, torch::kLong)));
      EXPECT_TRUE(torch::equal(channel.recv(0, 5, {300000}, torch::kFloat, "big"), big(0)));
    }
    // Both send 1.2 MB through 4 KB rings before receiving.
    for (int round = 0; round < 3; ++round) {
      channel.send(other, 100 + round, big(me), "crossing");
    }
    for (int round = 0; round < 3; ++round) {
      EXPECT_TRUE(torch::equal(
          channel.recv(other, 100 + round, {300000}, torch::kFloat, "crossing"), big(other)));
    }
    // A message of another length is named, not reinterpreted.
    if (me == 0) {
      channel.send(1, 9, torch::zeros({10}), "short");
    } else {
      try {
        channel.recv(0, 9, {11}, torch::kFloat, "the activation of micro-batch 3");
        ADD_FAILURE() << "a length mismatch was accepted";
      } catch (const CommError& e) {
        const std::string text = e.what();
        EXPECT_NE(text.find("the activation of micro-batch 3"), std::string::npos) << text;
        EXPECT_NE(text.find("received 40 bytes, expected 44"), std::string::npos) << text;
      }
    }
    comm->barrier()->wait();
  });
}

TEST(SharedMemoryChannel, AMessageNeverSentTimesOutNamingGroupAndPeer) {
  std::atomic<bool> done{false};
  run_ranks(
      2,
      [&](const CommunicatorPtr& comm) {
        // Only 0 -> 1 asked for: the other direction is not connected.
        comm::SharedMemoryChannel channel(comm, {{0, 1}});
        EXPECT_TRUE(channel.connected(0, 1));
        EXPECT_FALSE(channel.connected(1, 0));
        if (comm->rank() == 1) {
          const auto start = std::chrono::steady_clock::now();
          try {
            channel.recv(0, 1, {4}, torch::kFloat, "the gradient of micro-batch 0");
            ADD_FAILURE() << "a receive with no sender returned";
          } catch (const TimeoutError& e) {
            const std::string text = e.what();
            EXPECT_NE(text.find("the gradient of micro-batch 0"), std::string::npos) << text;
            EXPECT_NE(text.find("group 'world', rank 1 with rank 0 = world rank 0"),
                      std::string::npos)
                << text;
            EXPECT_NE(text.find("timed out after 3000 ms"), std::string::npos) << text;
          }
          EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
          done = true;
        } else {
          // Stay alive (bounded) until rank 1 has seen its timeout.
          for (int i = 0; i < 1000 && !done; ++i) std::this_thread::sleep_for(10ms);
          EXPECT_TRUE(done);
        }
      },
      3s);
}
