// Flags: command-line flags declared where their options live, without a command-line library.
// A strategy (or any options struct) says which flags set which of its fields; the CLI turns
// the declarations into its parser's options, and a config file's keys are the same names. So
// a flag is declared once, beside the field it sets.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace dtrain {

struct Flag {
  /// "--n-fetch"; a negated boolean is declared by the flag that clears it ("--no-backup-tasks").
  std::string name;
  std::string help;
  std::variant<bool*, int*, int64_t*, double*, std::string*, std::vector<std::string>*,
               std::vector<int64_t>*>
      target;
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
  /// The flag of that name (nullptr: none), e.g. for a command to add to its help.
  Flag* find(const std::string& name) {
    for (Flag& flag : flags_) {
      if (flag.name == name) return &flag;
    }
    return nullptr;
  }

 private:
  std::vector<Flag> flags_;
};

/// Flags that set fields of a T (a data source, a model's description) under a name: the
/// registry entries that read them list the group (every image set lists "images"), and a
/// command declares each group once, however many entries list it.
template <typename T>
struct FlagGroup {
  std::string name;
  void (*declare)(FlagSet& flags, T& options) = nullptr;
};

/// Declares into `flags`, bound to `options`, the groups that the `entries` for which `keep`
/// holds list in their `flags` member, in the entries' order, each group once.
template <typename T, typename Entries, typename Keep>
void declare_flag_groups(FlagSet& flags, T& options, const Entries& entries, Keep keep) {
  std::set<std::string> declared;
  for (const auto& entry : entries) {
    if (!keep(entry)) continue;
    for (const FlagGroup<T>& group : entry.flags) {
      if (declared.insert(group.name).second) group.declare(flags, options);
    }
  }
}

/// `text` as a finite number, all of it (false for "", "1x", "nan", "inf").
inline bool parse_finite_number(const std::string& text, double* out) {
  char* end = nullptr;
  *out = std::strtod(text.c_str(), &end);
  return !text.empty() && *end == '\0' && std::isfinite(*out);
}

}  // namespace dtrain
