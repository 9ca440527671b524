// Option helpers shared by the dtrain command's files: numeric options checked strictly.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"

namespace dtrain::cli {

// CLI11 2.1 converts numbers leniently: out-of-range integers are clamped, "-1" wraps into an
// unsigned, "inf" and "1e999" pass as floats. Every numeric option is checked by this instead:
// the whole text must be a number of the option's type, in its range, and finite.
template <typename T>
inline std::string check_number(const std::string& text) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  if (text.empty()) return "expects a number, got an empty value";
  if constexpr (std::is_floating_point_v<T>) {
    const double value = std::strtod(begin, &end);
    if (end == begin || *end != '\0') return "expects a number, got '" + text + "'";
    if (errno == ERANGE && std::abs(value) > 1) return "'" + text + "' is out of range";
    if (!std::isfinite(value)) return "expects a finite number, got '" + text + "'";
  } else {
    const bool negative = text.find('-') != std::string::npos;
    if (std::is_unsigned_v<T> && negative) {
      return "expects a whole number >= 0, got '" + text + "'";
    }
    const long long value = std::strtoll(begin, &end, 10);
    if (end == begin || *end != '\0') return "expects a whole number, got '" + text + "'";
    const bool fits =
        errno != ERANGE && value >= static_cast<long long>(std::numeric_limits<T>::min()) &&
        (std::is_unsigned_v<T> || value <= static_cast<long long>(std::numeric_limits<T>::max()));
    if (!fits) {
      return dtrain::concat("'", text, "' is out of range (", +std::numeric_limits<T>::min(),
                            " .. ", +std::numeric_limits<T>::max(), ")");
    }
  }
  return "";
}

template <typename T>
struct element_of {
  using type = T;
};
template <typename T>
struct element_of<std::vector<T>> {
  using type = T;
};

// app.add_option, with check_number for numeric values (and vectors of them).
template <typename T>
CLI::Option* add(CLI::App& app, const std::string& name, T& value, const std::string& description) {
  CLI::Option* option = app.add_option(name, value, description);
  using Element = typename element_of<T>::type;
  if constexpr (std::is_arithmetic_v<Element> && !std::is_same_v<Element, bool>) {
    option->check(
        CLI::Validator([](std::string& text) { return check_number<Element>(text); }, ""));
  }
  return option;
}

// Flags declared where their options live (a strategy's, dtrain/common/Flags.h) as CLI11 options.
inline void add_flags(CLI::App& app, const FlagSet& flags) {
  for (const Flag& flag : flags.flags()) {
    CLI::Option* option = std::visit(
        [&](auto* field) -> CLI::Option* {
          using T = std::remove_pointer_t<decltype(field)>;
          if constexpr (std::is_same_v<T, bool>) {
            return app.add_flag((flag.negated ? "!" : "") + flag.name, *field, flag.help);
          } else {
            return add(app, flag.name, *field, flag.help);
          }
        },
        flag.target);
    if (std::holds_alternative<std::vector<int64_t>*>(flag.target)) {
      option->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);  // --hidden 256 256
    }
    if (flag.delimiter != 0) option->delimiter(flag.delimiter);
    if (flag.show_default) option->capture_default_str();
  }
}

}  // namespace dtrain::cli
