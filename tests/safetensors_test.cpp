// safetensors: what dtrain writes the safetensors crate reads to the same values and back
// (tests/data/safetensors_oracle.py in .venv-torch; skipped without it), blocks read without the
// rest, sharded folders with Hugging Face's index, and headers that lie refused in one line naming
// the tensor.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "InputErrors.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/nn/SafeTensors.h"

using namespace dtrain;
using dtrain::test::error_of;
using dtrain::test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kPeerPython = dtrain::test::peer_python();
const std::string kOracle = std::string(DTRAIN_SOURCE_DIR) + "/tests/data/safetensors_oracle.py";

bool have_peer() {
  return std::system((kPeerPython + " -c 'import safetensors, torch' > /dev/null 2>&1").c_str()) ==
         0;
}

// The oracle's reference tensors (the same formulas).
nn::NamedTensors reference() {
  return {
      {"f64", (at::arange(12, at::kDouble) / 7).reshape({3, 4})},
      {"f32", (at::arange(24, at::kFloat) / 3 - 2).reshape({2, 3, 4})},
      {"bf16", (at::arange(8, at::kFloat) / 4).to(at::kBFloat16)},
      {"f16", (at::arange(6, at::kFloat) / 8).to(at::kHalf).reshape({2, 3})},
      {"i64", at::arange(5, at::kLong) * 1000003},
      {"u8", at::arange(7, at::kByte) * 30},
      {"bool", at::arange(4, at::kLong).remainder(2) == 0},
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::zeros({0, 3}, at::kFloat)},
  };
}

// A file from a header text and `data_bytes` bytes of data.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               uint64_t claimed = 0) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t length = claimed ? claimed : header.size();
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << std::string(data_bytes, '\0');
}

}  // namespace

TEST(SafeTensors, RoundTripEveryDtypeAndReadBlocks) {
  TempDir dir;
  const nn::NamedTensors tensors = reference();
  nn::save_safetensors(dir / "a.safetensors", tensors, {{"format", "pt"}});
  const auto file = nn::SafeTensorsFile::open(dir / "a.safetensors");
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.names().size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor got = file.get(name);
    EXPECT_EQ(got.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), tensor.sizes()) << name;
    EXPECT_TRUE(at::equal(got, tensor)) << name;
  }
  // Blocks along each dimension: what a tensor-parallel rank or a ZeRO shard reads.
  const at::Tensor f32 = tensors[1].second;
  for (int64_t dim = 0; dim < 3; ++dim) {
    EXPECT_TRUE(at::equal(file.slice("f32", dim, 1, 1), f32.narrow(dim, 1, 1))) << dim;
  }
  EXPECT_TRUE(at::equal(file.slice("f64", 1, 1, 3), tensors[0].second.narrow(1, 1, 3)));
  EXPECT_NE(error_of([&] { file.slice("f64", 1, 2, 3); }).find("has no rows [2, 5)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { file.get("nothing"); }).find("holds no tensor 'nothing'"),
            std::string::npos);
  // The data starts 8-byte aligned, as the crate writes it.
  std::ifstream in(dir / "a.safetensors", std::ios::binary);
  uint64_t header = 0;
  in.read(reinterpret_cast<char*>(&header), 8);
  EXPECT_EQ((8 + header) % 8, 0u);
}

TEST(SafeTensors, TheCrateReadsOursAndWeReadItsFiles) {
  if (!have_peer()) GTEST_SKIP() << "no safetensors in " << kPeerPython;
  TempDir dir;
  nn::save_safetensors(dir / "ours.safetensors", reference(),
                       {{"format", "pt"}, {"written_by", "dtrain"}});
  const std::string check = kPeerPython + " " + kOracle + " check " + (dir / "ours.safetensors");
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
  const std::string write = kPeerPython + " " + kOracle + " write " + (dir / "theirs.safetensors");
  ASSERT_EQ(std::system(write.c_str()), 0) << write;
  const auto file = nn::SafeTensorsFile::open(dir / "theirs.safetensors");
  for (const auto& [name, tensor] : reference()) {
    EXPECT_TRUE(at::equal(file.get(name), tensor)) << name;
  }
}

