// `dtrain fl`: the group of the federated subcommands, each a file of its own
// (FlSimulateCommand.cpp, FlServeCommand.cpp, FlClientCommand.cpp; the flags they share in
// FederatedShared.cpp).
#include <algorithm>

#include "Command.h"
#include "ConfigFile.h"
#include "FederatedShared.h"

namespace dtrain::cli {

namespace {

class FederatedCommands final : public Command {
 public:
  explicit FederatedCommands(CLI::App& app) {
    auto* fl = app.add_subcommand("fl", "Federated learning (FedAvg and its relatives)");
    fl->require_subcommand(1);
    subcommands_.push_back(fl::simulate_command(fl));
    subcommands_.push_back(fl::serve_command(fl));
    subcommands_.push_back(fl::client_command(fl));
    for (CLI::App* sub : fl->get_subcommands({})) {
      add_config_option(*sub);
      apps_.push_back(sub);
    }
  }
  std::vector<std::string> expand(const std::vector<std::string>& args) override {
    std::vector<std::string> out = args;
    for (CLI::App* sub : apps_) out = expand_config(out, *sub, {"fl", sub->get_name()});
    return out;
  }
  bool parsed() const override {
    return std::any_of(subcommands_.begin(), subcommands_.end(),
                       [](const auto& command) { return command->parsed(); });
  }
  int run(const std::vector<std::string>& args) override {
    for (const auto& command : subcommands_) {
      if (command->parsed()) return command->run(args);
    }
    return kInputErrorExit;  // CLI11 requires one subcommand: not reached
  }

 private:
  std::vector<std::unique_ptr<Command>> subcommands_;
  std::vector<CLI::App*> apps_;
};

}  // namespace

std::unique_ptr<Command> federated_command(CLI::App& app) {
  return std::make_unique<FederatedCommands>(app);
}

}  // namespace dtrain::cli
