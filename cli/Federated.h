// `dtrain fl ...`: federated learning's subcommands (argument parsing only).
#pragma once

#include <CLI/CLI.hpp>

#include <memory>

namespace dtrain::cli {

class FederatedCommands {
 public:
  /// Adds `fl` and its subcommands to `app`.
  explicit FederatedCommands(CLI::App& app);
  ~FederatedCommands();
  /// Whether one of them was given.
  bool parsed() const;
  /// Runs the one given; the exit code.
  int run();

 private:
  int simulate();
  int serve();
  int client();
  struct Options;
  std::unique_ptr<Options> options_;
};

}  // namespace dtrain::cli
