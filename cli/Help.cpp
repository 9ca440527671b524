// Short, grouped --help (Help.h).
#include "Help.h"

#include <algorithm>
#include <map>
#include <sstream>

namespace dtrain::cli {

std::string first_sentence(const std::string& text) {
  int depth = 0;
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    const char c = text[i];
    if (c == '(' || c == '[') ++depth;
    if ((c == ')' || c == ']') && depth > 0) --depth;
    if (depth != 0 || (c != '.' && c != ';') || text[i + 1] != ' ') continue;
    bool abbreviation = false;
    for (const char* a : {"e.g", "i.e", "et al", "vs", "etc"}) {
      const std::string word(a);
      abbreviation = abbreviation ||
                     (i >= word.size() && text.compare(i - word.size(), word.size(), word) == 0);
    }
    if (!abbreviation) return text.substr(0, i);
  }
  return text;
}

std::string wrapped(const std::string& text, size_t width) {
  std::string out;
  size_t line = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(start, end - start);
    if (line > 0 && line + 1 + word.size() > width) {
      out += '\n';
      line = 0;
    } else if (line > 0) {
      out += ' ';
      ++line;
    }
    out += word;
    line += word.size();
    start = end + 1;
  }
  return out;
}

namespace {

constexpr size_t kColumns = 100;
constexpr size_t kNameColumn = 30;

using Groups = std::vector<std::pair<std::string, std::vector<std::string>>>;

// The groups group_options() gave each application, in their --help order.
std::map<const CLI::App*, Groups>& help_orders() {
  static std::map<const CLI::App*, Groups> orders;
  return orders;
}

// Where an option goes in its group's list (its first long name found; unlisted: last).
size_t rank_in(const std::vector<std::string>& flags, const CLI::Option* option) {
  for (const std::string& name : option->get_lnames()) {
    const auto it = std::find(flags.begin(), flags.end(), "--" + name);
    if (it != flags.end()) return static_cast<size_t>(it - flags.begin());
  }
  return flags.size();
}

class ShortHelp : public CLI::Formatter {
 public:
  ShortHelp() { column_width(kNameColumn); }
  std::string make_help(const CLI::App* app, std::string name,
                        CLI::AppFormatMode mode) const override {
    all_ = mode == CLI::AppFormatMode::All;
    const auto order = help_orders().find(app);
    if (mode == CLI::AppFormatMode::Sub || order == help_orders().end()) {
      return CLI::Formatter::make_help(app, std::move(name), mode);
    }
    // CLI11's own layout, its groups in the order given (CLI11 orders them, and the options in
    // each, as they were added).
    std::stringstream out;
    out << make_description(app) << make_usage(app, std::move(name)) << make_positionals(app)
        << ordered_groups(app, order->second) << make_subcommands(app, mode) << '\n'
        << make_footer(app);
    return out.str();
  }
  std::string make_option_desc(const CLI::Option* option) const override {
    const std::string& text = option->get_description();
    return wrapped(all_ ? text : first_sentence(text), kColumns - kNameColumn);
  }
  std::string make_footer(const CLI::App* app) const override {
    std::string footer = CLI::Formatter::make_footer(app);
    if (!all_ && app->get_parent() != nullptr && app->get_options().size() > 12) {
      footer +=
          "\nEach flag's first sentence; --help-all gives all of it, docs/guide the details.\n";
    }
    return footer;
  }

 private:
  std::string ordered_groups(const CLI::App* app, const Groups& groups) const {
    std::vector<std::pair<std::string, std::vector<std::string>>> order{{"Options", {}}};
    order.insert(order.end(), groups.begin(), groups.end());
    for (const std::string& group : app->get_groups()) {  // any group not named: after
      if (std::none_of(order.begin(), order.end(), [&](const auto& g) { return g.first == group; }))
        order.push_back({group, {}});
    }
    std::string out;
    for (const auto& [group, flags] : order) {
      std::vector<const CLI::Option*> options = app->get_options(
          [&](const CLI::Option* o) { return o->get_group() == group && o->nonpositional(); });
      if (options.empty()) continue;
      std::stable_sort(options.begin(), options.end(),
                       [&](const CLI::Option* a, const CLI::Option* b) {
                         return rank_in(flags, a) < rank_in(flags, b);
                       });
      out += make_group(group, false, options);
    }
    return out;
  }
  mutable bool all_ = false;
};

}  // namespace

void use_short_help(CLI::App& app) {
  app.formatter(std::make_shared<ShortHelp>());
  app.set_help_all_flag("--help-all", "Print every flag's whole description and exit");
}

void group_options(CLI::App& app,
                   const std::vector<std::pair<std::string, std::vector<std::string>>>& groups) {
  std::map<std::string, std::string> group_of;
  for (const auto& [group, flags] : groups) {
    for (const std::string& flag : flags) group_of[flag] = group;
  }
  for (CLI::Option* option : app.get_options()) {
    for (const std::string& name : option->get_lnames()) {
      const auto found = group_of.find("--" + name);
      if (found != group_of.end()) option->group(found->second);
    }
  }
  help_orders()[&app] = groups;
}

}  // namespace dtrain::cli
