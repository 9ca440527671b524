// `dtrain status RUNDIR`: where a run is (step, loss, ETA, ranks, last checkpoint), from its
// folder's files: for a run on a cluster whose terminal is not yours.
#include <cstdio>

#include "Command.h"
#include "dtrain/train/RunStatus.h"

namespace dtrain::cli {

namespace {

class StatusCommand final : public Command {
 public:
  explicit StatusCommand(CLI::App& app)
      : app_(app.add_subcommand(
            "status",
            "Where a run is (step, loss, ETA, ranks, last checkpoint), from its folder")) {
    app_->add_option("run-dir", run_dir_,
                     "The run's folder (dtrain train --run-dir DIR, or runs/MODEL-DATE-TIME), or "
                     "its metrics file")
        ->required();
    app_->add_flag("--json", json_, "One JSON object instead of lines for a terminal");
  }
  bool parsed() const override { return app_->parsed(); }
  int run(const std::vector<std::string>&) override {
    const auto status = dtrain::train::read_run_status(run_dir_);
    if (json_) {
      std::printf("%s\n", dtrain::train::to_json(status).c_str());
    } else {
      std::printf("%s", dtrain::train::describe(status).c_str());
    }
    return 0;
  }

 private:
  CLI::App* app_;
  std::string run_dir_;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> status_command(CLI::App& app) {
  return std::make_unique<StatusCommand>(app);
}

}  // namespace dtrain::cli
