// The federated server and clients over gRPC (in process, on 127.0.0.1): clients train the model
// FedAvg computes in process (synchronous, buffered, SCAFFOLD and FedDyn), stragglers, late and
// out-of-time clients, bad clients and bad updates refused without affecting the round,
// availability windows, personalization of the final model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>

#include <grpcpp/grpcpp.h>
#include "SmallModels.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"

#include <atomic>
#include <thread>

#include "FederatedServerTesting.h"
#include "FederatedTesting.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/aggregation/Drift.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/services/federated/service/Server.h"
#include "dtrain/services/federated/simulation/ClientPartition.h"
#include "dtrain/services/federated/simulation/Simulation.h"
#include "services/federated/secagg/SecureServerRound.h"
#include "services/federated/service/FlWire.h"

using namespace dtrain;
using namespace dtrain::services::federated;
using namespace dtrain::services::federated::testing;

// Three client processes' worth of clients (threads) over gRPC: every round selects all three,
// and after 3 rounds the global model is exactly (float64, 1e-12) what FedAvg computed in one
// process gives: the protocol moves the model and the updates without changing a bit.
TEST(FederatedServer, ClientsOverGrpcTrainTheModelFedAvgComputesInProcess) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 21);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  Server server(initial, server_options(3, 3));
  ServerResult result;
  const auto reports = run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 3);
  // The reference: the example-weighted mean of each client's full-batch step, three times.
  const at::Tensor global =
      fedavg_reference(initial, train, clients, server_options(3, 3).round.local, 3);
  EXPECT_LE((result.global - global).abs().max().item<double>(), kTightBound);
  EXPECT_GT((result.global - initial).abs().max().item<double>(), 1e-3);
  for (const auto& r : result.rounds) {
    EXPECT_EQ(r.outcome.selected, 3);
    EXPECT_EQ(r.outcome.finished, 3);
    // Measured: each client's float64 update (and each download) plus message headers.
    EXPECT_GE(r.uplink_bytes, 3 * 8 * initial.numel());
    EXPECT_LE(r.uplink_bytes, 3 * 8 * initial.numel() + 3 * 100);
    EXPECT_GE(r.downlink_bytes, 3 * 8 * initial.numel());
  }
  for (const auto& report : reports) {
    EXPECT_EQ(report.rounds_trained, 3);
    EXPECT_EQ(report.done_reason, "the last round is over");
  }
}

// Buffered aggregation over gRPC (FedBuff): with K = C = every client and no staleness
// discount it is the synchronous computation exactly; with K < C updates arrive from older
// models and are discounted; a restarted server resumes the steps from its checkpoint.
TEST(FederatedServer, BufferedAggregationOverGrpcTakesUpdatesAsTheyComeAndResumes) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 21);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(3, 3);
  options.round.buffer.size = 3;
  options.round.buffer.concurrency = 3;
  options.round.buffer.staleness = parse_staleness("constant");
  Server server(initial, options);
  ServerResult result;
  run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 3);
  const at::Tensor global = fedavg_reference(initial, train, clients, options.round.local, 3);
  EXPECT_LE((result.global - global).abs().max().item<double>(), kTightBound);

  // K = 2 of C = 3: the third update of a step comes from an older model (stale).
  const test::TempDir dir;
  ServerOptions smaller = options;
  smaller.round.buffer.size = 2;
  smaller.round.buffer.staleness = parse_staleness("poly:0.5");
  smaller.rounds = 4;
  smaller.checkpoint_dir = dir.path();
  Server first(initial, smaller);
  ServerResult part;
  run_clients(first, train, clients, &part);
  ASSERT_EQ(part.rounds_done, 4);
  double staleness = 0;
  for (const auto& r : part.rounds) {
    EXPECT_EQ(r.outcome.finished, 2);
    staleness += r.outcome.staleness;
  }
  EXPECT_GT(staleness, 0.0);
  EXPECT_EQ(part.refused, 0);
  // Restarted with the same checkpoint directory: it goes on from step 4.
  smaller.rounds = 6;
  Server second(initial, smaller);
  EXPECT_EQ(second.round(), 4);
  ServerResult rest;
  run_clients(second, train, clients, &rest);
  EXPECT_EQ(rest.start_round, 4);
  EXPECT_EQ(rest.rounds_done, 6);
  EXPECT_EQ(rest.rounds.size(), 2u);
}

