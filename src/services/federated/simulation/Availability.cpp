// A device's availability (`dtrain fl client --available`): local-time windows like
// 22:00-06:00, comma-separated, or always.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/services/federated/service/Client.h"

namespace dtrain::services::federated {

namespace {

// [start, end) minutes after midnight; end <= start crosses midnight.
struct Window {
  int start = 0, end = 0;
  bool contains(int minute) const {
    return start < end ? minute >= start && minute < end : minute >= start || minute < end;
  }
};

int parse_time(const std::string& text, const std::string& whole) {
  int hours = -1, minutes = -1;
  char extra = 0;
  const int got = std::sscanf(text.c_str(), "%d:%d%c", &hours, &minutes, &extra);
  DTRAIN_CHECK_INPUT(
      got == 2 && text.size() == 5 && hours >= 0 && hours < 24 && minutes >= 0 && minutes < 60,
      "--available '", whole, "': '", text, "' is not a time HH:MM (00:00 to 23:59)");
  return hours * 60 + minutes;
}

std::vector<Window> parse_windows(const std::string& text) {
  std::vector<Window> windows;
  if (text == "always") return windows;
  std::stringstream parts(text);
  std::string part;
  while (std::getline(parts, part, ',')) {
    const auto dash = part.find('-');
    DTRAIN_CHECK_INPUT(dash != std::string::npos, "--available '", text, "': '", part,
                       "' is not a window HH:MM-HH:MM");
    Window w{parse_time(part.substr(0, dash), text), parse_time(part.substr(dash + 1), text)};
    DTRAIN_CHECK_INPUT(w.start != w.end, "--available '", text, "': '", part, "' is empty");
    windows.push_back(w);
  }
  DTRAIN_CHECK_INPUT(!windows.empty(), "--available '", text,
                     "': expected always or windows like 22:00-06:00");
  return windows;
}

bool in_windows(const std::vector<Window>& windows, int minute) {
  if (windows.empty()) return true;
  return std::any_of(windows.begin(), windows.end(),
                     [&](const Window& w) { return w.contains(minute); });
}

}  // namespace

std::function<bool()> parse_availability(const std::string& text) {
  const std::vector<Window> windows = parse_windows(text);
  if (windows.empty()) return nullptr;
  return [windows] {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    return in_windows(windows, local.tm_hour * 60 + local.tm_min);
  };
}

bool available_at(const std::string& text, int minute_of_day) {
  return in_windows(parse_windows(text), minute_of_day);
}

}  // namespace dtrain::services::federated
