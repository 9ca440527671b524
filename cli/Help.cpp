// Short, grouped --help (Help.h).
#include "Help.h"

#include <map>

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

class ShortHelp : public CLI::Formatter {
 public:
  ShortHelp() { column_width(kNameColumn); }
  std::string make_help(const CLI::App* app, std::string name,
                        CLI::AppFormatMode mode) const override {
    all_ = mode == CLI::AppFormatMode::All;
    return CLI::Formatter::make_help(app, std::move(name), mode);
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
}

}  // namespace dtrain::cli
