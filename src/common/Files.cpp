// Atomic file writes (temporary name + rename).
#include "common/Files.h"

#include <filesystem>
#include <fstream>

#include "dtrain/common/Error.h"

namespace dtrain {

void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    DTRAIN_CHECK_INPUT(out.good(), "cannot write ", temporary);
    write(out);
    out.flush();
    DTRAIN_CHECK_INPUT(out.good(), "writing ", temporary, " failed (disk full?)");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  DTRAIN_CHECK_INPUT(!error, "cannot rename ", temporary, " to ", path, ": ", error.message());
}

void write_file_atomically(const std::string& path, const char* data, size_t size) {
  write_file_atomically(
      path, [&](std::ostream& out) { out.write(data, static_cast<std::streamsize>(size)); });
}

}  // namespace dtrain
