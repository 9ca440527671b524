// Metrics as JSON Lines: one record per logged step or evaluation, and a summary at the end.
#pragma once

#include <fstream>
#include <map>
#include <string>
#include <variant>

namespace dtrain::train {

using MetricValue = std::variant<double, int64_t, std::string>;
using MetricRecord = std::map<std::string, MetricValue>;

class MetricsWriter {
 public:
  /// Empty path: records are dropped. Appends when `append` (a resumed run).
  MetricsWriter(const std::string& path, bool append);
  void write(const MetricRecord& record);
  bool enabled() const { return out_.is_open(); }

 private:
  std::ofstream out_;
};

/// One record as a JSON object line (no trailing newline).
std::string to_json_line(const MetricRecord& record);

}  // namespace dtrain::train
