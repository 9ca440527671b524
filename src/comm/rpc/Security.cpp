#include "comm/rpc/Security.h"

#include "comm/rpc/TensorMessage.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <sodium.h>

#include <fstream>
#include <iterator>

#include "dtrain/common/Error.h"

namespace dtrain::comm::rpc {

namespace {

constexpr char kHeader[] = "authorization";
constexpr char kScheme[] = "Bearer ";

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read the ", what, " ", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Both sides hashed to 32 bytes first, so the comparison takes the same time whatever the
// lengths and contents.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char ha[32], hb[32];
  crypto_generichash(ha, sizeof ha, reinterpret_cast<const unsigned char*>(a.data()), a.size(),
                     nullptr, 0);
  crypto_generichash(hb, sizeof hb, reinterpret_cast<const unsigned char*>(b.data()), b.size(),
                     nullptr, 0);
  return sodium_memcmp(ha, hb, sizeof ha) == 0;
}

}  // namespace

std::string read_token_file(const std::string& path) {
  std::string token = read_file(path, "token file");
  const auto first = token.find_first_not_of(" \t\r\n");
  const auto last = token.find_last_not_of(" \t\r\n");
  DTRAIN_CHECK_INPUT(first != std::string::npos, "the token file ", path, " is empty");
  token = token.substr(first, last - first + 1);
  DTRAIN_CHECK_INPUT(token.find_first_of("\r\n") == std::string::npos, "the token file ", path,
                     " holds more than one line");
  return token;
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const RpcSecurity& security) {
  DTRAIN_CHECK_INPUT(security.tls_cert.empty() == security.tls_key.empty(),
                     "TLS needs both --tls-cert and --tls-key");
  if (security.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back(
      {read_file(security.tls_key, "TLS key"), read_file(security.tls_cert, "TLS certificate")});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const RpcSecurity& security) {
  if (!security.tls && security.tls_ca.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  if (!security.tls_ca.empty()) options.pem_root_certs = read_file(security.tls_ca, "TLS CA file");
  return grpc::SslCredentials(options);
}

grpc::Status check_token(const grpc::ServerContext& context, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  DTRAIN_CHECK(sodium_init() >= 0, "libsodium failed to initialize");
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find(kHeader);
  if (found == metadata.end()) {
    return {grpc::StatusCode::UNAUTHENTICATED, "the call carries no token (--auth-token-file)"};
  }
  const std::string value(found->second.data(), found->second.size());
  const std::string scheme = kScheme;
  const std::string given = value.rfind(scheme, 0) == 0 ? value.substr(scheme.size()) : value;
  if (!same_secret(given, token)) {
    return {grpc::StatusCode::UNAUTHENTICATED, "the call's token is wrong"};
  }
  return grpc::Status::OK;
}

void add_token(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata(kHeader, std::string(kScheme) + token);
}

namespace {
constexpr int kLookahead = 64 << 20;
constexpr int kFrame = (16 << 20) - 1;  // HTTP/2's largest
constexpr int kWriteBuffer = 8 << 20;
}  // namespace

void tune_bulk_transfer(grpc::ChannelArguments& arguments) {
  arguments.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookahead);
  arguments.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kFrame);
  arguments.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, kWriteBuffer);
}

void reconnect_quickly(grpc::ChannelArguments& arguments) {
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
}

void tune_bulk_transfer(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookahead);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kFrame);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, kWriteBuffer);
}

}  // namespace dtrain::comm::rpc

namespace dtrain::comm::rpc {

std::unique_ptr<grpc::Server> start_server(const std::string& who, const std::string& listen,
                                           const std::string& tls_cert, const std::string& tls_key,
                                           grpc::Service* service, bool bulk, int* port) {
  RpcSecurity security;
  security.tls_cert = tls_cert;
  security.tls_key = tls_key;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, server_credentials(security), port);
  if (bulk) {
    builder.SetMaxReceiveMessageSize(static_cast<int>(kMaxChunkBytes + (1 << 20)));
    tune_bulk_transfer(builder);
  }
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  DTRAIN_CHECK_INPUT(server && *port > 0, who, " cannot listen on ", listen,
                     " (address in use or not this machine's?)");
  return server;
}

bool server_went_away(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::CANCELLED;
}

std::string local_address(const std::string& listen, int port) {
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = "127.0.0.1";
  return concat(host, ":", port);
}

}  // namespace dtrain::comm::rpc
