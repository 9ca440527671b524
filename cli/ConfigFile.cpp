#include "ConfigFile.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "dtrain/common/Error.h"

namespace dtrain::cli {

void add_config_option(CLI::App& command) {
  // A flag given twice (config file, then command line) keeps the last value.
  for (CLI::Option* option : command.get_options()) {
    if (option->get_expected_max() == 1 && option->get_items_expected_max() == 1) {
      option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  // Handled by expand_config() before parsing (CLI11 2.1 ignores configs of subcommands).
  command.add_option("--config",
                     "Read options from a TOML file (keys are long flag names, at the top level or "
                     "in a table named after the command; flags on the command line win)");
}

std::vector<std::string> expand_config(const std::vector<std::string>& args, CLI::App& command,
                                       const std::vector<std::string>& words) {
  // The command's words in order ("fl", "simulate"), before any "--" (a program's arguments).
  const auto end = std::find(args.begin(), args.end(), "--");
  auto at = std::search(args.begin(), end, words.begin(), words.end());
  if (at == end) return args;
  at += static_cast<std::ptrdiff_t>(words.size()) - 1;
  std::vector<std::string> rest(at + 1, args.end());
  const auto rest_end = std::find(rest.begin(), rest.end(), "--") - rest.begin();
  std::string name;
  for (const std::string& word : words) name += (name.empty() ? "" : " ") + word;
  std::string path;
  for (size_t i = 0; i < static_cast<size_t>(rest_end); ++i) {
    if (rest[i] == "--config" && i + 1 < rest.size()) {
      path = rest[i + 1];
      rest.erase(rest.begin() + i, rest.begin() + i + 2);
      break;
    }
    if (rest[i].rfind("--config=", 0) == 0) {
      path = rest[i].substr(9);
      rest.erase(rest.begin() + i);
      break;
    }
  }
  if (path.empty()) return args;
  DTRAIN_CHECK_INPUT(
      std::filesystem::is_regular_file(path) && ::access(path.c_str(), R_OK) == 0, "config file ",
      path,
      std::filesystem::is_directory(path) ? " is a directory, not a TOML file" : " cannot be read");
  std::vector<CLI::ConfigItem> items;
  try {
    items = CLI::ConfigTOML().from_file(path);
  } catch (const std::exception& e) {
    DTRAIN_THROW(dtrain::InputError, "config file ", path, " is not valid TOML: ", e.what());
  }
  std::vector<std::string> injected;
  for (const auto& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    // Keys may stand at the top level or in a table named after the command ([train],
    // [simulate] or [fl.simulate]).
    std::string key = item.parents.empty() ? item.name : item.fullname();
    if (item.parents == words ||
        (item.parents.size() == 1 && item.parents.front() == words.back())) {
      key = item.name;
    }
    const CLI::Option* option = command.get_option_no_throw("--" + key);
    DTRAIN_CHECK_INPUT(option != nullptr && key != "config", "config file ", path,
                       ": unknown key '", key, "' (keys are `dtrain ", name, "` flag names)");
    if (option->get_expected_max() == 0) {  // a flag: key = true / false
      const std::string value = item.inputs.empty() ? "true" : item.inputs.front();
      DTRAIN_CHECK_INPUT(value == "true" || value == "false", "config file ", path, ": key '", key,
                         "' takes true or false, got '", value, "'");
      if (value == "true") injected.push_back("--" + key);
      continue;
    }
    injected.push_back("--" + key);
    injected.insert(injected.end(), item.inputs.begin(), item.inputs.end());
  }
  std::vector<std::string> out(args.begin(), at + 1);
  out.insert(out.end(), injected.begin(), injected.end());
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

namespace {

/// A TOML value: a number or true/false as it is, anything else as a basic string.
std::string toml_string(const std::string& text) {
  if (text == "true" || text == "false") return text;
  char* end = nullptr;
  std::strtod(text.c_str(), &end);
  if (!text.empty() && end == text.c_str() + text.size() &&
      text.find_first_of("xXnN") == std::string::npos && text.front() != '.' &&
      text.front() != '+') {
    return text;
  }
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

/// A default as an option shows it ("[256,256]", "256 256", "5"): its items.
std::vector<std::string> default_items(const std::string& text) {
  std::vector<std::string> items;
  std::string item;
  for (char c : text + " ") {
    if (c == ' ' || c == ',' || c == '[' || c == ']') {
      if (!item.empty()) items.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  return items;
}

}  // namespace

std::string options_as_toml(const CLI::App& command,
                            const std::vector<std::pair<std::string, std::string>>& derived,
                            const std::vector<std::string>& skip, bool given_only) {
  std::string out;
  for (const CLI::Option* option : command.get_options()) {
    const auto& names = option->get_lnames();
    if (names.empty()) continue;  // positional
    const std::string& key = names.front();
    if (key == "help" || key == "help-all" || key == "config" ||
        std::find(skip.begin(), skip.end(), key) != skip.end()) {
      continue;
    }
    const bool given = option->count() > 0;
    if (given_only && !given) continue;
    const auto found = std::find_if(derived.begin(), derived.end(),
                                    [&](const auto& entry) { return entry.first == key; });
    if (!given && found != derived.end()) {
      out += "# " + key + "=" + toml_string(found->second) + "\n";
      continue;
    }
    if (option->get_expected_max() == 0) {  // a flag: given or not (a negated one too)
      out += key + "=" + (given ? "true" : "false") + "\n";
      continue;
    }
    std::vector<std::string> items =
        given ? option->results() : default_items(option->get_default_str());
    if (items.empty()) continue;  // no value shown: it keeps its default when read back
    const bool list = option->get_expected_max() > 1 || option->get_items_expected_max() > 1;
    if (!list) {
      out += key + "=" + toml_string(items.back()) + "\n";
      continue;
    }
    std::string joined;
    for (const auto& item : items) joined += (joined.empty() ? "" : ", ") + toml_string(item);
    out += key + "=[" + joined + "]\n";
  }
  return out;
}

}  // namespace dtrain::cli
