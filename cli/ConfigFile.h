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
/// Adds --config to `command` (for --help; expand_config reads it).
void add_config_option(CLI::App& command);

}  // namespace dtrain::cli
