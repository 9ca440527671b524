// Metrics as JSON Lines: one record per logged step or evaluation, and a summary at the end.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <variant>

namespace dtrain::train {

using MetricValue = std::variant<double, int64_t, std::string>;
using MetricRecord = std::map<std::string, MetricValue>;

class TensorBoardWriter;

class MetricsWriter {
 public:
  /// Empty path: records are dropped. Appends when `append` (a resumed run). With
  /// `tensorboard_dir`, every record's numbers go to a TensorBoard events file there too
  /// (tensorboard_tag names them), at the record's step (a record without one: the last step
  /// written) and time.
  MetricsWriter(const std::string& path, bool append, const std::string& tensorboard_dir = "");
  void write(const MetricRecord& record);
  /// Markdown for TensorBoard's text plugin at the last step (the run's configuration); nothing
  /// without a TensorBoard folder.
  void text(const std::string& tag, const std::string& markdown);
  bool enabled() const { return out_.is_open(); }

 private:
  std::ofstream out_;
  std::shared_ptr<TensorBoardWriter> tensorboard_;
  int64_t last_step_ = 0;
};

/// The TensorBoard tag of a metrics record's field: "<event>/<key>", the per-step records'
/// event "step" named "train" ("train/loss", "eval/val_loss", "checkpoint/seconds"); "" for the
/// fields that are not a scalar of their own (event, step, time).
std::string tensorboard_tag(const std::string& event, const std::string& key);

/// One record as a JSON object line (no trailing newline).
std::string to_json_line(const MetricRecord& record);

}  // namespace dtrain::train
