// What CLI11 calls "arguments not expected", said as a user needs it: the unknown flag or
// command, and the nearest one there is ("--max-step: did you mean --max-steps?").
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace dtrain::cli {

/// The edit distance of `a` and `b` (insertions, deletions, substitutions and transpositions of
/// neighbours, each 1).
size_t edit_distance(const std::string& a, const std::string& b);

/// The names among `known` nearest to `unknown`: those it is a prefix of (when only one is),
/// else those within an edit distance of max(2, length / 4), the nearest first; at most 3.
std::vector<std::string> nearest_names(const std::string& unknown,
                                       const std::vector<std::string>& known);

/// After CLI11's ExtrasError on `app` (parsed): one line naming each unknown flag or command of
/// the subcommand that was given, and what was probably meant; "" when there is nothing to say
/// beyond CLI11's message.
std::string explain_unexpected(const CLI::App& app);

}  // namespace dtrain::cli
