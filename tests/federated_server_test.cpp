// The federated server and clients over gRPC (in process, on 127.0.0.1): clients train the model
// FedAvg computes in process, stragglers and late clients, bad clients and fuzzed updates
// refused without affecting the round, availability windows, secure aggregation with dropouts
// and retries, TLS, tokens, personalization of the final model.
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

#include "FederatedTesting.h"
#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/Client.h"
#include "dtrain/services/federated/Compression.h"
#include "dtrain/services/federated/Drift.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/Partition.h"
#include "dtrain/services/federated/Personalization.h"
#include "dtrain/services/federated/Privacy.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/SecureAggregation.h"
#include "dtrain/services/federated/Server.h"
#include "dtrain/services/federated/Simulation.h"
#include "services/federated/FlWire.h"
#include "services/federated/SecureServerRound.h"

using namespace dtrain;
using namespace dtrain::federated;
using namespace dtrain::federated::testing;

// ---- The gRPC server and clients (in-process, on 127.0.0.1) ----

namespace {

// The client's model: the test's float64 MLP, whatever the server names.
Client::ModelFactory test_model() {
  return [](const std::string&, const std::vector<int64_t>&) { return model64(0); };
}

ServerOptions server_options(int64_t rounds, int64_t k) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.rounds = rounds;
  o.clients_per_round = k;
  o.local.epochs = 1;
  o.local.batch = 0;  // full batch: the order of examples does not matter
  o.local.lr = 0.1;
  o.round_timeout_s = 30;
  o.wait_timeout_s = 30;
  o.progress = false;
  return o;
}

ClientOptions client_options(const Server& server, const std::string& id) {
  ClientOptions o;
  o.server = server.address();
  o.client_id = id;
  o.wait = std::chrono::milliseconds(500);
  o.retry_window = std::chrono::milliseconds(5000);
  return o;
}

// Runs `clients` (each its id, examples and options tweak) against `server` in threads.
std::vector<ClientReport> run_clients(
    Server& server, const data::TensorDataset& train,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& clients, ServerResult* result,
    const std::function<void(ClientOptions&)>& tweak = nullptr) {
  std::vector<ClientReport> reports(clients.size());
  std::vector<std::string> errors(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        at::set_num_threads(1);
        ClientOptions o = client_options(server, clients[i].first);
        if (tweak) tweak(o);
        Client client(test_model(), train, clients[i].second, o);
        reports[i] = client.run();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  *result = server.run();
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < clients.size(); ++i) EXPECT_EQ(errors[i], "") << clients[i].first;
  return reports;
}

