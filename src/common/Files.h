// Writing a file so that readers see the old content or the new, never a part: written to
// PATH.tmp, then renamed over PATH.
#pragma once

#include <cstddef>
#include <functional>
#include <ostream>
#include <string>

namespace dtrain {

/// InputError naming the file when it cannot be written (disk full, no permission).
void write_file_atomically(const std::string& path, const char* data, size_t size);
/// The same for content that `write` streams into the file (a checkpoint's tensors one by one,
/// never all of it in memory at once).
void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write);

}  // namespace dtrain
