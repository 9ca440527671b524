// The one error type and check-macro family of dtrain: every failure a user can cause or meet
// (bad flag, corrupt file, dead peer, timed-out collective) surfaces as dtrain::Error with the
// file and line that detected it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

/// Base exception for all errors raised by dtrain. `what()` is "message (file:line)".
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line);
  /// The message without the source location.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

/// A collective or point-to-point operation failed or timed out.
class CommError : public Error {
 public:
  using Error::Error;
};

/// A collective did not finish within its timeout.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

/// Bad user input: flag, config value, data file, checkpoint.
class InputError : public Error {
 public:
  using Error::Error;
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& out, const T& first, const Rest&... rest) {
  out << first;
  append_all(out, rest...);
}
}  // namespace detail

/// Concatenates all arguments with operator<< into one string.
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  detail::append_all(out, args...);
  return out.str();
}

/// The first line of `text` (c10 errors append backtraces and context on further lines).
inline std::string first_line(const std::string& text) {
  const auto end = text.find('\n');
  return end == std::string::npos ? text : text.substr(0, end);
}

/// `text` safe to print on one line: control bytes and bytes past ASCII (raw bytes of a damaged
/// file, quoted by a parser) as `\xNN`, so that an error line shows them instead of the terminal
/// acting on them.
inline std::string printable(const std::string& text) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7F) {
      out += c;
    } else {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
    }
  }
  return out;
}

/// A JSON parser's error (nlohmann's what()) as an error line ends: without the library's tag
/// ("[json.exception.parse_error.101] "), the bytes it quotes printable().
inline std::string json_error_text(const std::string& what) {
  std::string text = what;
  if (text.rfind("[json.exception.", 0) == 0) {
    const auto end = text.find("] ");
    if (end != std::string::npos) text = text.substr(end + 2);
  }
  return printable(text);
}

}  // namespace dtrain

/// Throws ErrorType(message) with file:line when `cond` is false.
#define DTRAIN_CHECK_T(ErrorType, cond, ...)                              \
  do {                                                                    \
    if (!(cond)) {                                                        \
      throw ErrorType(::dtrain::concat(__VA_ARGS__), __FILE__, __LINE__); \
    }                                                                     \
  } while (false)

#define DTRAIN_CHECK(cond, ...) DTRAIN_CHECK_T(::dtrain::Error, cond, __VA_ARGS__)
#define DTRAIN_CHECK_INPUT(cond, ...) DTRAIN_CHECK_T(::dtrain::InputError, cond, __VA_ARGS__)
#define DTRAIN_CHECK_EQ(a, b, ...) \
  DTRAIN_CHECK((a) == (b), "expected ", #a, " == ", #b, " (", (a), " vs ", (b), "): ", __VA_ARGS__)
#define DTRAIN_THROW(ErrorType, ...) \
  throw ErrorType(::dtrain::concat(__VA_ARGS__), __FILE__, __LINE__)
