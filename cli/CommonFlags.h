// Flags that mean the same thing in `dtrain train`, `dtrain fl ...` and `dtrain plan`, declared
// once here or, for the data sets' and models' own, by the registries (bound here):
// each command binds them to its own fields and says what they are for in its help. (Two
// names differ in meaning between the commands and keep their names, as flags do: --dropout
// is the GPT's dropout in train, a client's chance to drop out in fl; --lr-decay is train's
// schedule, fl's per-round factor of the local rate.)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "NumericOptions.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/models/Zoo.h"

namespace dtrain::cli {

/// --dataset (a name of the data-set registry), then the flags of the sets `keep` admits, as
/// the sets declare them (data::DatasetInfo::flags), bound to `source`; `amend` may add to
/// their help what they mean in this command.
inline void add_data_flags(CLI::App& app, std::string& dataset, data::DataSource& source,
                           const std::string& datasets,
                           const std::function<bool(const data::DatasetInfo&)>& keep,
                           const std::function<void(FlagSet&)>& amend = nullptr) {
  add(app, "--dataset", dataset, "Data set: " + datasets)->capture_default_str();
  FlagSet flags;
  data::declare_data_flags(flags, source, keep);
  if (amend) amend(flags);
  add_flags(app, flags);
}

/// --model (a name of the model registry), then the hyper-parameters' flags of the models
/// `keep` admits, as the models declare them (models::ModelInfo::flags: the MLP's --hidden, the
/// decoder's shape), bound to `spec`; `amend` as above.
inline void add_model_flags(CLI::App& app, models::ModelSpec& spec, const std::string& models,
                            const std::function<bool(const models::ModelInfo&)>& keep,
                            const std::function<void(FlagSet&)>& amend = nullptr) {
  add(app, "--model", spec.name, "Model: " + models)->capture_default_str();
  FlagSet flags;
  models::declare_model_flags(flags, spec, keep);
  if (amend) amend(flags);
  add_flags(app, flags);
}

/// Appends `note` to the help of `flags`' flag `name` (when declared: a build may leave its
/// data set out).
inline void add_to_help(FlagSet& flags, const std::string& name, const std::string& note) {
  if (Flag* flag = flags.find(name)) flag->help += note;
}

/// --lr, --momentum, --weight-decay of an optimizer (`whose`: "" for the trainer's, "Local"
/// for a federated client's SGD).
inline void add_sgd_flags(CLI::App& app, double& lr, double& momentum, double& weight_decay,
                          const std::string& whose) {
  const std::string prefix = whose.empty() ? "" : whose + " ";
  add(app, "--lr", lr, whose.empty() ? "Learning rate" : prefix + "learning rate")
      ->capture_default_str();
  add(app, "--momentum", momentum, prefix + "SGD momentum")->capture_default_str();
  add(app, "--weight-decay", weight_decay, prefix + "L2 weight decay")->capture_default_str();
}

/// --seed.
inline void add_seed_flag(CLI::App& app, uint64_t& seed, const std::string& what) {
  add(app, "--seed", seed, "Random seed (" + what + ")")->capture_default_str();
}

/// --threads.
inline void add_threads_flag(CLI::App& app, int& threads, const std::string& default_is) {
  add(app, "--threads", threads, "LibTorch threads per process (default: " + default_is + ")");
}

/// --checkpoint-dir, --eval-every (in the command's `unit`s) and --no-progress.
inline void add_run_flags(CLI::App& app, std::string& checkpoint_dir, int64_t& eval_every,
                          bool& progress, const std::string& checkpoints, const std::string& unit) {
  add(app, "--checkpoint-dir", checkpoint_dir, checkpoints);
  add(app, "--eval-every", eval_every, "Also evaluate every N " + unit)->capture_default_str();
  app.add_flag("!--no-progress", progress, "No progress bar");
}

}  // namespace dtrain::cli