// SCAFFOLD and FedDyn over gRPC: the server control variate travels with the model, each
// client keeps its own state, SCAFFOLD's control change travels with the update; after 3
// rounds the global model is exactly what the drift-corrected clients and the round server
// compute in one process.
TEST(FederatedServer, ScaffoldAndFedDynOverGrpcEqualTheirInProcessRounds) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 26);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  for (const std::string algorithm : {"scaffold", "feddyn"}) {
    ServerOptions options = server_options(3, 3);
    options.round.aggregator.algorithm = algorithm;
    options.round.population = 3;
    options.round.local.epochs = 2;  // two full-batch steps: the correction matters after the first
    Server server(initial, options);
    ServerResult result;
    run_clients(server, train, clients, &result);
    ASSERT_EQ(result.rounds_done, 3) << algorithm;
    // The reference: the same clients and server logic in one process.
    RoundServerOptions in_process;
    in_process.aggregator.algorithm = algorithm;
    in_process.clients_per_round = 3;
    in_process.population = 3;
    in_process.local = options.round.local;
    RoundServer reference(initial, in_process);
    Model model = model64(0);
    std::map<std::string, at::Tensor> memory;
    for (int round = 0; round < 3; ++round) {
      reference.select({"a", "b", "c"});
      const at::Tensor global = reference.global();
      const at::Tensor control = reference.client_control();
      for (const auto& [id, indices] : clients) {
        const CorrectedUpdate u =
            train_client(model, global, train, indices, reference.plan(), 0, &memory[id], control);
        ASSERT_EQ(
            reference.submit(id, u.update.delta, u.update.examples, u.update.loss, u.control_delta),
            "");
      }
      ASSERT_TRUE(reference.close().applied);
    }
    EXPECT_LE((result.global - reference.global()).abs().max().item<double>(), kTightBound)
        << algorithm;
    // ... and differs from FedAvg's (the correction is applied).
    EXPECT_GT((result.global - initial).abs().max().item<double>(), 1e-3);
    if (algorithm == "scaffold") {
      // The uploads carried the control changes too: twice FedAvg's bytes.
      EXPECT_GE(result.rounds[0].uplink_bytes, 2 * 3 * 8 * initial.numel());
    }
  }
}

// A straggler past the round's deadline is dropped and the round closes with those that
// finished (>= --min-clients); a client whose availability ends mid-round leaves it.
TEST(FederatedServer, StragglersAreDroppedAndTheRoundClosesWithTheRest) {
  at::set_num_threads(1);
  const auto train = synthetic64(90, 22);
  ServerOptions options = server_options(2, 3);
  options.round.min_clients = 2;
  options.round_timeout_s = 2;
  Server server(flatten_parameters(model64(0)), options);
  std::atomic<int> asked{0};
  ServerResult result;
  const auto reports = run_clients(
      server, train, {{"a", range(0, 30)}, {"b", range(30, 60)}, {"slow", range(60, 90)}}, &result,
      [&](ClientOptions& o) {
        if (o.client_id != "slow") return;
        // Available for its check-ins, gone as soon as it starts training.
        o.available = [&] { return ++asked % 2 == 1; };
      });
  ASSERT_EQ(result.rounds_done, 2);
  for (const auto& r : result.rounds) {
    EXPECT_TRUE(r.outcome.applied);
    EXPECT_EQ(r.outcome.finished, 2);
    EXPECT_EQ(r.outcome.dropped, 1);
  }
  EXPECT_EQ(reports[2].rounds_trained, 0);
  EXPECT_GE(reports[2].rounds_abandoned, 2);
}

// A client still training when the round's deadline passes does not send its update into a
// closed round: its upload's call ends at the deadline the check-in named, it counts the round
// as missed and says so, and the server never sees a late upload. The other client's lines
// trace its round (selected, update sent, told it is over).
TEST(FederatedServer, AClientPastTheRoundsDeadlineLeavesWithoutUploading) {
  at::set_num_threads(1);
  const auto train = synthetic64(60, 24);
  ServerOptions options = server_options(1, 2);
  options.round.min_clients = 1;
  options.round_timeout_s = 1.5;
  Server server(flatten_parameters(model64(0)), options);
  std::mutex mutex;
  std::map<std::string, std::vector<std::string>> lines;
  ServerResult result;
  const auto reports =
      run_clients(server, train, {{"a", range(0, 30)}, {"late", range(30, 60)}}, &result,
                  [&](ClientOptions& o) {
                    const std::string id = o.client_id;
                    o.log = [&, id](const std::string& line) {
                      std::lock_guard<std::mutex> lock(mutex);
                      lines[id].push_back(line);
                    };
                    if (id != "late") return;
                    // Available; the first check during local training takes 2.5 s (past the
                    // deadline, so the client stops before its first step).
                    o.available = [calls = std::make_shared<int>(0)] {
                      if (++*calls == 2)
                        std::this_thread::sleep_for(std::chrono::milliseconds(2500));
                      return true;
                    };
                  });
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.rounds[0].outcome.finished, 1);
  EXPECT_EQ(result.rounds[0].outcome.dropped, 1);
  EXPECT_EQ(result.late, 0);
  EXPECT_EQ(reports[1].rounds_trained, 0);
  EXPECT_EQ(reports[1].rounds_missed, 1);
  EXPECT_EQ(reports[1].uploads_refused, 0);
  auto has = [&](const std::string& id, const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    return std::any_of(lines[id].begin(), lines[id].end(),
                       [&](const std::string& l) { return l.find(text) != std::string::npos; });
  };
  EXPECT_TRUE(has("late",
                  "round 1: the round's deadline passed during local training, after 0 of 1 "
                  "steps in "));
  EXPECT_TRUE(has("a", "round 1: selected (1 epochs, batch 0, 30 examples; deadline in"));
  EXPECT_TRUE(has("a", "round 1: update sent ("));
  EXPECT_TRUE(has("a", "the server says the last round is over"));
}

