// Checkpoint metadata, the `latest` pointer, and directory housekeeping.
#include "dtrain/train/Checkpoint.h"

#include <unistd.h>

#include <caffe2/serialize/crc_alt.h>
#include <torch/nn/module.h>
#include <torch/serialize.h>
#include <torch/serialize/output-archive.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <tuple>

#include "common/Files.h"
#include "dtrain/common/Error.h"
#include "dtrain/parallel/StateShards.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

void write_atomically(const std::string& path, const std::string& content) {
  write_file_atomically(path, content.data(), content.size());
}

constexpr const char* kMetaChecksumKey = "meta_crc32";

// CRC-32 (zlib's, as LibTorch's own serialization computes it: no zlib needed).
uint32_t crc_of(const std::string& text) { return crc32_fast(text.data(), text.size()); }

}  // namespace

FileDigest digest_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK_INPUT(in.good(), "cannot read ", path);
  FileDigest digest;
  uint32_t crc = 0;
  std::vector<char> chunk(1 << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const std::streamsize got = in.gcount();
    if (got <= 0) break;
    crc = crc32_fast(chunk.data(), static_cast<size_t>(got), crc);
    digest.bytes += got;
  }
  DTRAIN_CHECK_INPUT(in.eof(), "reading ", path, " failed");
  digest.crc32 = crc;
  return digest;
}

void record_files(const std::string& directory, CheckpointMeta& meta) {
  meta.files.clear();
  // Every file, those in folders too (a strategy's own, such as DiLoCo's islands').
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    const std::string name = fs::relative(entry.path(), directory).string();
    if (!entry.is_regular_file() || name == "meta.json") continue;
    meta.files[name] = digest_file(entry.path().string());
  }
}

std::string verify_checkpoint(const std::string& directory, bool* unverifiable) {
  if (unverifiable) *unverifiable = false;
  CheckpointMeta meta;
  try {
    meta = read_meta(directory);
  } catch (const InputError& e) {
    return e.message();
  }
  if (meta.files.empty()) {
    if (unverifiable) *unverifiable = true;
    return "";
  }
  for (const auto& [name, want] : meta.files) {
    const std::string path = directory + "/" + name;
    if (!fs::is_regular_file(path)) return concat(path, " is missing");
    const FileDigest got = digest_file(path);
    if (got.bytes != want.bytes) {
      return concat(path, " is damaged: ", got.bytes, " bytes, meta.json recorded ", want.bytes);
    }
    if (got.crc32 != want.crc32) {
      return concat(path, " is damaged: its checksum (CRC-32 ", got.crc32,
                    ") differs from the one meta.json recorded (", want.crc32, ")");
    }
  }
  return "";
}

std::string checkpoint_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
  return name;
}

void write_meta(const std::string& directory, const CheckpointMeta& meta) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : meta.tensors) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"dtype", t.dtype},
                       {"kind", t.buffer ? "buffer" : "parameter"}});
  }
  nlohmann::json json = {
      {"format_version", meta.format_version},
      {"strategy", meta.strategy},
      {"world_size", meta.world_size},
      {"layout", {{"dp", meta.dp}, {"pp", meta.pp}, {"tp", meta.tp}}},
      {"step", meta.step},
      {"epoch", meta.epoch},
      {"seed", meta.seed},
      {"global_batch", meta.global_batch},
      {"tensors", tensors},
  };
  if (meta.ep > 1) json["layout"]["ep"] = meta.ep;
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [name, digest] : meta.files) {
    files[name] = {{"bytes", digest.bytes}, {"crc32", digest.crc32}};
  }
  json["files"] = files;
  if (!meta.extras.empty()) json["extras"] = meta.extras;
  json[kMetaChecksumKey] = crc_of(json.dump());
  write_atomically(directory + "/meta.json", json.dump(2) + "\n");
}

