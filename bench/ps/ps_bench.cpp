// Parameter-server throughput: one client pulls and pushes the whole flat vector of an
// N-parameter model (default 25M, 100 MB of float32) against S shards (default 2) over
// loopback gRPC, against the raw loopback TCP throughput of this machine measured in the same
// run (one sender and one receiver thread over 127.0.0.1, the physical limit here). The two
// alternate (A B A B ...); medians over --rounds; one JSON line per measurement and a summary.
// The shards run in processes of their own (`dtrain ps serve`) unless --in-process.
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "BenchMemory.h"
#include "dtrain/common/Net.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/parallel/ps/PsClient.h"
#include "dtrain/services/ps/ShardServer.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;
using bench::median;

namespace {

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Bytes per second from one thread writing `total` bytes into a loopback TCP connection to
// another thread reading them (1 MB writes, as gRPC's chunks).
double loopback_bytes_per_s(int64_t total) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  ::listen(listener, 1);
  socklen_t length = sizeof(address);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  const int sender = ::socket(AF_INET, SOCK_STREAM, 0);
  ::connect(sender, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int receiver = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  std::vector<char> out(1 << 20, 'x');
  const auto start = Clock::now();
  std::thread reader([&] {
    std::vector<char> in(1 << 20);
    int64_t got = 0;
    while (got < total) {
      const ssize_t n = ::read(receiver, in.data(), in.size());
      if (n <= 0) break;
      got += n;
    }
  });
  int64_t sent = 0;
  while (sent < total) {
    const ssize_t n = ::write(sender, out.data(), std::min<int64_t>(out.size(), total - sent));
    if (n <= 0) break;
    sent += n;
  }
  reader.join();
  const double seconds = seconds_since(start);
  ::close(sender);
  ::close(receiver);
  return total / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain parameter-server throughput against loopback TCP"};
  int64_t params = 25'000'000;
  int shards = 2, rounds = 5;
  double chunk_mb = 1;
  bool in_process = false;
  std::string dtrain_path = "dtrain";
  app.add_option("--params", params, "Model parameters (float32)")->capture_default_str();
  app.add_option("--shards", shards, "Parameter-server shards")->capture_default_str();
  app.add_option("--rounds", rounds, "Pull + push rounds (each next to a loopback measurement)")
      ->capture_default_str();
  app.add_option("--chunk-mb", chunk_mb, "Streamed chunk size, MB (at most 3)")
      ->capture_default_str();
  app.add_flag("--in-process", in_process, "Shards in this process (default: dtrain ps serve)");
  app.add_option("--dtrain", dtrain_path, "The dtrain executable (for ps serve)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  launch::tune_allocator();  // as the workers (run_job) and dtrain ps serve do

  std::vector<std::unique_ptr<services::ps::ShardServer>> servers;
  std::vector<pid_t> children;
  std::vector<std::string> addresses;
  for (int i = 0; i < shards; ++i) {
    if (in_process) {
      services::ps::ShardServerOptions options;
      options.shard = i;
      options.shards = shards;
      options.optimizer.name = "sgd";
      servers.push_back(std::make_unique<services::ps::ShardServer>(options));
      addresses.push_back(servers.back()->address());
      continue;
    }
    const int port = free_port();
    const std::string listen = "127.0.0.1:" + std::to_string(port);
    const std::string shard = std::to_string(i) + "/" + std::to_string(shards);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::freopen("/dev/null", "w", stdout);
      ::execlp(dtrain_path.c_str(), dtrain_path.c_str(), "ps", "serve", "--listen", listen.c_str(),
               "--shard", shard.c_str(), "--optimizer", "sgd", static_cast<char*>(nullptr));
      std::perror("exec dtrain ps serve");
      ::_exit(127);
    }
    children.push_back(pid);
    addresses.push_back(listen);
  }
  parallel::ps::PsClientOptions options;
  options.chunk_bytes = static_cast<int64_t>(chunk_mb * (1 << 20));
  parallel::ps::PsClient client(addresses, options);
  at::Tensor values = at::randn({params});
  at::Tensor gradient = at::zeros({params});  // SGD with a zero gradient: the values stay
  client.initialize(values);
  const int64_t bytes = params * 4;
  std::vector<int64_t> versions = client.pull(values);  // warm the connections
  client.push(gradient, versions);
  std::vector<double> ps_rates, pull_rates, push_rates, loop_rates;
  for (int r = 0; r < rounds; ++r) {
    const bool ps_first = r % 2 == 0;
    for (int side = 0; side < 2; ++side) {
      if ((side == 0) == ps_first) {
        auto start = Clock::now();
        versions = client.pull(values);
        const double pull_s = seconds_since(start);
        start = Clock::now();
        client.push(gradient, versions);
        const double push_s = seconds_since(start);
        ps_rates.push_back(2.0 * bytes / (pull_s + push_s));
        pull_rates.push_back(bytes / pull_s);
        push_rates.push_back(bytes / push_s);
        std::printf(
            "{\"round\":%d,\"side\":\"ps\",\"pull_gb_s\":%.3f,\"push_gb_s\":%.3f,"
            "\"pull_push_gb_s\":%.3f}\n",
            r, bytes / pull_s / 1e9, bytes / push_s / 1e9, ps_rates.back() / 1e9);
      } else {
        loop_rates.push_back(loopback_bytes_per_s(2 * bytes));
        std::printf("{\"round\":%d,\"side\":\"loopback\",\"gb_s\":%.3f}\n", r,
                    loop_rates.back() / 1e9);
      }
      std::fflush(stdout);
    }
  }
  std::vector<double> ratios;
  for (size_t i = 0; i < ps_rates.size(); ++i) ratios.push_back(ps_rates[i] / loop_rates[i]);
  std::printf(
      "{\"summary\":true,\"params\":%lld,\"shards\":%d,\"rounds\":%d,\"chunk_mb\":%g,"
      "\"in_process\":%s,\"pull_gb_s\":%.3f,\"push_gb_s\":%.3f,\"pull_push_gb_s\":%.3f,"
      "\"loopback_gb_s\":%.3f,\"ratio_median\":%.3f}\n",
      static_cast<long long>(params), shards, rounds, chunk_mb, in_process ? "true" : "false",
      median(pull_rates) / 1e9, median(push_rates) / 1e9, median(ps_rates) / 1e9,
      median(loop_rates) / 1e9, median(ratios));
  for (const pid_t pid : children) {
    ::kill(pid, SIGTERM);
    ::waitpid(pid, nullptr, 0);
  }
  return 0;
}
