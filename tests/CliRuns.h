// Running dtrain's command line from tests as a user does: real processes, their exit codes and
// output, and the parameters their newest checkpoint holds. A test target that includes this
// defines DTRAIN_CLI_PATH (the dtrain executable).
#pragma once

#include <ATen/ATen.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "dtrain/parallel/StateShards.h"
#include "dtrain/train/Checkpoint.h"

namespace dtrain::test::cli {

struct Output {
  int code = -1;
  std::string text;  // stdout + stderr
  double seconds = 0;
};

/// Runs `command` in a shell; its exit code (128 + the signal when killed) and output.
inline Output run(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  Output out;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  std::array<char, 4096> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe)) out.text += buffer.data();
  const int status = ::pclose(pipe);
  out.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

#ifdef DTRAIN_CLI_PATH
inline const std::string kDtrain = DTRAIN_CLI_PATH;
#endif

inline bool has(const Output& out, const std::string& needle) {
  return out.text.find(needle) != std::string::npos;
}

/// The parameters of the newest checkpoint under `root`, by name.
inline std::map<std::string, at::Tensor> final_parameters(const std::string& root) {
  const auto directory = dtrain::train::latest_checkpoint(root);
  if (!directory) return {};
  const auto meta = dtrain::train::read_meta(*directory);
  std::vector<dtrain::parallel::PieceRef> pieces;
  std::map<std::string, at::Tensor> values;
  for (const auto& info : meta.tensors) {
    if (info.buffer) continue;
    values[info.name] = at::zeros(info.shape);
    pieces.push_back({info.name, 0, values[info.name], info.shape});
  }
  dtrain::parallel::read_state_shards(*directory, pieces, nullptr, {}, nullptr);
  return values;
}

inline double max_difference(const std::map<std::string, at::Tensor>& a,
                             const std::map<std::string, at::Tensor>& b) {
  if (a.empty() || a.size() != b.size()) return INFINITY;
  double most = 0;
  for (const auto& [name, value] : a) {
    if (!b.count(name)) return INFINITY;
    most = std::max(most, (value - b.at(name)).abs().max().item<double>());
  }
  return most;
}

}  // namespace dtrain::test::cli
