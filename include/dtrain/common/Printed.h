// printf into a std::string: the summaries the library writes for the CLI to print.
#pragma once

#include <string>

namespace dtrain {

/// `format` filled in as std::printf would print it.
std::string printed(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace dtrain