CheckpointMeta read_meta(const std::string& directory) {
  const std::string path = directory + "/meta.json";
  std::ifstream in(path);
  DTRAIN_CHECK_INPUT(in.good(), "checkpoint metadata ", path, " is missing");
  nlohmann::json json;
  try {
    in >> json;
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_THROW(InputError, "checkpoint metadata ", path,
                 " is not valid JSON: ", json_error_text(e.what()));
  }
  CheckpointMeta meta;
  try {
    if (json.is_object() && json.contains(kMetaChecksumKey)) {
      const auto recorded = json.at(kMetaChecksumKey).get<uint32_t>();
      nlohmann::json content = json;
      content.erase(kMetaChecksumKey);
      DTRAIN_CHECK_INPUT(crc_of(content.dump()) == recorded, path,
                         " is damaged: its content does not match its checksum");
    }
    meta.format_version = json.at("format_version").get<int>();
    DTRAIN_CHECK_INPUT(meta.format_version != 1, path, ": format_version 1 (model.pt + ",
                       "optimizer.pt, from an earlier dtrain) cannot be loaded; this build reads ",
                       "format_version ", kCheckpointFormat, " (state-R-of-N.pt shards)");
    DTRAIN_CHECK_INPUT(meta.format_version == kCheckpointFormat, path,
                       ": unsupported format_version ", meta.format_version, " (this build reads ",
                       kCheckpointFormat, ")");
    meta.strategy = json.at("strategy").get<std::string>();
    meta.world_size = json.at("world_size").get<int>();
    meta.dp = json.at("layout").at("dp").get<int>();
    meta.pp = json.at("layout").at("pp").get<int>();
    meta.tp = json.at("layout").at("tp").get<int>();
    meta.ep = json.at("layout").value("ep", 1);
    meta.step = json.at("step").get<int64_t>();
    meta.epoch = json.at("epoch").get<int64_t>();
    meta.seed = json.at("seed").get<uint64_t>();
    meta.global_batch = json.at("global_batch").get<int64_t>();
    for (const auto& t : json.at("tensors")) {
      meta.tensors.push_back({t.at("name").get<std::string>(),
                              t.at("shape").get<std::vector<int64_t>>(),
                              t.at("dtype").get<std::string>(),
                              t.value("kind", std::string("parameter")) == "buffer"});
    }
    if (json.contains("extras")) {
      meta.extras = json.at("extras").get<std::map<std::string, std::string>>();
    }
    if (json.contains("files")) {
      for (const auto& [name, digest] : json.at("files").items()) {
        // A path inside the checkpoint (a strategy's folder, as DiLoCo's islands'): relative,
        // with no . or .. parts.
        const fs::path relative(name);
        bool inside = !name.empty() && relative.is_relative();
        for (const auto& part : relative) inside = inside && part != "." && part != "..";
        DTRAIN_CHECK_INPUT(inside, path, ": file name '", name,
                           "' is not a path inside the checkpoint");
        meta.files[name] = {digest.at("bytes").get<int64_t>(), digest.at("crc32").get<uint32_t>()};
      }
    }
  } catch (const nlohmann::json::exception& e) {
    DTRAIN_THROW(InputError, "checkpoint metadata ", path,
                 " is incomplete: ", json_error_text(e.what()));
  }
  return meta;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const auto latest = latest_checkpoint_name(root);
  if (!latest) return std::nullopt;
  const std::string name = *latest;
  const std::string directory = root + "/" + name;
  DTRAIN_CHECK_INPUT(!name.empty() && fs::is_directory(directory), root,
                     "/latest names checkpoint '", name, "', which does not exist");
  return directory;
}

void set_latest(const std::string& root, const std::string& name) {
  write_atomically(root + "/latest", name + "\n");
}

void check_compatible(const CheckpointMeta& saved, const std::vector<TensorInfo>& model,
                      const std::string& directory) {
  for (size_t i = 0; i < std::max(saved.tensors.size(), model.size()); ++i) {
    DTRAIN_CHECK_INPUT(i < saved.tensors.size(), "checkpoint ", directory, " lacks tensor '",
                       model[i].name, "' of the model");
    DTRAIN_CHECK_INPUT(i < model.size(), "checkpoint ", directory, " has tensor '",
                       saved.tensors[i].name, "' that the model lacks");
    const auto& a = saved.tensors[i];
    const auto& b = model[i];
    auto shape = [](const std::vector<int64_t>& s) {
      std::string out = "[";
      for (size_t k = 0; k < s.size(); ++k) out += (k ? "," : "") + std::to_string(s[k]);
      return out + "]";
    };
    DTRAIN_CHECK_INPUT(a.name == b.name && a.shape == b.shape && a.dtype == b.dtype, "checkpoint ",
                       directory, " does not match the model: first mismatch at ", "tensor ", i,
                       ": checkpoint has '", a.name, "' ", shape(a.shape), " ", a.dtype,
                       ", model has '", b.name, "' ", shape(b.shape), " ", b.dtype);
  }
}

