// Did-you-mean for unknown flags and commands (Suggest.h).
#include "Suggest.h"

#include <algorithm>
#include <numeric>

namespace dtrain::cli {

size_t edit_distance(const std::string& a, const std::string& b) {
  // Optimal string alignment over three rows.
  std::vector<size_t> before(b.size() + 1), previous(b.size() + 1), current(b.size() + 1);
  std::iota(previous.begin(), previous.end(), 0);
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        current[j] = std::min(current[j], before[j - 2] + 1);
      }
    }
    before.swap(previous);
    previous.swap(current);
  }
  return previous[b.size()];
}

std::vector<std::string> nearest_names(const std::string& unknown,
                                       const std::vector<std::string>& known) {
  std::vector<std::string> prefixed;
  for (const std::string& name : known) {
    if (name.size() > unknown.size() && name.compare(0, unknown.size(), unknown) == 0) {
      prefixed.push_back(name);
    }
  }
  if (prefixed.size() == 1) return prefixed;
  const size_t limit = std::max<size_t>(2, unknown.size() / 4);
  std::vector<std::pair<size_t, std::string>> near;
  for (const std::string& name : known) {
    const size_t d = edit_distance(unknown, name);
    if (d <= limit) near.emplace_back(d, name);
  }
  std::sort(near.begin(), near.end());
  std::vector<std::string> out;
  for (const auto& [d, name] : near) {
    if (out.size() == 3 || d > near.front().first) break;
    out.push_back(name);
  }
  return out;
}

namespace {

const CLI::App* deepest_parsed(const CLI::App& app) {
  const CLI::App* deepest = &app;
  for (;;) {
    const auto subcommands = deepest->get_subcommands();
    if (subcommands.empty()) return deepest;
    deepest = subcommands.front();
  }
}

// "fl simulate" (the root's own name left out: "" for the root).
std::string path_of(const CLI::App* app) {
  std::string path;
  for (const CLI::App* a = app; a != nullptr && a->get_parent() != nullptr; a = a->get_parent()) {
    path = a->get_name() + (path.empty() ? "" : " " + path);
  }
  return path;
}

std::string joined_or(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  return out;
}

}  // namespace

std::string explain_unexpected(const CLI::App& app) {
  const CLI::App* given = deepest_parsed(app);
  std::vector<std::string> extras;
  for (const CLI::App* a = given; a != nullptr; a = a->get_parent()) {
    const auto remaining = a->remaining();
    extras.insert(extras.begin(), remaining.begin(), remaining.end());
  }
  std::vector<std::string> flags, commands;
  for (const CLI::Option* option : given->get_options()) {
    for (const std::string& name : option->get_lnames()) flags.push_back("--" + name);
  }
  for (const CLI::App* sub : given->get_subcommands({})) commands.push_back(sub->get_name());
  std::vector<std::string> said;
  bool after_unknown_flag = false;
  for (const std::string& extra : extras) {
    const bool flag = extra.size() > 1 && extra[0] == '-';
    if (!flag && after_unknown_flag) {  // the unknown flag's value
      after_unknown_flag = false;
      continue;
    }
    after_unknown_flag = flag;
    // --name=value: the name.
    const std::string name = flag ? extra.substr(0, extra.find('=')) : extra;
    const auto near = nearest_names(name, flag ? flags : commands);
    if (flag) {
      said.push_back("unknown flag " + name +
                     (near.empty() ? "" : " (did you mean " + joined_or(near) + "?)"));
    } else if (!commands.empty()) {
      said.push_back("unknown command " + name +
                     (near.empty() ? " (one of: " + joined_or(commands) + ")"
                                   : " (did you mean " + joined_or(near) + "?)"));
      break;  // what follows is that command's
    } else {
      said.push_back("unexpected argument " + name);
    }
  }
  if (said.empty()) return "";
  const std::string path = path_of(given);
  std::string out = path.empty() ? "" : path + ": ";
  for (size_t i = 0; i < said.size(); ++i) out += (i == 0 ? "" : "; ") + said[i];
  return out + " (see dtrain " + (path.empty() ? "" : path + " ") + "--help)";
}

}  // namespace dtrain::cli