// A client whose plan takes longer than the round stops local training at the deadline (between
// batches), says so, checks in again and tells the server, which says what the plan needs.
TEST(FederatedServer, AClientOutOfTimeStopsTrainingAtTheDeadlineAndTheServerSaysWhatItNeeds) {
  at::set_num_threads(1);
  const auto train = synthetic64(20010, 25);
  ServerOptions options = server_options(2, 2);
  options.round.min_clients = 1;
  options.round_timeout_s = 1.0;
  options.selection_timeout_s = 3.0;
  options.round.local.epochs = 20;
  options.round.local.batch = 10;  // "slow": 40,000 steps, many seconds; "quick": 20 steps
  Server server(flatten_parameters(model64(0)), options);
  std::mutex mutex;
  std::vector<std::string> slow_lines;
  ServerResult result;
  const auto reports =
      run_clients(server, train, {{"quick", range(0, 10)}, {"slow", range(10, 20010)}}, &result,
                  [&](ClientOptions& o) {
                    if (o.client_id != "slow") return;
                    o.log = [&](const std::string& line) {
                      std::lock_guard<std::mutex> lock(mutex);
                      slow_lines.push_back(line);
                    };
                  });
  ASSERT_EQ(result.rounds_done, 2);
  EXPECT_EQ(result.rounds[0].outcome.finished, 1);
  EXPECT_EQ(reports[1].rounds_trained, 0);
  EXPECT_GE(reports[1].rounds_missed, 1);
  EXPECT_EQ(result.late, 0);  // it never uploads a stale update
  ASSERT_FALSE(result.out_of_time.empty());
  const std::string& line = result.out_of_time.front();
  EXPECT_NE(line.find("round 1: client 'slow' ran out of time after "), std::string::npos) << line;
  EXPECT_NE(line.find("of 40000 local steps in "), std::string::npos) << line;
  EXPECT_NE(line.find("--round-timeout is 1 s: raise it"), std::string::npos) << line;
  // It stopped at the deadline: within a second of it, not after its 40,000 steps.
  const double trained_s = std::stod(line.substr(line.find(" local steps in ") + 16));
  EXPECT_LT(trained_s, 2.0) << line;
  std::lock_guard<std::mutex> lock(mutex);
  EXPECT_TRUE(std::any_of(slow_lines.begin(), slow_lines.end(), [](const std::string& l) {
    return l.find("round 1: the round's deadline passed during local training, after ") !=
               std::string::npos &&
           l.find("; checking in again") != std::string::npos;
  }));
}