void ensure_writable(const std::string& root) {
  std::error_code error;
  fs::create_directories(root, error);
  DTRAIN_CHECK_INPUT(!error, "checkpoint directory ", root,
                     " cannot be created: ", error.message());
  const std::string probe = root + "/.write-test";
  {
    std::ofstream out(probe);
    DTRAIN_CHECK_INPUT(out.good() && (out << "ok").good(), "checkpoint directory ", root,
                       " is not writable");
  }
  fs::remove(probe, error);
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  static const std::regex pattern(R"(step-\d{8})");
  std::vector<std::string> complete;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, pattern)) complete.push_back(name);
  }
  std::sort(complete.begin(), complete.end());
  return complete;
}

std::optional<std::string> latest_checkpoint_name(const std::string& root) {
  std::ifstream in(root + "/latest");
  if (!in.good()) return std::nullopt;
  std::string name;
  std::getline(in, name);
  return name;
}

void prune_checkpoints(const std::string& root, int keep, const std::string& newest) {
  if (keep <= 0) return;
  auto complete = list_checkpoints(root);
  complete.erase(std::upper_bound(complete.begin(), complete.end(), newest), complete.end());
  for (size_t i = 0; i + keep < complete.size(); ++i) {
    std::error_code error;
    fs::remove_all(root + "/" + complete[i], error);
  }
}

std::string set_aside_damaged(const std::string& directory) {
  std::string target = directory + ".damaged";
  for (int i = 1; fs::exists(target); ++i) target = concat(directory, ".damaged.", i);
  std::error_code error;
  fs::rename(directory, target, error);
  DTRAIN_CHECK_INPUT(!error, "cannot rename damaged checkpoint ", directory, " to ", target, ": ",
                     error.message());
  return target;
}

std::string resolve_checkpoint(const std::string& path) {
  if (fs::exists(path + "/meta.json")) return path;
  const auto latest = latest_checkpoint(path);
  DTRAIN_CHECK_INPUT(latest.has_value(), path,
                     " is neither a checkpoint (no meta.json) nor a checkpoint directory (no "
                     "latest)");
  return *latest;
}

namespace {

at::ScalarType scalar_type_named(const std::string& name, const std::string& directory) {
  for (auto type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                    at::kShort, at::kChar, at::kByte, at::kBool}) {
    if (name == c10::toString(type)) return type;
  }
  DTRAIN_THROW(InputError, directory, "/meta.json: unknown dtype '", name, "'");
}

// A module-shaped archive being built: tensors of this module, and its submodules by name.
struct ArchiveNode {
  std::vector<std::tuple<std::string, at::Tensor, bool>> tensors;  // name, value, is_buffer
  std::map<std::string, ArchiveNode> children;
  std::vector<std::string> child_order;

  void add(const std::string& path, const at::Tensor& value, bool is_buffer) {
    const auto dot = path.find('.');
    if (dot == std::string::npos) {
      tensors.emplace_back(path, value, is_buffer);
      return;
    }
    const std::string head = path.substr(0, dot);
    if (!children.count(head)) child_order.push_back(head);
    children[head].add(path.substr(dot + 1), value, is_buffer);
  }
  void write(torch::serialize::OutputArchive& archive) const {
    for (const auto& [name, value, is_buffer] : tensors) archive.write(name, value, is_buffer);
    for (const auto& name : child_order) {
      torch::serialize::OutputArchive child;
      children.at(name).write(child);
      archive.write(name, child);
    }
  }
};