// FedAvg computed in one process: `rounds` rounds of every client's local training from
// `initial`, averaged by example count (the reference the gRPC rounds must equal).
at::Tensor fedavg_reference(
    const at::Tensor& initial, const data::TensorDataset& train,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& clients,
    const LocalTraining& plan, int rounds) {
  at::Tensor global = initial.clone();
  Model model = model64(0);
  for (int round = 0; round < rounds; ++round) {
    WeightedMean mean;
    for (const auto& [id, indices] : clients) {
      const ClientUpdate u = train_locally(model, global, train, indices, plan, 0);
      mean.add(u.delta, static_cast<double>(u.examples));
    }
    global += mean.mean(at::kDouble);
  }
  return global;
}

}  // namespace

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
      fedavg_reference(initial, train, clients, server_options(3, 3).local, 3);
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
  options.buffer.size = 3;
  options.buffer.concurrency = 3;
  options.buffer.staleness = parse_staleness("constant");
  Server server(initial, options);
  ServerResult result;
  run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 3);
  const at::Tensor global = fedavg_reference(initial, train, clients, options.local, 3);
  EXPECT_LE((result.global - global).abs().max().item<double>(), kTightBound);

  // K = 2 of C = 3: the third update of a step comes from an older model (stale).
  const test::TempDir dir;
  ServerOptions smaller = options;
  smaller.buffer.size = 2;
  smaller.buffer.staleness = parse_staleness("poly:0.5");
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
    options.algorithm = algorithm;
    options.population = 3;
    options.local.epochs = 2;  // two full-batch steps: the correction matters after the first
    Server server(initial, options);
    ServerResult result;
    run_clients(server, train, clients, &result);
    ASSERT_EQ(result.rounds_done, 3) << algorithm;
    // The reference: the same clients and server logic in one process.
    RoundServerOptions in_process;
    in_process.algorithm = algorithm;
    in_process.clients_per_round = 3;
    in_process.population = 3;
    in_process.local = options.local;
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
  options.min_clients = 2;
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
  options.min_clients = 1;
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
  options.min_clients = 1;
  options.round_timeout_s = 1.0;
  options.selection_timeout_s = 3.0;
  options.local.epochs = 20;
  options.local.batch = 10;  // "slow": 40,000 steps, many seconds; "quick": 20 steps
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
      for (const auto& m :
           wire::update_messages(encode_update(delta, {}, nullptr, 0), id, 1, 10, 0.0, 1 << 20)) {
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
  const ClientUpdate u = train_locally(model, initial, train, range(0, 40), options.local, 0);
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

TEST(FederatedServer, SecureAggregationOverGrpcSumsTheUpdatesAndSurvivesADropout) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 61);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}, {"d", range(90, 120)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(2, 4);
  options.secure_aggregation = true;
  Server server(initial, options);
  ServerResult result;
  run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 2);
  const at::Tensor global = fedavg_reference(initial, train, clients, options.local, 2);
  const double difference = (result.global - global).abs().max().item<double>();
  EXPECT_LT(difference, 1e-4);
  EXPECT_GT(difference, 0.0);  // fixed point: not the plaintext computation
  for (const auto& r : result.rounds) {
    EXPECT_EQ(r.outcome.finished, 4);
    EXPECT_GT(r.server_aggregation_s, 0.0);
  }
  // SecAgg+ over gRPC: a ring of degree 2 (each client masks and shares with 2 of the 3 others,
  // the graph drawn by server and clients from the round's seed) sums the same fixed-point
  // inputs: the same model bit for bit.
  ServerOptions plus_options = options;
  plus_options.secagg_graph = 2;
  Server plus(initial, plus_options);
  ServerResult plus_result;
  run_clients(plus, train, clients, &plus_result);
  ASSERT_EQ(plus_result.rounds_done, 2);
  EXPECT_TRUE(plus_result.global.equal(result.global));

  // One client leaves after its keys and shares, each round: t = 3 of 4 survive it.
  ServerOptions dropping = options;
  dropping.round_timeout_s = 2.5;
  dropping.secagg_step_timeout_s = 5;
  dropping.secagg_threshold = 0.75;
  Server second(initial, dropping);
  std::atomic<int> asked{0};
  ServerResult with_dropout;
  const auto reports = run_clients(second, train, clients, &with_dropout, [&](ClientOptions& o) {
    if (o.client_id != "d") return;
    o.available = [&] { return ++asked % 2 == 1; };  // check-ins yes, training no
  });
  ASSERT_EQ(with_dropout.rounds_done, 2);
  for (const auto& r : with_dropout.rounds) {
    EXPECT_TRUE(r.outcome.applied);
    EXPECT_EQ(r.outcome.finished, 3);
    EXPECT_EQ(r.outcome.dropped, 1);
  }
  EXPECT_EQ(reports[3].rounds_trained, 0);
}

