// What the gRPC federated tests share: a server and clients in one process on 127.0.0.1 (the
// float64 MLP, full-batch local training), clients run in threads, and FedAvg computed in one
// process for the rounds to equal.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "FederatedTesting.h"
#include "dtrain/services/federated/FedAvg.h"
#include "dtrain/services/federated/service/Client.h"
#include "dtrain/services/federated/service/Server.h"

namespace dtrain::services::federated::testing {

// The client's model: the test's float64 MLP, whatever the server names.
inline Client::ModelFactory test_model() {
  return [](const std::string&, const std::vector<int64_t>&) { return model64(0); };
}

inline ServerOptions server_options(int64_t rounds, int64_t k) {
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.rounds = rounds;
  o.round.clients_per_round = k;
  o.round.local.epochs = 1;
  o.round.local.batch = 0;  // full batch: the order of examples does not matter
  o.round.local.lr = 0.1;
  o.round_timeout_s = 30;
  o.wait_timeout_s = 30;
  o.progress = false;
  return o;
}

inline ClientOptions client_options(const Server& server, const std::string& id) {
  ClientOptions o;
  o.server = server.address();
  o.client_id = id;
  o.wait = std::chrono::milliseconds(500);
  o.retry_window = std::chrono::milliseconds(5000);
  return o;
}

// Runs `clients` (each its id, examples and options tweak) against `server` in threads.
inline std::vector<ClientReport> run_clients(
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
inline at::Tensor fedavg_reference(
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

}  // namespace dtrain::services::federated::testing
