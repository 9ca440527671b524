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

/// Starts `command` (its output to a file) in the background, waits for its metrics file to
/// hold a step (an event; at most 120 s), then sends `signal` ("INT", "TERM", ...) to it, or,
/// with `rank` >= 0, to its child process of that RANK (a launcher's rank); with `again`, a
/// second one once the launcher said it asked the ranks to stop. Its output and exit code.
inline Output run_and_signal(const std::string& command, const std::string& metrics,
                             const std::string& signal, bool again = false, int rank = -1) {
  const std::string log = metrics + ".out";
  const std::string wait_for_step = "i=0; until grep -q '\"event\":\"step\"' " + metrics +
                                    " 2>/dev/null; do sleep 0.05; i=$((i+1)); "
                                    "[ $i -gt 2400 ] && break; done\n";
  std::string script = command + " > " + log + " 2>&1 & pid=$!\n" + wait_for_step;
  if (rank < 0) {
    script += "kill -" + signal + " $pid\n";
  } else {
    script +=
        "for p in $(pgrep -P $pid); do if tr '\\0' '\\n' < /proc/$p/environ | grep -qx "
        "'RANK=" +
        std::to_string(rank) + "'; then kill -" + signal + " $p; fi; done\n";
  }
  if (again) {
    script += "i=0; until grep -q 'stopping on request' " + log +
              "; do sleep 0.05; i=$((i+1)); [ $i -gt 2400 ] && break; done\nkill -" + signal +
              " $pid\n";
  }
  script += "wait $pid; code=$?; cat " + log + "; exit $code\n";
  const std::string file = metrics + ".sh";
  std::FILE* out = std::fopen(file.c_str(), "w");
  std::fputs(script.c_str(), out);
  std::fclose(out);
  return run("sh " + file);
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
