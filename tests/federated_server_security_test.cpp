// The federated server's defences over gRPC (in process, on 127.0.0.1): secure aggregation with
// dropouts and retries, TLS, per-client token files, fuzzed uploads refused without changing
// anything.
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

TEST(FederatedServer, SecureAggregationOverGrpcSumsTheUpdatesAndSurvivesADropout) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 61);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> clients = {
      {"a", range(0, 20)}, {"b", range(20, 50)}, {"c", range(50, 90)}, {"d", range(90, 120)}};
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(2, 4);
  options.round.secure_aggregation = true;
  Server server(initial, options);
  ServerResult result;
  run_clients(server, train, clients, &result);
  ASSERT_EQ(result.rounds_done, 2);
  const at::Tensor global = fedavg_reference(initial, train, clients, options.round.local, 2);
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

// --secagg-graph auto over gRPC: the first round is sized for --secagg-dropout (0 here: the log
// degree, 4 of 6), and the next ones for the dropouts the server saw (1 of 6 each round: with a
// threshold of 0.3 no sparse graph of 6 is reliable enough, so the full one); the degree is in
// each round's record.
TEST(FederatedServer, SecAggPlusAutoSizesTheNextRoundsForTheDropoutsItSaw) {
  at::set_num_threads(1);
  const auto train = synthetic64(120, 64);
  std::vector<std::pair<std::string, std::vector<int64_t>>> clients;
  for (int i = 0; i < 6; ++i)
    clients.push_back({std::string(1, 'a' + i), range(i * 20, i * 20 + 20)});
  ServerOptions options = server_options(3, 6);
  options.round.secure_aggregation = true;
  options.secagg_graph = secagg::kAutoGraph;
  options.secagg_dropout = 0.0;
  options.secagg_threshold = 0.3;
  options.round_timeout_s = 2.5;
  options.secagg_step_timeout_s = 5;
  Server server(flatten_parameters(model64(0)), options);
  std::atomic<int> asked{0};
  ServerResult result;
  run_clients(server, train, clients, &result, [&](ClientOptions& o) {
    if (o.client_id != "f") return;
    o.available = [&] { return ++asked % 2 == 1; };  // check-ins yes, training no
  });
  ASSERT_EQ(result.rounds_done, 3);
  ASSERT_EQ(result.rounds.size(), 3u);
  EXPECT_EQ(result.rounds[0].secagg_degree, secagg::default_degree(6));
  EXPECT_EQ(secagg::default_degree(6), 4);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(result.rounds[r].outcome.applied) << r;
    EXPECT_EQ(result.rounds[r].outcome.dropped, 1) << r;
    if (r > 0) {
      EXPECT_EQ(result.rounds[r].secagg_degree, secagg::auto_degree(6, 0.3, 1.0 / 6)) << r;
      EXPECT_EQ(result.rounds[r].secagg_degree, 0) << r;
    }
  }
}

// A masked upload whose stream began while its client was selected but ends after the secure
// round was retried without it (the first attempt aborted: nobody sent keys) is refused by
// name, and the retried round sums its own clients' inputs only.
TEST(FederatedServer, AMaskedUploadFromBeforeARetryIsRefusedAndTheRetrySumsItsOwnClients) {
  at::set_num_threads(1);
  const auto train = synthetic64(60, 62);
  const at::Tensor initial = flatten_parameters(model64(0));
  ServerOptions options = server_options(1, 2);
  options.round.secure_aggregation = true;
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
  comm::EncodedUpdate masked;
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
    const ClientUpdate u = train_locally(model, initial, train, indices, options.round.local, 0);
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
        t->set_dtype(static_cast<dtrain::comm::rpc::DType>(random() % 10));
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
      train_locally(model, initial, train, range(0, 40), server_options(1, 1).round.local, 0);
  EXPECT_LE((result.global - (initial + u.delta)).abs().max().item<double>(), kTightBound);
}