// Writes the archive to `output` atomically (a temporary name, then renamed).
void write_archive(const ArchiveNode& root, const std::string& output) {
  torch::serialize::OutputArchive archive;
  root.write(archive);
  const std::string temporary = output + ".tmp";
  try {
    archive.save_to(temporary);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, "cannot write ", temporary, ": ", e.what_without_backtrace());
  }
  std::error_code error;
  fs::rename(temporary, output, error);
  DTRAIN_CHECK_INPUT(!error, "cannot rename ", temporary, " to ", output, ": ", error.message());
}

}  // namespace

void load_consolidated(torch::nn::Module& module, const std::string& file) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(file);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, file, " is not a LibTorch archive: ", e.what_without_backtrace());
  }
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& target) {
    torch::serialize::InputArchive* level = &archive;
    std::deque<torch::serialize::InputArchive> nested;  // stable addresses
    size_t begin = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', begin)) {
      nested.emplace_back();
      DTRAIN_CHECK_INPUT(level->try_read(name.substr(begin, dot - begin), nested.back()), file,
                         " has no tensor ", name);
      level = &nested.back();
      begin = dot + 1;
    }
    at::Tensor value;
    DTRAIN_CHECK_INPUT(level->try_read(name.substr(begin), value), file, " has no tensor ", name);
    DTRAIN_CHECK_INPUT(value.sizes() == target.sizes(), file, ": ", name, " is ", value.sizes(),
                       ", the model's is ", target.sizes());
    target.copy_(value);
  };
  for (auto& item : module.named_parameters()) load(item.key(), item.value());
  for (auto& item : module.named_buffers()) load(item.key(), item.value());
}

std::vector<FullTensor> read_full_model(const std::string& directory) {
  const std::string problem = verify_checkpoint(directory);
  DTRAIN_CHECK_INPUT(problem.empty(), "checkpoint ", directory, " does not verify: ", problem);
  const CheckpointMeta meta = read_meta(directory);
  std::vector<parallel::PieceRef> parameters;
  parallel::NamedTensors buffers;
  std::vector<FullTensor> out;
  for (const auto& info : meta.tensors) {
    const auto dtype = scalar_type_named(info.dtype, directory);
    at::Tensor value = at::zeros(info.shape, at::TensorOptions().dtype(dtype));
    if (info.buffer) {
      buffers.emplace_back(info.name, value);
    } else {
      parameters.push_back({info.name, 0, value, info.shape});
    }
    out.push_back({info.name, value, info.buffer});
  }
  parallel::read_state_shards(directory, parameters, nullptr, {}, &buffers);
  return out;
}

int64_t consolidate_checkpoint(const std::string& directory, const std::string& output) {
  ArchiveNode root;
  const std::vector<FullTensor> tensors = read_full_model(directory);
  for (const auto& t : tensors) root.add(t.name, t.value, t.buffer);
  write_archive(root, output);
  return static_cast<int64_t>(tensors.size());
}

void save_consolidated(torch::nn::Module& module, const std::string& file) {
  ArchiveNode root;
  for (const auto& item : module.named_parameters()) {
    root.add(item.key(), item.value().detach().cpu(), false);
  }
  for (const auto& item : module.named_buffers()) {
    root.add(item.key(), item.value().detach().cpu(), true);
  }
  write_archive(root, file);
}

void load_model_from(torch::nn::Module& module, const std::string& path) {
  DTRAIN_CHECK_INPUT(fs::exists(path), "--init-from ", path, ": no such file or directory");
  if (!fs::is_directory(path)) {
    load_consolidated(module, path);
    return;
  }
  // A checkpoint of any strategy and world size: its full model, joined first.
  const std::string directory = resolve_checkpoint(path);
  const std::string joined =
      (fs::temp_directory_path() /
       concat("dtrain-init-", ::getpid(), "-", std::hash<std::string>{}(directory), ".pt"))
          .string();
  consolidate_checkpoint(directory, joined);
  try {
    load_consolidated(module, joined);
  } catch (...) {
    fs::remove(joined);
    throw;
  }
  fs::remove(joined);
}

}  // namespace dtrain::train