// A masked upload whose stream began while its client was selected but ends after the secure
// round was retried without it (the first attempt aborted: nobody sent keys) is refused by
// name, and the retried round sums its own clients' inputs only.
TEST(FederatedServer, AMaskedUploadFromBeforeARetryIsRefusedAndTheRetrySumsItsOwnClients) {
  at::set_num_threads(1);
  const auto train = synthetic64(60, 62);
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(1, 2);
  options.secure_aggregation = true;
  options.secagg_step_timeout_s = 1;
  options.round_timeout_s = 3;  // also the linger for x and y, who never hear the run is over
  Server server(initial, options);
  ServerResult result;
  std::thread serving([&] { result = server.run(); });
  auto stub = dtrain::fl::Federated::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  auto within = [](int seconds) {
    return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
  };
  // x and y check in together: the first attempt at round 1 selects them.
  std::vector<dtrain::fl::CheckInReply> replies(2);
  std::vector<std::thread> checkins;
  for (int i = 0; i < 2; ++i) {
    checkins.emplace_back([&, i] {
      dtrain::fl::CheckInRequest request;
      request.set_client_id(i == 0 ? "x" : "y");
      request.set_examples(10);
      request.set_wait_ms(10000);
      grpc::ClientContext context;
      context.set_deadline(within(20));
      EXPECT_TRUE(stub->CheckIn(&context, request, &replies[i]).ok());
    });
  }
  for (auto& t : checkins) t.join();
  ASSERT_EQ(replies[0].action(), dtrain::fl::CheckInReply::TRAIN);
  ASSERT_EQ(replies[1].action(), dtrain::fl::CheckInReply::TRAIN);
  // x opens a masked upload while selected (its first message is taken)...
  EncodedUpdate masked;
  masked.encoding = "secagg";
  masked.parts.emplace_back("masked", at::zeros({initial.numel() + 2}, at::kInt));
  const auto messages = wire::update_messages(masked, "x", 1, 10, 0.0, 256);
  ASSERT_GT(messages.size(), 1u);
  grpc::ClientContext upload_context;
  upload_context.set_deadline(within(30));
  dtrain::fl::UploadReply uploaded;
  auto writer = stub->Upload(&upload_context, &uploaded);
  ASSERT_TRUE(writer->Write(messages[0]));
  // ...neither sends keys, so the attempt aborts after the step timeout and the round is
  // retried with a and b, who check in only now; a holds its local training until x's
  // upload is over, so the retried round is open when it ends.
  std::atomic<bool> x_done{false};
  std::atomic<bool> a_selected{false};
  std::vector<std::thread> clients;
  std::vector<std::string> errors(2);
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] {
      try {
        at::set_num_threads(1);
        ClientOptions o = client_options(server, i == 0 ? "a" : "b");
        if (i == 0) {
          o.log = [&](const std::string& line) {
            if (line.find("round 1: selected") != std::string::npos) a_selected = true;
          };
          o.available = [&] {  // once selected (training), held until x's upload is over
            for (int k = 0; a_selected && k < 400 && !x_done; ++k) {
              std::this_thread::sleep_for(std::chrono::milliseconds(25));
            }
            return true;
          };
        }
        Client client(test_model(), train, i == 0 ? range(0, 20) : range(20, 60), o);
        client.run();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (int k = 0; k < 400 && !a_selected; ++k)
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  EXPECT_TRUE(a_selected);
  for (size_t i = 1; i < messages.size(); ++i) writer->Write(messages[i]);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  x_done = true;
  for (auto& t : clients) t.join();
  serving.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("client 'x' is not in this secure round"),
            std::string::npos)
      << status.error_message();
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(result.rounds.back().outcome.finished, 2);
  EXPECT_EQ(result.refused, 1);
  // The round's model: a's and b's updates, example-weighted (fixed point: within 1e-4).
  Model model = model64(0);
  WeightedMean mean;
  for (const auto& indices : {range(0, 20), range(20, 60)}) {
    const ClientUpdate u = train_locally(model, initial, train, indices, options.local, 0);
    mean.add(u.delta, static_cast<double>(u.examples));
  }
  EXPECT_LT((result.global - (initial + mean.mean(at::kDouble))).abs().max().item<double>(), 1e-4);
}

// TLS: a client trusting the server's certificate trains a round; one speaking plaintext to it
// gets nowhere and says which server it could not reach.
TEST(FederatedServer, TlsClientsTrainAndPlaintextOnesAreTurnedAway) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "openssl is not installed: this test needs it to make a throwaway "
                    "certificate (scripts/setup installs it)";
  }
  test::TempDir dir;
  const std::string make_cert =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
      (dir / "key.pem") + " -out " + (dir / "cert.pem") + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(make_cert.c_str()), 0) << make_cert;
  at::set_num_threads(1);
  const auto train = synthetic64(40, 71);
  ServerOptions options = server_options(1, 1);
  options.tls_cert = dir / "cert.pem";
  options.tls_key = dir / "key.pem";
  Server server(flatten_parameters(model64(0)), options);
  {
    ClientOptions plain = client_options(server, "p");
    plain.retry_window = std::chrono::milliseconds(1500);
    plain.rpc_timeout = std::chrono::milliseconds(1000);
    Client client(test_model(), train, range(0, 10), plain);
    try {
      client.run();
      ADD_FAILURE() << "a plaintext client reached a TLS server";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(server.address()), std::string::npos) << e.what();
    }
  }
  ServerResult result;
  const auto reports =
      run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
        o.tls = true;
        o.tls_ca = dir / "cert.pem";
      });
  EXPECT_EQ(result.rounds_done, 1);
  EXPECT_EQ(reports[0].rounds_trained, 1);
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

