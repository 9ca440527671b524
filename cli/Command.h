// One `dtrain` subcommand (or group of them): it registers its flags on the application, and
// main() runs the one that was given. A new subcommand is a new file pair and one line in
// main.cpp.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <vector>

namespace dtrain::cli {

/// The exit code of bad input: a flag, a value, a file (one line on stderr names it).
constexpr int kInputErrorExit = 2;

/// The command dtrain was started with, each word shell-quoted where it needs to be: what a
/// stopped run prints to resume it. Set once by main().
const std::string& command_line();
void set_command_line(int argc, char** argv);

class Command {
 public:
  virtual ~Command() = default;
  /// The arguments as this command wants them parsed (`train` expands `--config FILE`).
  virtual std::vector<std::string> expand(const std::vector<std::string>& args) { return args; }
  /// Whether it was given on the command line.
  virtual bool parsed() const = 0;
  /// Runs it; `args` are the parsed arguments, in order (without the program name). Returns
  /// the exit code.
  virtual int run(const std::vector<std::string>& args) = 0;
};

std::unique_ptr<Command> train_command(CLI::App& app);
std::unique_ptr<Command> launch_command(CLI::App& app);
std::unique_ptr<Command> checkpoint_command(CLI::App& app);
std::unique_ptr<Command> generate_command(CLI::App& app);
std::unique_ptr<Command> data_command(CLI::App& app);
std::unique_ptr<Command> plan_command(CLI::App& app);
std::unique_ptr<Command> status_command(CLI::App& app);
std::unique_ptr<Command> ps_command(CLI::App& app);
std::unique_ptr<Command> federated_command(CLI::App& app);

}  // namespace dtrain::cli
