// JSONL metrics output.
#include "dtrain/train/Metrics.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>

#include "dtrain/common/Error.h"

namespace dtrain::train {

MetricsWriter::MetricsWriter(const std::string& path, bool append) {
  if (path.empty()) return;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ignored;
    std::filesystem::create_directories(parent, ignored);
  }
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  DTRAIN_CHECK_INPUT(out_.is_open(), "metrics file ", path, " cannot be opened for writing");
}

std::string to_json_line(const MetricRecord& record) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& [key, value] : record) {
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double>) {
            json[key] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
          } else {
            json[key] = v;
          }
        },
        value);
  }
  return json.dump();
}

void MetricsWriter::write(const MetricRecord& record) {
  if (!out_.is_open()) return;
  out_ << to_json_line(record) << '\n';
  out_.flush();
}

}  // namespace dtrain::train