TEST(FederatedServer, ClientTokenFilesAreCheckedLineByLine) {
  test::TempDir dir;
  auto write = [&](const std::string& text) {
    std::ofstream(dir / "tokens") << text;
    return dir / "tokens";
  };
  EXPECT_EQ(read_client_tokens(write("# phones\na t1\n\nb t2\n")),
            (std::map<std::string, std::string>{{"a", "t1"}, {"b", "t2"}}));
  auto message = [&](const std::string& text) {
    try {
      read_client_tokens(write(text));
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message("a t1\nb\n").find("tokens:2: expected 'CLIENT_ID TOKEN'"), std::string::npos);
  EXPECT_NE(message("a t1 extra\n").find("tokens:1"), std::string::npos);
  EXPECT_NE(message("a t1\na t2\n").find("tokens:2: client 'a' is listed twice"),
            std::string::npos);
  EXPECT_NE(message("a/b t1\n").find("is not a client id"), std::string::npos);
  EXPECT_NE(message("# nobody\n").find("lists no clients"), std::string::npos);
  EXPECT_NE(message("").find("lists no clients"), std::string::npos);
}

// Random and mutated upload streams from the selected client: each is refused (or, being
// late or malformed, ignored), the server does not fall over, and the client's real update is
// then taken as if nothing had happened.
TEST(FederatedServer, FuzzedUploadsAreRefusedAndChangeNothing) {
  at::set_num_threads(1);
  const auto train = synthetic64(40, 91);
  const at::Tensor initial = flatten_parameters(model64(0));
  const int64_t n = initial.numel();
  Server server(initial, server_options(1, 1));
  std::atomic<bool> fuzzed{false};
  int refused = 0, accepted = 0;
  std::thread fuzzer([&] {
    auto stub = dtrain::fl::Federated::NewStub(
        grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    std::mt19937 random(17);
    auto pick = [&](std::initializer_list<std::string> values) {
      return *(values.begin() + random() % values.size());
    };
    // Until round 1 is open (bounded): an empty-stream probe.
    for (int i = 0; i < 200; ++i) {
      grpc::ClientContext context;
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      dtrain::fl::UpdateChunk probe;
      probe.set_client_id("a");
      probe.set_round(1);
      probe.set_encoding("zip");
      writer->Write(probe);
      writer->WritesDone();
      if (writer->Finish().error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    for (int i = 0; i < 150; ++i) {
      grpc::ClientContext context;
      dtrain::fl::UploadReply reply;
      auto writer = stub->Upload(&context, &reply);
      const int messages = 1 + static_cast<int>(random() % 3);
      for (int m = 0; m < messages; ++m) {
        dtrain::fl::UpdateChunk chunk;
        chunk.set_client_id(random() % 8 == 0 ? "zz" : "a");
        chunk.set_round(random() % 8 == 0 ? 2 : 1);
        chunk.set_examples(static_cast<int64_t>(random() % 3) - 1);
        chunk.set_encoding(pick({"none", "q8", "topk", "secagg", "zip", ""}));
        auto* t = chunk.mutable_chunk();
        t->set_name(pick({"delta", "q", "lo", "step", "indices", "values", "masked", "x"}));
        t->set_dtype(static_cast<dtrain::rpc::DType>(random() % 10));
        if (random() % 4 != 0)
          t->add_shape(random() % 2 == 0 ? n : static_cast<int64_t>(random() % (2 * n)));
        t->set_offset(random() % 4 == 0 ? static_cast<int64_t>(random() % n) : 0);
        std::string data(random() % 4096, '\0');
        for (auto& b : data) b = static_cast<char>(random());
        t->set_data(data);
        writer->Write(chunk);
      }
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      if (status.ok()) {
        ++accepted;
      } else {
        ++refused;
      }
    }
    fuzzed = true;
  });
  ServerResult result;
  const auto reports =
      run_clients(server, train, {{"a", range(0, 40)}}, &result, [&](ClientOptions& o) {
        // Its first local step waits until the fuzzing is over.
        o.available = [&, calls = std::make_shared<int>(0)] {
          for (int i = 0; ++*calls > 1 && i < 800 && !fuzzed; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(25));
          }
          return true;
        };
      });
  fuzzer.join();
  EXPECT_EQ(accepted, 0);
  EXPECT_EQ(refused, 150);
  ASSERT_EQ(result.rounds_done, 1);
  EXPECT_EQ(reports[0].rounds_trained, 1);
  Model model = model64(0);
  const ClientUpdate u =
      train_locally(model, initial, train, range(0, 40), server_options(1, 1).local, 0);
  EXPECT_LE((result.global - (initial + u.delta)).abs().max().item<double>(), kTightBound);
}

// Clients whose local training diverges leave the round (nothing non-finite reaches the
// server); a run where all of them do stops after 10 tries of a round, saying so.
