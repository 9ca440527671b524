// Formats dtrain::Error messages with their source location.
#include "dtrain/common/Error.h"

#include <cstring>

namespace dtrain {

namespace {
const char* basename_of(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(const std::string& message, const char* file, int line)
    : std::runtime_error(concat(message, " (", basename_of(file), ":", line, ")")),
      message_(message) {}

}  // namespace dtrain
