// JSONL metrics output.
#include "dtrain/train/Metrics.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <utility>
#include <vector>

#include "dtrain/common/Error.h"
#include "dtrain/train/TensorBoard.h"

namespace dtrain::train {

MetricsWriter::MetricsWriter(const std::string& path, bool append,
                             const std::string& tensorboard_dir) {
  if (!tensorboard_dir.empty()) tensorboard_ = std::make_shared<TensorBoardWriter>(tensorboard_dir);
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

std::string tensorboard_tag(const std::string& event, const std::string& key) {
  if (key == "event" || key == "step" || key == "time") return "";
  return (event == "step" ? std::string("train") : event) + "/" + key;
}

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

void MetricsWriter::write(const MetricRecord& record) {
  if (tensorboard_) {
    const auto number = [](const MetricValue& value) {
      return std::holds_alternative<double>(value) ? std::get<double>(value)
                                                   : static_cast<double>(std::get<int64_t>(value));
    };
    const auto field = [&](const char* key) { return record.find(key); };
    if (field("step") != record.end() &&
        !std::holds_alternative<std::string>(field("step")->second)) {
      last_step_ = static_cast<int64_t>(number(field("step")->second));
    }
    const double wall =
        field("time") != record.end() && std::holds_alternative<double>(field("time")->second)
            ? std::get<double>(field("time")->second)
            : now_seconds();
    const auto event = field("event");
    const std::string kind =
        event != record.end() && std::holds_alternative<std::string>(event->second)
            ? std::get<std::string>(event->second)
            : std::string("metrics");
    std::vector<std::pair<std::string, double>> values;
    for (const auto& [key, value] : record) {
      if (std::holds_alternative<std::string>(value)) continue;
      const std::string tag = tensorboard_tag(kind, key);
      if (!tag.empty()) values.emplace_back(tag, number(value));
    }
    tensorboard_->scalars(last_step_, wall, values);  // one event (and one write) a record
  }
  if (!out_.is_open()) return;
  out_ << to_json_line(record) << '\n';
  out_.flush();
}

void MetricsWriter::text(const std::string& tag, const std::string& markdown) {
  if (tensorboard_) tensorboard_->text(tag, last_step_, markdown, now_seconds());
}

}  // namespace dtrain::train
