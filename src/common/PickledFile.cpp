#include "common/PickledFile.h"

#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "common/Files.h"
#include "dtrain/common/Error.h"

namespace dtrain {

void save_pickled_dict(const std::string& path, const c10::impl::GenericDict& dict) {
  const std::vector<char> bytes = torch::pickle_save(dict);
  const auto directory = std::filesystem::path(path).parent_path();
  if (!directory.empty()) std::filesystem::create_directories(directory);
  write_file_atomically(path, bytes.data(), bytes.size());
}

c10::impl::GenericDict load_pickled_dict(const std::string& path, const std::string& what,
                                         const std::string& format) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read the ", what, " ", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, path, " is not a ", what, " (damaged?): ", e.what_without_backtrace());
  }
  DTRAIN_CHECK_INPUT(value.isGenericDict(), path, " is not a ", what);
  c10::impl::GenericDict dict = value.toGenericDict();
  DTRAIN_CHECK_INPUT(format.empty() || (dict.contains("format") && dict.at("format").isString() &&
                                        dict.at("format").toStringRef() == format),
                     path, " is not a ", what);
  return dict;
}

}  // namespace dtrain
