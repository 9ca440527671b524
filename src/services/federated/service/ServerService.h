// The federated server's service, shared by its three parts: the gRPC handlers clients call
// (ServerHandlers.cpp: CheckIn, Download, Upload, and who may call), the round loop
// (ServerRounds.cpp: waiting for clients, selecting, closing, evaluating, checkpoints) and the
// secure-aggregation phases (ServerSecure.cpp: the SecAgg handler and the protocol's steps).
// The network-free round logic is RoundServer's; this is the service around it. Private to
// src/services/federated.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "dtrain/federated.grpc.pb.h"
#include "dtrain/services/federated/RoundServer.h"
#include "dtrain/services/federated/service/Server.h"
#include "services/federated/RoundLog.h"
#include "services/federated/secagg/SecureServerRound.h"

namespace dtrain::services::federated {

using Clock = std::chrono::steady_clock;

inline grpc::Status invalid(const std::string& why) {
  return {grpc::StatusCode::INVALID_ARGUMENT, why};
}

/// The longest a CheckIn or SecAgg call waits for news before it answers.
constexpr int64_t kMaxWaitMs = 30000;
/// Refusals kept for the result (the rest are counted).
constexpr size_t kRefusalsKept = 20;

class Server::Service final : public dtrain::fl::Federated::Service {
 public:
  Service(at::Tensor initial, ServerOptions options, Evaluate evaluate);
  ~Service() override;

  int port() const { return port_; }
  int64_t round() const { return rounds_.round(); }
  const ServerOptions& options() const { return o_; }
  void stop();

  // The handlers (ServerHandlers.cpp, SecAgg in ServerSecure.cpp).
  grpc::Status CheckIn(grpc::ServerContext* context, const dtrain::fl::CheckInRequest* request,
                       dtrain::fl::CheckInReply* reply) override;
  grpc::Status Download(grpc::ServerContext* context, const dtrain::fl::DownloadRequest* request,
                        grpc::ServerWriter<dtrain::fl::ModelChunk>* writer) override;
  grpc::Status Upload(grpc::ServerContext* context,
                      grpc::ServerReader<dtrain::fl::UpdateChunk>* reader,
                      dtrain::fl::UploadReply* reply) override;
  grpc::Status SecAgg(grpc::ServerContext* context, const dtrain::fl::SecAggRequest* request,
                      dtrain::fl::SecAggReply* reply) override;

  /// The rounds (ServerRounds.cpp), or the buffered steps (ServerBuffered.cpp).
  ServerResult run();

 private:
  void run_rounds(ServerResult& result, RoundLog& log, int64_t min_clients);
  // The reply that sends a client to train (both modes): the plan, the model's shape, the
  // seed, the deadline.
  void fill_train(const std::string& id, int64_t round, Clock::time_point deadline,
                  dtrain::fl::CheckInReply* reply);
  // Buffered aggregation (ServerBuffered.cpp): a check-in that may start a client, the steps,
  // and a client's flight ended (its model version dropped when nobody trains from it).
  void check_in_buffered(const std::string& id, int64_t wait_ms, std::unique_lock<std::mutex>& lock,
                         dtrain::fl::CheckInReply* reply);
  void run_buffered(ServerResult& result, RoundLog& log);
  void end_flight(const std::string& id);
  // Secure aggregation (ServerSecure.cpp).
  grpc::Status too_late(const std::string& id, const char* what);
  void start_secure(const std::vector<std::string>& chosen);
  void run_secure(std::unique_lock<std::mutex>& lock, RoundRecord* record);
  // Who may call, and refusals (ServerHandlers.cpp).
  grpc::Status authorize(const grpc::ServerContext& context, const std::string& id) const;
  grpc::Status check_open(const std::string& id, int64_t round);
  grpc::Status refuse(const std::string& id, const std::string& why);
  grpc::Status refuse_locked(const std::string& id, const std::string& why);

  const ServerOptions o_;
  const Evaluate evaluate_;
  RoundServer rounds_;
  const int64_t numel_;
  const at::ScalarType dtype_;
  std::string checkpoint_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, int> waiting_;  // client -> CheckIn calls waiting now
  std::set<std::string> known_, told_done_;
  std::map<std::string, int64_t> examples_;  // client -> examples at its last check-in
  std::unique_ptr<SecureServerRound> secure_;
  uint64_t secure_generation_ = 0;  // one per secure round attempt
  // The shares of their chosen clients that the last secure rounds lost before the masked
  // inputs (--secagg-graph auto sizes the next round for the largest, or --secagg-dropout).
  std::deque<double> dropouts_seen_;
  std::string auto_said_;  // what the server last said of auto's sizing
  bool open_ = false, done_ = false, stopping_ = false;
  int64_t open_round_ = 0;
  std::set<std::string> selected_, finished_;
  at::Tensor round_model_;
  at::Tensor round_control_;  // SCAFFOLD's c for the open round (undefined: none)
  Clock::time_point deadline_;
  int64_t uplink_ = 0, downlink_ = 0;
  int64_t refused_ = 0, late_ = 0;
  std::vector<std::string> refusals_;
  // Clients' reports of running out of time: the lines, and round -> the most seconds a
  // client said the plan needs.
  std::vector<std::string> out_of_time_;
  std::map<int64_t, double> needed_s_;
  // Buffered aggregation: who trains from which model version until when, and those versions.
  struct Flight {
    int64_t version = 0;
    Clock::time_point deadline;
  };
  std::map<std::string, Flight> flights_;
  std::map<int64_t, at::Tensor> versions_;
  int64_t expired_ = 0;
};

}  // namespace dtrain::services::federated
