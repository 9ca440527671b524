#include "dtrain/common/Printed.h"

#include <cstdarg>
#include <cstdio>
#include <vector>

namespace dtrain {

std::string printed(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::vector<char> buffer(static_cast<size_t>(n > 0 ? n : 0) + 1);
  std::vsnprintf(buffer.data(), buffer.size(), format, again);
  va_end(again);
  return std::string(buffer.data(), buffer.size() - 1);
}

}  // namespace dtrain
