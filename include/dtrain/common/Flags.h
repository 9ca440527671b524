// Flags: command-line flags declared where their options live, without a command-line library.
// A strategy (or any options struct) says which flags set which of its fields; the CLI turns
// the declarations into its parser's options, and a config file's keys are the same names. So
// a flag is declared once, beside the field it sets.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace dtrain {

struct Flag {
  /// "--n-fetch"; a negated boolean is declared by the flag that clears it ("--no-backup-tasks").
  std::string name;
  std::string help;
  std::variant<bool*, int*, int64_t*, double*, std::string*, std::vector<std::string>*> target;
  /// bool: the flag sets false.
  bool negated = false;
  /// A list: its items separated by this character in one value (0 = one item per value).
  char delimiter = 0;
  /// --help shows the field's value as the default.
  bool show_default = true;
};

/// An ordered list of flag declarations; binding holds pointers to the fields, which must
/// outlive the parse.
class FlagSet {
 public:
  template <typename T>
  Flag& add(std::string name, T& field, std::string help) {
    flags_.push_back(Flag{std::move(name), std::move(help), &field});
    return flags_.back();
  }
  /// A boolean flag that sets `field` to false ("--no-x").
  Flag& add_negated(std::string name, bool& field, std::string help) {
    Flag& flag = add(std::move(name), field, std::move(help));
    flag.negated = true;
    flag.show_default = false;
    return flag;
  }
  /// A list given as one comma-separated value.
  Flag& add_list(std::string name, std::vector<std::string>& field, std::string help) {
    Flag& flag = add(std::move(name), field, std::move(help));
    flag.delimiter = ',';
    flag.show_default = false;
    return flag;
  }
  const std::vector<Flag>& flags() const { return flags_; }

 private:
  std::vector<Flag> flags_;
};

/// `text` as a finite number, all of it (false for "", "1x", "nan", "inf").
inline bool parse_finite_number(const std::string& text, double* out) {
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return !text.empty() && *end == '\0' && std::isfinite(*out);
}

}  // namespace dtrain
