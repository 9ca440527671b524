// Writing a file so that readers see the old content or the new, never a part: written to
// PATH.tmp, then renamed over PATH.
#pragma once

#include <cstddef>
#include <string>

namespace dtrain {

/// InputError naming the file when it cannot be written (disk full, no permission).
void write_file_atomically(const std::string& path, const char* data, size_t size);

}  // namespace dtrain
