// `--config FILE`: a TOML file of flags (keys are long flag names, at the top level or in a
// table named after the subcommand), expanded into the command line before parsing (CLI11 2.1
// ignores config files of subcommands).
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace dtrain::cli {

/// Replaces `--config FILE` after the subcommand `words` ({"train"}, {"fl", "simulate"}) by the
/// flags the TOML file sets, placed before the other command-line flags so that those win.
/// InputError naming the file and the key for a file that cannot be read, is not TOML, or names
/// an unknown flag of `command`.
std::vector<std::string> expand_config(const std::vector<std::string>& args, CLI::App& command,
                                       const std::vector<std::string>& words);
/// Every option of `command` with its value, as TOML that expand_config reads back to the same
/// values: the given ones as given, the others at their default where the option shows one
/// (those without one are left out: read back, they keep it). Keys of `derived` that were not
/// given are comments with the value shown (read back, they are derived again the same way, as
/// a model's recipe is); `skip`: keys left out. `given_only`: the given options alone.
std::string options_as_toml(const CLI::App& command,
                            const std::vector<std::pair<std::string, std::string>>& derived,
                            const std::vector<std::string>& skip, bool given_only = false);

/// Adds --config to `command` (for --help; expand_config reads it).
void add_config_option(CLI::App& command);

}  // namespace dtrain::cli