TEST(SafeTensors, ShardedFoldersWithHuggingFacesIndex) {
  TempDir dir;
  nn::NamedTensors tensors;
  for (int i = 0; i < 5; ++i) {
    tensors.push_back({"layers." + std::to_string(i) + ".weight",
                       at::full({16, 16}, static_cast<double>(i), at::kFloat)});
  }
  const auto written = nn::save_safetensors_folder(dir / "big", tensors, 2 * 16 * 16 * 4);
  ASSERT_EQ(written.size(), 4u);  // 3 shards + the index
  EXPECT_TRUE(fs::exists(dir / "big/model-00003-of-00003.safetensors"));
  const auto set = nn::SafeTensorsSet::open(dir / "big");
  EXPECT_EQ(set.names().size(), 5u);
  for (const auto& [name, tensor] : tensors) EXPECT_TRUE(at::equal(set.get(name), tensor)) << name;
  // One file, no index.
  nn::save_safetensors_folder(dir / "small", tensors);
  EXPECT_TRUE(fs::exists(dir / "small/model.safetensors"));
  EXPECT_EQ(nn::SafeTensorsSet::open(dir / "small").names().size(), 5u);
  // An index that places a tensor in the wrong shard, or misses one.
  std::ofstream(dir / "big/model.safetensors.index.json")
      << R"({"weight_map": {"layers.0.weight": "model-00002-of-00003.safetensors"}})";
  EXPECT_NE(error_of([&] { nn::SafeTensorsSet::open(dir / "big"); })
                .find("places tensor 'layers.0.weight' in model-00002-of-00003.safetensors, which "
                      "does not hold it"),
            std::string::npos);
  std::ofstream(dir / "big/model.safetensors.index.json")
      << R"({"weight_map": {"layers.0.weight": "model-00001-of-00003.safetensors"}})";
  EXPECT_NE(error_of([&] {
              nn::SafeTensorsSet::open(dir / "big");
            }).find("holds tensor 'layers.1.weight', which"),
            std::string::npos);
  EXPECT_NE(error_of([&] { nn::SafeTensorsSet::open(dir / "nothing"); }).find("nothing"),
            std::string::npos);
}

TEST(SafeTensors, AHeaderThatLiesIsRefusedNamingTheTensor) {
  TempDir dir;
  const std::string path = dir / "bad.safetensors";
  auto refused = [&](const std::string& header, size_t data, uint64_t claimed = 0) {
    write_raw(path, header, data, claimed);
    return error_of([&] { nn::SafeTensorsFile::open(path); });
  };
  const std::vector<std::tuple<std::string, size_t, uint64_t, std::string>> cases = {
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8, 0,
       "tensor 'w': data_offsets [0,16] lie outside the 8 bytes of data"},
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, 0,
       "tensor 'w': F32 of shape [3] is 12 bytes, its data_offsets hold 8"},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
       R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       12, 0, "tensor 'b' overlaps 'a'"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8, 0,
       "a hole of 4 bytes before tensor 'a'"},
      {R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 8, 0,
       "4 bytes after the last tensor"},
      {R"({"a": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}})", 1, 0,
       "tensor 'a': dtype F8_E4M3 is not one dtrain reads"},
      {R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4, 0,
       "tensor 'a': the shape holds -1, not a size"},
      {R"({"a": {"dtype": "F32", "shape": [1]}})", 4, 0,
       "tensor 'a': needs dtype, shape and data_offsets"},
      {R"({"a": )", 4, 0, "the header is not JSON"},
      // Raw bytes the parser quotes are printed escaped, not as they are.
      {"{\"a\xff\": 1}", 0, 0, "last read: '\"a\\xFF'"},
      {R"({})", 0, 200'000'000, "over safetensors' limit"},
      {R"({})", 0, 4096, "runs past the end of the file"},
  };
  for (const auto& [header, data, claimed, needle] : cases) {
    const std::string message = refused(header, data, claimed);
    EXPECT_NE(message.find(needle), std::string::npos) << header << "\n" << message;
    EXPECT_NE(message.find("bad.safetensors"), std::string::npos) << message;
    for (const char c : message) EXPECT_TRUE(c >= 0x20 && c < 0x7F) << message;
  }
}