// Per-client tokens: a client without its token is refused by name; an update from a client
// that was not selected and one holding NaN are refused and logged, and the round goes on with
// the selected client's real update.
TEST(FederatedServer, BadClientsAndBadUpdatesAreRefusedWithoutAffectingTheRound) {
  at::set_num_threads(1);
  const auto train = synthetic64(40, 23);
  ServerOptions options = server_options(1, 1);
  options.client_tokens = {{"a", "token-a"}, {"b", "token-b"}};
  const at::Tensor initial = flatten_parameters(model64(0));
  Server server(initial, options);
  // A wrong token: refused at check-in, an InputError naming the reason.
  {
    ClientOptions o = client_options(server, "b");
    o.token = "token-a";
    Client intruder(test_model(), train, range(0, 10), o);
    try {
      intruder.run();
      ADD_FAILURE() << "a client with another's token took part";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("token is wrong"), std::string::npos) << e.what();
    }
  }
  // Client a trains; its first local step waits until the bad uploads were made.
  std::atomic<bool> bad_done{false};
  ServerResult result;
  std::thread bad([&] {
    auto stub = dtrain::fl::Federated::NewStub(
        grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    auto upload = [&](const std::string& id, const std::string& token, const at::Tensor& delta) {
      grpc::ClientContext context;
      context.AddMetadata("authorization", "Bearer " + token);
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      for (const auto& m : wire::update_messages(comm::encode_update(delta, {}, nullptr, 0), id, 1,
                                                 10, 0.0, 1 << 20)) {
        writer->Write(m);
      }
      writer->WritesDone();
      return writer->Finish();
    };
    const at::Tensor zeros = at::zeros_like(initial);
    // Until round 1 is open (bounded).
    grpc::Status status;
    for (int i = 0; i < 200; ++i) {
      status = upload("b", "token-b", zeros);
      if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_NE(status.error_message().find("'b' was not selected"), std::string::npos)
        << status.error_message();
    status = upload("a", "token-a", at::full_like(initial, NAN));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("NaN or Inf"), std::string::npos)
        << status.error_message();
    EXPECT_EQ(upload("a", "token-b", zeros).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    bad_done = true;
  });
  const auto reports =
      run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
        o.token = "token-a";
        // The first call is before its check-in; the later ones are its local steps.
        o.available = [&, calls = std::make_shared<int>(0)] {
          for (int i = 0; ++*calls > 1 && i < 400 && !bad_done; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(25));
          }
          return true;
        };
      });
  bad.join();
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.refused, 2);
  EXPECT_EQ(reports[0].rounds_trained, 1);
  // The round's model is a's update alone.
  Model model = model64(0);
  const ClientUpdate u = train_locally(model, initial, train, range(0, 40), options.round.local, 0);
  EXPECT_LE((result.global - (initial + u.delta)).abs().max().item<double>(), kTightBound);
}

TEST(FederatedServer, AvailabilityWindowsCrossMidnight) {
  EXPECT_TRUE(available_at("22:00-06:00", 23 * 60));
  EXPECT_TRUE(available_at("22:00-06:00", 5 * 60 + 59));
  EXPECT_FALSE(available_at("22:00-06:00", 6 * 60));
  EXPECT_FALSE(available_at("22:00-06:00", 12 * 60));
  EXPECT_TRUE(available_at("09:00-10:00,13:00-14:30", 14 * 60 + 29));
  EXPECT_FALSE(available_at("09:00-10:00,13:00-14:30", 11 * 60));
  EXPECT_TRUE(available_at("always", 0));
  EXPECT_THROW(available_at("25:00-06:00", 0), InputError);
  EXPECT_THROW(available_at("22:00", 0), InputError);
  EXPECT_THROW(available_at("08:00-08:00", 0), InputError);
}

// A deployed client personalizes once training is over: it downloads the final model (the
// server waits for that before stopping), fine-tunes it on its own examples, tests both on its
// held-out examples and saves the result.
TEST(FederatedServer, ClientsPersonalizeTheFinalModelAndSaveIt) {
  at::set_num_threads(1);
  const auto train = synthetic64(400, 81);
  // Two clients of one class each: the global model is poor on each, fine-tuning fixes that.
  const auto parts = partition(train.targets(), 10, parse_partition("shards:1"), 5, 0.25);
  ASSERT_EQ(classes_among(train.targets(), parts[0].train), 1);
  test::TempDir dir;
  // One full-batch step of training: the global model is still poor at each client's class.
  ServerOptions options = server_options(1, 2);
  Server server(flatten_parameters(model64(0)), options);
  ServerResult result;
  const auto reports = run_clients(server, train, {{"a", parts[0].train}, {"b", parts[1].train}},
                                   &result, [&](ClientOptions& o) {
                                     const size_t c = o.client_id == "a" ? 0 : 1;
                                     o.personalize_epochs =
                                         20;  // full-batch steps, the plan's batch
                                     o.test_indices = parts[c].test;
                                     o.save_model = dir / (o.client_id + ".pt");
                                   });
  ASSERT_EQ(result.rounds_done, 1);
  double global = 0, personalized = 0;
  for (const auto& report : reports) {
    ASSERT_GE(report.global_accuracy, 0.0);
    EXPECT_GE(report.personalized_accuracy, report.global_accuracy);
    EXPECT_GE(report.personalized_accuracy, 0.85);
    global += report.global_accuracy / 2;
    personalized += report.personalized_accuracy / 2;
  }
  // The global model leans to one client's class; each personalized model knows its own.
  EXPECT_GT(personalized, global + 0.3);
  EXPECT_TRUE(std::filesystem::exists(dir / "a.pt"));
  EXPECT_TRUE(std::filesystem::exists(dir / "b.pt"));
}
