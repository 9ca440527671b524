// IDX reader on good and corrupt files, Fashion-MNIST loading, DistributedSampler, synthetic data.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <fstream>
#include <set>

#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/DistributedSampler.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/data/Idx.h"

using namespace dtrain;
using dtrain::test::TempDir;

namespace {

std::string idx_bytes(std::vector<uint32_t> dims, size_t data_bytes, uint8_t type = 0x08) {
  std::string out = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(d >> shift));
  }
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i % 251));
  return out;
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
}

void expect_input_error(const std::string& path, int dims, const std::string& fragment) {
  try {
    data::read_idx(path, dims);
    ADD_FAILURE() << "no error for " << fragment;
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(path), std::string::npos) << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

}  // namespace

TEST(Idx, ReadsRawAndGzip) {
  TempDir dir;
  const std::string bytes = idx_bytes({3, 2, 4}, 24);
  write_raw(dir / "a.idx", bytes);
  write_gz(dir / "a.idx.gz", bytes);
  for (const auto& name : {"a.idx", "a.idx.gz"}) {
    auto t = data::read_idx(dir / name, 3);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 2, 4}));
    EXPECT_EQ(t.scalar_type(), torch::kByte);
    EXPECT_EQ(t.flatten()[23].item<int>(), 23);
  }
}

TEST(Idx, CorruptFilesNameFileAndProblem) {
  TempDir dir;
  expect_input_error(dir / "missing.idx", 1, "not found");
  write_raw(dir / "magic", std::string("\x01\x00\x08\x01", 4) + std::string(8, 'x'));
  expect_input_error(dir / "magic", 1, "not an IDX file");
  write_raw(dir / "type", idx_bytes({4}, 16, 0x0D));
  expect_input_error(dir / "type", 1, "not unsigned byte");
  write_raw(dir / "dims", idx_bytes({2, 2}, 4));
  expect_input_error(dir / "dims", 1, "has 2 dimensions, expected 1");
  write_raw(dir / "header", idx_bytes({2, 2, 2}, 0).substr(0, 9));
  expect_input_error(dir / "header", 3, "truncated header");
  write_gz(dir / "short.gz", idx_bytes({10, 28, 28}, 1000));
  expect_input_error(dir / "short.gz", 3, "truncated: header promises 7840");
  write_raw(dir / "long", idx_bytes({4}, 5));
  expect_input_error(dir / "long", 1, "trailing data");
  write_raw(dir / "tiny", "\x00\x00");
  expect_input_error(dir / "tiny", 1, "shorter than");
  // Absurd dimensions: refused from the file size, before any allocation.
  write_raw(dir / "huge", idx_bytes({1u << 27, 1u << 27, 28}, 100));
  expect_input_error(dir / "huge", 3, "more than this 116-byte file can hold");
  write_gz(dir / "huge.gz", idx_bytes({1u << 27, 1u << 27, 28}, 100));
  expect_input_error(dir / "huge.gz", 3, "gzip file can hold");
  write_raw(dir / "overflow", idx_bytes({(1u << 28) - 1, (1u << 28) - 1, (1u << 28) - 1}, 0));
  expect_input_error(dir / "overflow", 3, "more than 2^63");
  // A gzip stream cut in the middle.
  write_gz(dir / "cut.gz", idx_bytes({100, 28, 28}, 78400));
  std::filesystem::resize_file(dir / "cut.gz", std::filesystem::file_size(dir / "cut.gz") / 2);
  EXPECT_THROW(data::read_idx(dir / "cut.gz", 3), InputError);
}

TEST(FashionMnist, LoadsBothSplitsNormalized) {
  const std::string dir = data::resolve_fashion_mnist_dir("");
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  auto test = data::load_fashion_mnist("", data::Split::Test);
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(test.input_shape(), (std::vector<int64_t>{1, 28, 28}));
  auto batch = test.slice(0, 1000);
  EXPECT_EQ(batch.inputs.scalar_type(), torch::kFloat);
  EXPECT_NEAR(batch.inputs.mean().item<double>(), 0.0, 0.1);
  EXPECT_NEAR(batch.inputs.std().item<double>(), 1.0, 0.1);
  EXPECT_EQ(std::get<0>(at::_unique(test.targets())).numel(), 10);
}

TEST(FashionMnist, MissingDirectoryAndFilesAreInputErrors) {
  TempDir dir;
  EXPECT_THROW(data::load_fashion_mnist(dir / "nope", data::Split::Train), InputError);
  try {
    data::load_fashion_mnist(dir.path(), data::Split::Train);
    ADD_FAILURE();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("train-images-idx3-ubyte"), std::string::npos);
  }
}

TEST(DistributedSampler, RanksPartitionEachEpochAndEpochsDiffer) {
  const int64_t n = 103;
  for (bool drop_last : {false, true}) {
    std::multiset<int64_t> seen;
    std::vector<std::vector<int64_t>> per_rank;
    for (int rank = 0; rank < 4; ++rank) {
      data::DistributedSampler sampler(n, 4, rank, {true, 42, drop_last});
      sampler.set_epoch(3);
      auto indices = sampler.indices();
      EXPECT_EQ(static_cast<int64_t>(indices.size()), drop_last ? 25 : 26);
      seen.insert(indices.begin(), indices.end());
      per_rank.push_back(indices);
    }
    std::set<int64_t> distinct(seen.begin(), seen.end());
    EXPECT_EQ(static_cast<int64_t>(distinct.size()), drop_last ? 100 : n);
    EXPECT_EQ(static_cast<int64_t>(seen.size()), drop_last ? 100 : 104);  // padded by 1
    data::DistributedSampler again(n, 4, 0, {true, 42, drop_last});
    again.set_epoch(3);
    EXPECT_EQ(again.indices(), per_rank[0]);  // deterministic
    again.set_epoch(4);
    EXPECT_NE(again.indices(), per_rank[0]);  // reshuffled per epoch
  }
}

TEST(DistributedSampler, RankBatchesUnionIsTheSingleProcessBatch) {
  // Rank r's k-th batch of b examples, over all ranks, equals the 1-rank k-th batch of N*b.
  const int ranks = 4, b = 5;
  data::DistributedSampler single(200, 1, 0, {true, 7, true});
  auto all = single.indices();
  for (int k = 0; k < 3; ++k) {
    std::set<int64_t> expected(all.begin() + k * ranks * b, all.begin() + (k + 1) * ranks * b);
    std::set<int64_t> got;
    for (int r = 0; r < ranks; ++r) {
      auto mine = data::DistributedSampler(200, ranks, r, {true, 7, true}).indices();
      got.insert(mine.begin() + k * b, mine.begin() + (k + 1) * b);
    }
    EXPECT_EQ(got, expected);
  }
}

TEST(DistributedSampler, TooSmallDatasetIsAnError) {
  EXPECT_THROW(data::DistributedSampler(3, 4, 0, {true, 0, true}), InputError);
}

TEST(Synthetic, DeterministicAndLearnable) {
  auto a = data::make_synthetic(256, {8}, 4, 1);
  auto b = data::make_synthetic(256, {8}, 4, 1);
  EXPECT_TRUE(torch::equal(a.raw_inputs(), b.raw_inputs()));
  EXPECT_TRUE(torch::equal(a.targets(), b.targets()));
  EXPECT_GE(std::get<0>(at::_unique(a.targets())).numel(), 3);
}
