// TensorBoard's events files from its own protobuf messages, framed as TFRecords.
#include "dtrain/train/TensorBoard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dtrain/common/Error.h"

#ifdef DTRAIN_SERVICES
#include "dtrain/tensorboard.pb.h"
#endif

namespace dtrain::train {

namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ bytes[i]) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

struct TensorBoardWriter::Impl {
  std::string path;
  std::ofstream out;

  // One TFRecord: little-endian length, its masked CRC, the bytes, their masked CRC.
  void record(const std::string& bytes) {
    unsigned char header[12];
    const uint64_t length = bytes.size();
    for (int i = 0; i < 8; ++i) header[i] = static_cast<unsigned char>(length >> (8 * i));
    const uint32_t length_crc = masked_crc32c(header, 8);
    const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
    for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<unsigned char>(length_crc >> (8 * i));
    unsigned char footer[4];
    for (int i = 0; i < 4; ++i) footer[i] = static_cast<unsigned char>(data_crc >> (8 * i));
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.write(reinterpret_cast<const char*>(footer), sizeof(footer));
    out.flush();
    DTRAIN_CHECK_INPUT(out.good(), "TensorBoard events file ", path, ": cannot write (",
                       std::strerror(errno), ")");
  }
};

#ifdef DTRAIN_SERVICES

namespace {

namespace tb = dtrain::comm::tensorboard;

std::string serialized(const tb::Event& event) {
  std::string bytes;
  event.SerializeToString(&bytes);
  return bytes;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  DTRAIN_CHECK_INPUT(!error, "--tensorboard ", dir, ": cannot create it (", error.message(), ")");
  static std::atomic<int> files{0};
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  impl_->path = concat(dir, "/events.out.tfevents.",
                       std::chrono::duration_cast<std::chrono::seconds>(now).count(), ".", host,
                       ".", ::getpid(), ".", files++);
  impl_->out.open(impl_->path, std::ios::binary | std::ios::trunc);
  DTRAIN_CHECK_INPUT(impl_->out.is_open(), "--tensorboard ", dir, ": cannot write ", impl_->path,
                     " (", std::strerror(errno), ")");
  tb::Event first;
  first.set_wall_time(std::chrono::duration<double>(now).count());
  first.set_file_version("brain.Event:2");
  impl_->record(serialized(first));
}

TensorBoardWriter::~TensorBoardWriter() = default;

namespace {

// A summary value of `event` for `plugin`: its tensor (a scalar: no dimensions), to be filled.
tb::TensorProto* summary_tensor(tb::Event& event, const std::string& tag, const char* plugin,
                                tb::DataClass data_class, tb::DataType dtype) {
  tb::Summary::Value* summary = event.mutable_summary()->add_value();
  summary->set_tag(tag);
  summary->mutable_metadata()->mutable_plugin_data()->set_plugin_name(plugin);
  summary->mutable_metadata()->set_data_class(data_class);
  tb::TensorProto* tensor = summary->mutable_tensor();
  tensor->set_dtype(dtype);
  tensor->mutable_tensor_shape();
  return tensor;
}

}  // namespace

void TensorBoardWriter::scalars(int64_t step, double wall_time,
                                const std::vector<std::pair<std::string, double>>& values) {
  if (values.empty()) return;
  tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  for (const auto& [tag, value] : values) {
    summary_tensor(event, tag, "scalars", tb::DATA_CLASS_SCALAR, tb::DT_DOUBLE)
        ->add_double_val(value);
  }
  impl_->record(serialized(event));
}

void TensorBoardWriter::text(const std::string& tag, int64_t step, const std::string& markdown,
                             double wall_time) {
  tb::Event event;
  event.set_wall_time(wall_time);
  event.set_step(step);
  summary_tensor(event, tag, "text", tb::DATA_CLASS_TENSOR, tb::DT_STRING)
      ->add_string_val(markdown);
  impl_->record(serialized(event));
}

#else

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  DTRAIN_THROW(InputError, "--tensorboard ", dir,
               ": this build has no protobuf (built with DTRAIN_SERVICES=OFF)");
}
TensorBoardWriter::~TensorBoardWriter() = default;
void TensorBoardWriter::scalars(int64_t, double,
                                const std::vector<std::pair<std::string, double>>&) {}
void TensorBoardWriter::text(const std::string&, int64_t, const std::string&, double) {}

#endif

const std::string& TensorBoardWriter::path() const { return impl_->path; }

}  // namespace dtrain::train
