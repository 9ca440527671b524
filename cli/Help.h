// --help as a user reads it: each flag's first sentence, wrapped to 100 columns, in groups
// (model, data, ...); --help-all gives every flag's whole text. The details are in the guides.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::cli {

/// A description's first sentence: up to the first ". " or "; " outside parentheses (not after
/// "e.g", "i.e", "et al", "vs").
std::string first_sentence(const std::string& text);

/// `text` broken into lines of at most `width` characters at spaces.
std::string wrapped(const std::string& text, size_t width);

/// The formatter main() gives the application (its subcommands inherit it), and --help-all.
void use_short_help(CLI::App& app);

/// Puts each option named in `groups` ("--model", ...) into its group, in the groups' order in
/// --help; the others stay in "Options".
void group_options(CLI::App& app,
                   const std::vector<std::pair<std::string, std::vector<std::string>>>& groups);

}  // namespace dtrain::cli
