// TensorBoard event files: what `--tensorboard DIR` writes next to metrics.jsonl, readable by
// TensorBoard itself (`tensorboard --logdir DIR`) and by its Python readers (EventAccumulator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::train {

/// One events file (DIR/events.out.tfevents.TIME.HOST.PID.N), made of TensorBoard's own protobuf
/// messages (proto/dtrain/tensorboard.proto: its field numbers) framed as TFRecords (length,
/// masked CRC-32C of the length, the record, its masked CRC-32C). Scalars are float64 tensors for
/// the scalars plugin, so a reader gets the value exactly (TensorBoard's float32 simple_value
/// would round it); text is a string tensor for the text plugin (Markdown). Every record is
/// flushed as written. InputError when DIR cannot be made or written, and in a build without
/// protobuf (DTRAIN_SERVICES=OFF).
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// One event at `step` holding every (tag, value) of `values` (a metrics record's numbers).
  void scalars(int64_t step, double wall_time,
               const std::vector<std::pair<std::string, double>>& values);
  void text(const std::string& tag, int64_t step, const std::string& markdown, double wall_time);
  /// The events file's path.
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// CRC-32C (Castagnoli), and the masked form TFRecord stores ((crc >>> 15) + 0xa282ead8).
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace dtrain::train
