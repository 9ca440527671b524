// Who may call a dtrain gRPC service, shared by the parameter server and federated learning:
// an optional shared token every call carries as "authorization: Bearer TOKEN" metadata
// (checked in constant time; a missing or wrong one is UNAUTHENTICATED), and optional TLS (the
// server's certificate and key; clients trust the CA file they are given).
#pragma once

#include <memory>
#include <string>

#include "dtrain/comm/TokenFile.h"

namespace grpc {
class ChannelArguments;
class Server;
class Service;
class ServerBuilder;
class ChannelCredentials;
class ClientContext;
class ServerContext;
class ServerCredentials;
class Status;
}  // namespace grpc

namespace dtrain::comm::rpc {

struct RpcSecurity {
  /// Shared token ("" = none); read from a file with read_token_file.
  std::string token;
  /// Server: PEM certificate chain and private key files (both or neither).
  std::string tls_cert, tls_key;
  /// Client: PEM file of the certificates to trust ("" with `tls` = the system's roots).
  std::string tls_ca;
  /// Client: connect with TLS.
  bool tls = false;
};

std::shared_ptr<grpc::ServerCredentials> server_credentials(const RpcSecurity& security);
std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const RpcSecurity& security);

/// OK when the call carries `token` (or no token is required), else UNAUTHENTICATED.
grpc::Status check_token(const grpc::ServerContext& context, const std::string& token);
/// Adds the token to an outgoing call (nothing when empty).
void add_token(grpc::ClientContext& context, const std::string& token);

/// HTTP/2 settings for streaming tensors (megabytes per stream rather than small calls):
/// large flow-control windows and frames, so a stream is not held back by window updates.
void tune_bulk_transfer(grpc::ChannelArguments& arguments);
void tune_bulk_transfer(grpc::ServerBuilder& builder);
/// Reconnect back-off of 100 ms growing to 1 s: a server that restarts or a network that heals
/// is found again within about a second (gRPC's default backs off up to 120 s, longer than the
/// clients' retry windows).
void reconnect_quickly(grpc::ChannelArguments& arguments);

/// Starts `service` on `listen` (HOST:PORT; port 0 picks one, written to *port) with the TLS
/// of `tls_cert`/`tls_key` (both or neither); `bulk`: messages up to a chunk and HTTP/2 tuned
/// for tensors. InputError naming `who` and the address when it cannot listen.
std::unique_ptr<grpc::Server> start_server(const std::string& who, const std::string& listen,
                                           const std::string& tls_cert, const std::string& tls_key,
                                           grpc::Service* service, bool bulk, int* port);
/// The server could not be reached, or went away during the call (CANCELLED: dtrain's clients
/// never cancel their own calls, so it is a server shutting down): it may be restarting.
bool server_went_away(const grpc::Status& status);

/// The address a process on this machine reaches a server listening on `listen` at `port`
/// by ("127.0.0.1:PORT" for a wildcard host).
std::string local_address(const std::string& listen, int port);

}  // namespace dtrain::comm::rpc
