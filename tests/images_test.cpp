// Image data: JPEG/PNG decoding equal to PIL's, the antialiased resize within one grey level of
// PIL's, the crop-only JPEG decode close to the full one, torchvision's random-resized-crop
// bounds, folders and WebDataset tar shards giving the same examples, and bad images named.
#include <gtest/gtest.h>
#include <torch/torch.h>

// clang-format off
#include <cstdio>  // (jpeglib.h needs FILE first)
#include <jpeglib.h>
// clang-format on

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "InputErrors.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/data/images/Image.h"
#include "dtrain/data/images/ImageSet.h"
#include "dtrain/data/tokens/GptIndex.h"

using namespace dtrain;
using namespace dtrain::data::images;
using dtrain::test::error_of;
using dtrain::test::TempDir;
namespace fs = std::filesystem;

namespace {

// A photograph-like test image: smooth gradients, edges and noise.
Image test_image(int width, int height, uint64_t seed) {
  Image image;
  image.width = width;
  image.height = height;
  image.rgb.resize(static_cast<size_t>(width) * height * 3);
  std::mt19937_64 random(seed);
  std::uniform_int_distribution<int> noise(-20, 20);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      const int edge = ((x / 37 + y / 23) % 2) * 60;
      for (int c = 0; c < 3; ++c) {
        const int v =
            (x * (c + 1) * 255 / width + y * (3 - c) * 255 / height) / 3 + edge + noise(random);
        image.rgb[(static_cast<size_t>(y) * width + x) * 3 + c] =
            static_cast<uint8_t>(std::min(255, std::max(0, v)));
      }
    }
  }
  return image;
}

void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const uint8_t* bytes_of(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

bool have_pil() {
  return std::system((std::string(DTRAIN_PYTHON) + " -c 'import PIL' > /dev/null 2>&1").c_str()) ==
         0;
}

// A folder per class: 3 classes x 4 images of about 120 x 90.
void write_tree(const std::string& root) {
  for (const std::string split : {"train", "val"}) {
    for (int c = 0; c < 3; ++c) {
      for (int i = 0; i < 4; ++i) {
        const Image image = test_image(100 + 10 * i, 80 + 5 * c, c * 10 + i);
        write_file(
            root + "/" + split + "/class" + std::to_string(c) + "/" + std::to_string(i) + ".jpg",
            encode_jpeg(image, 90));
      }
    }
  }
}

}  // namespace

TEST(Images, DecodeAndResizeAsPil) {
  if (!have_pil()) GTEST_SKIP() << "no PIL in " << DTRAIN_PYTHON;
  TempDir dir;
  const std::string jpeg = encode_jpeg(test_image(500, 375, 1), 90);
  write_file(dir / "a.jpg", jpeg);
  // PIL: the decoded pixels, and the region (30.5, 20, 300, 250) resized to 64x64 (bilinear,
  // antialiased; PIL's resize with a box), as raw RGB.
  const std::string script =
      "from PIL import Image; import sys; im = Image.open(sys.argv[1]).convert('RGB'); "
      "open(sys.argv[2], 'wb').write(im.tobytes()); "
      "open(sys.argv[3], 'wb').write(im.resize((64, 64), Image.BILINEAR, box=(30.5, 20, 330.5, "
      "270)).tobytes())";
  const std::string command = std::string(DTRAIN_PYTHON) + " -c \"" + script + "\" " +
                              (dir / "a.jpg") + " " + (dir / "full.rgb") + " " +
                              (dir / "small.rgb");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const Image decoded = decode_image(bytes_of(jpeg), jpeg.size(), "a.jpg");
  ASSERT_EQ(decoded.width, 500);
  ASSERT_EQ(decoded.height, 375);
  EXPECT_EQ(std::string(decoded.rgb.begin(), decoded.rgb.end()), read_file(dir / "full.rgb"));
  Normalize identity;
  for (int c = 0; c < 3; ++c) identity.mean[c] = 0, identity.std[c] = 1.0f / 255.0f;
  std::vector<float> ours(3 * 64 * 64);
  crop_resize(decoded, {30.5, 20, 300, 250}, 64, false, identity, ours.data());
  const std::string pil = read_file(dir / "small.rgb");
  int worst = 0;
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < 64 * 64; ++i) {
      const int a = static_cast<int>(std::lround(ours[c * 64 * 64 + i]));
      const int b = static_cast<uint8_t>(pil[i * 3 + c]);
      worst = std::max(worst, std::abs(a - b));
    }
  }
  EXPECT_LE(worst, 1);
}

namespace {

// A JPEG of 4-channel ink (C, M, Y, K as stored: Adobe's inverted convention) encoded as CMYK or
// as YCCK (libjpeg converts), with the Adobe marker libjpeg writes for both.
std::string encode_cmyk_jpeg(int width, int height, bool ycck) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr errors;
  cinfo.err = jpeg_std_error(&errors);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = static_cast<JDIMENSION>(width);
  cinfo.image_height = static_cast<JDIMENSION>(height);
  cinfo.input_components = 4;
  cinfo.in_color_space = JCS_CMYK;
  jpeg_set_defaults(&cinfo);
  jpeg_set_colorspace(&cinfo, ycck ? JCS_YCCK : JCS_CMYK);
  jpeg_set_quality(&cinfo, 90, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  std::vector<uint8_t> row(static_cast<size_t>(width) * 4);
  while (cinfo.next_scanline < cinfo.image_height) {
    const int y = static_cast<int>(cinfo.next_scanline);
    for (int x = 0; x < width; ++x) {
      row[4 * x + 0] = static_cast<uint8_t>(255 * x / width);
      row[4 * x + 1] = static_cast<uint8_t>(255 * y / height);
      row[4 * x + 2] = static_cast<uint8_t>((x * y) % 256);
      row[4 * x + 3] = static_cast<uint8_t>(128 + 127 * ((x / 8 + y / 8) % 2));
    }
    JSAMPROW rows[1] = {row.data()};
    jpeg_write_scanlines(&cinfo, rows, 1);
  }
  jpeg_finish_compress(&cinfo);
  std::string out(reinterpret_cast<const char*>(buffer), size);
  jpeg_destroy_compress(&cinfo);
  std::free(buffer);
  return out;
}

}  // namespace

// CMYK and YCCK JPEGs (ImageNet's training set has some) decode to PIL's RGB pixels, exactly:
// they were refused mid-training as "a damaged JPEG (Unsupported color conversion request)".
TEST(Images, CmykAndYcckJpegsDecodeAsPil) {
  if (!have_pil()) GTEST_SKIP() << "no PIL in " << DTRAIN_PYTHON;
  TempDir dir;
  for (const bool ycck : {false, true}) {
    const std::string jpeg = encode_cmyk_jpeg(67, 45, ycck);
    const std::string name = ycck ? "ycck.jpg" : "cmyk.jpg";
    write_file(dir / name, jpeg);
    const std::string command =
        std::string(DTRAIN_PYTHON) +
        " -c \"from PIL import Image; import sys; im = Image.open(sys.argv[1]); "
        "assert im.mode == 'CMYK', im.mode; "
        "open(sys.argv[2], 'wb').write(im.convert('RGB').tobytes())\" " +
        (dir / name) + " " + (dir / "pil.rgb");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const Image decoded = decode_image(bytes_of(jpeg), jpeg.size(), name);
    ASSERT_EQ(decoded.width, 67);
    ASSERT_EQ(decoded.height, 45);
    EXPECT_EQ(std::string(decoded.rgb.begin(), decoded.rgb.end()), read_file(dir / "pil.rgb"))
        << name;
    // The crop-only path converts the same rows.
    Normalize identity;
    for (int c = 0; c < 3; ++c) identity.mean[c] = 0, identity.std[c] = 1.0f / 255.0f;
    std::vector<float> a(3 * 16 * 16), b(3 * 16 * 16);
    crop_resize(decoded, {10, 5, 40, 30}, 16, false, identity, a.data());
    decode_crop_resize(bytes_of(jpeg), jpeg.size(), name, {10, 5, 40, 30}, 16, false, identity,
                       b.data());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::abs(a[i] - b[i])));
    EXPECT_LE(worst, 1.0) << name;
  }
}

TEST(Images, CropOnlyDecodingIsCloseToTheFullDecode) {
  const std::string jpeg = encode_jpeg(test_image(500, 375, 2), 90);
  const Image full = decode_image(bytes_of(jpeg), jpeg.size(), "b.jpg");
  Normalize identity;
  for (int c = 0; c < 3; ++c) identity.mean[c] = 0, identity.std[c] = 1.0f / 255.0f;
  // A crop needing rows and columns only (scale 1), and one the DCT shrinks by 2.
  for (const Region region : {Region{133, 71, 150, 120}, Region{40, 20, 400, 330}}) {
    std::vector<float> a(3 * 96 * 96);
    std::vector<float> b(3 * 96 * 96);
    crop_resize(full, region, 96, false, identity, a.data());
    decode_crop_resize(bytes_of(jpeg), jpeg.size(), "b.jpg", region, 96, false, identity, b.data());
    double mean = 0;
    for (size_t i = 0; i < a.size(); ++i) mean += std::abs(a[i] - b[i]);
    mean /= a.size();
    EXPECT_LT(mean, region.width > 300 ? 3.0 : 0.01) << region.width;  // grey levels
  }
  // Flipping mirrors the columns.
  std::vector<float> plain(3 * 32 * 32);
  std::vector<float> flipped(3 * 32 * 32);
  crop_resize(full, {0, 0, 500, 375}, 32, false, identity, plain.data());
  crop_resize(full, {0, 0, 500, 375}, 32, true, identity, flipped.data());
  EXPECT_EQ(plain[5], flipped[31 - 5]);
}

TEST(Images, RandomResizedCropFollowsTorchvisionsBounds) {
  std::mt19937_64 random(3);
  for (int i = 0; i < 2000; ++i) {
    const Region r = random_resized_crop(500, 375, random);
    EXPECT_GE(r.x, 0);
    EXPECT_GE(r.y, 0);
    EXPECT_LE(r.x + r.width, 500);
    EXPECT_LE(r.y + r.height, 375);
    const double area = r.width * r.height / (500.0 * 375.0);
    EXPECT_GE(area, 0.08 * 0.95);
    EXPECT_LE(area, 1.0);
    EXPECT_GE(r.width / r.height, 0.75 * 0.95);
    EXPECT_LE(r.width / r.height, 4.0 / 3.0 * 1.05);
  }
  const Region eval = center_crop(500, 375, 256, 224);
  EXPECT_NEAR(eval.width, 375.0 * 224 / 256, 1e-9);
  EXPECT_NEAR(eval.x, (500 - eval.width) / 2, 1e-9);
}

TEST(Images, FoldersAndTarShardsGiveTheSameExamples) {
  TempDir dir;
  write_tree(dir / "tree");
  ImageSetOptions options;
  options.spec = dir / "tree";
  options.size = 32;
  const ImageSplits folders = load_image_splits(options);
  EXPECT_EQ(folders.classes, (std::vector<std::string>{"class0", "class1", "class2"}));
  EXPECT_EQ(folders.train.size(), 12);
  EXPECT_EQ(folders.test.input_shape(), (std::vector<int64_t>{3, 32, 32}));
  // The same trees as tar shards (shuffled, 2 or more of them).
  for (const std::string split : {"train", "val"}) {
    const auto shards =
        write_image_shards(dir / ("tree/" + split), dir / ("tars/" + split + "/s"), 40000, 7);
    EXPECT_GE(shards.size(), 2u);
  }
  options.spec = dir / "tars";
  const ImageSplits tars = load_image_splits(options);
  EXPECT_EQ(tars.classes.size(), 3u);
  // Evaluation transforms are deterministic: each (label, image) is found in both.
  auto all = [](const data::TensorDataset& set) {
    std::vector<int64_t> idx(set.size());
    for (int64_t i = 0; i < set.size(); ++i) idx[i] = i;
    return set.get(idx);
  };
  const data::Batch a = all(folders.test);
  const data::Batch b = all(tars.test);
  ASSERT_EQ(a.inputs.sizes(), b.inputs.sizes());
  for (int64_t i = 0; i < a.inputs.size(0); ++i) {
    bool found = false;
    for (int64_t j = 0; j < b.inputs.size(0) && !found; ++j) {
      found = a.targets[i].item<int64_t>() == b.targets[j].item<int64_t>() &&
              at::equal(a.inputs[i], b.inputs[j]);
    }
    EXPECT_TRUE(found) << "example " << i;
  }
  // Training draws: random per example and epoch, repeatable.
  const data::Batch first = folders.train.get({0, 1});
  const data::Batch again = folders.train.get({0, 1});
  EXPECT_TRUE(at::equal(first.inputs, again.inputs));
  folders.train.set_epoch(1);
  EXPECT_FALSE(at::equal(first.inputs, folders.train.get({0, 1}).inputs));
}

TEST(Images, BadImagesAreNamedAndUpToMaxBadLeftOut) {
  TempDir dir;
  write_tree(dir / "tree");
  const std::string good = read_file(dir / "tree/train/class1/2.jpg");
  write_file(dir / "tree/train/class1/2.jpg", good.substr(0, 100));  // truncated
  write_file(dir / "tree/train/class2/9.png", "not an image");
  ImageSetOptions options;
  options.spec = dir / "tree";
  options.size = 32;
  const std::string refused = error_of([&] { load_image_splits(options); });
  EXPECT_NE(refused.find("2 damaged images in the training split, more than --max-bad-samples 0"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.find("class1/2.jpg"), std::string::npos) << refused;
  options.max_bad_samples = 2;
  const ImageSplits splits = load_image_splits(options);
  EXPECT_EQ(splits.train.size(), 11);  // 12 + the PNG that is not one, less the 2 damaged
  EXPECT_NE(splits.description.find("left out 2 damaged training images"), std::string::npos);

  fs::create_directories(dir / "tree/train/class3");
  EXPECT_NE(error_of([&] { load_image_splits(options); }).find("class3 is an empty class folder"),
            std::string::npos);
  fs::remove_all(dir / "tree/train/class3");
  fs::create_directories(dir / "tree/val/extra");
  write_file(dir / "tree/val/extra/0.jpg", good);
  EXPECT_NE(error_of([&] {
              load_image_splits(options);
            }).find("extra is a class the training split does not have"),
            std::string::npos);
  options.spec = dir / "nowhere";
  EXPECT_NE(error_of([&] { load_image_splits(options); }).find("is not a folder"),
            std::string::npos);
}

// Entries that cannot be read are damaged samples, named and counted with --max-bad-samples: a
// symbolic link to itself (it ended the run with a filesystem error), one that leads nowhere (it
// was dropped without a word), a tar member whose header fails its checksum (skipped silently).
// Class ids of tar shards that leave gaps are warned about.
TEST(Images, UnreadableEntriesAndDamagedTarHeadersAreCountedAndNamed) {
  TempDir dir;
  write_tree(dir / "tree");
  fs::create_symlink("loop.jpg", dir / "tree/train/class0/loop.jpg");
  fs::create_symlink(dir / "gone.jpg", dir / "tree/train/class1/dangling.jpg");
  ImageSetOptions options;
  options.spec = dir / "tree";
  options.size = 32;
  const std::string refused = error_of([&] { load_image_splits(options); });
  EXPECT_NE(refused.find("2 damaged images in the training split, more than --max-bad-samples 0"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.find("class0/loop.jpg: cannot be read (Too many levels of symbolic links)"),
            std::string::npos)
      << refused;
  options.max_bad_samples = 2;
  const ImageSplits splits = load_image_splits(options);
  EXPECT_EQ(splits.train.size(), 12);
  EXPECT_NE(splits.description.find("left out 2 damaged training images"), std::string::npos)
      << splits.description;
  fs::remove(dir / "tree/train/class0/loop.jpg");
  fs::remove(dir / "tree/train/class1/dangling.jpg");

  // Tar shards: one member's header damaged (a byte of its name changed), one .cls of 97.
  for (const std::string split : {"train", "val"}) {
    write_image_shards(dir / ("tree/" + split), dir / ("tars/" + split + "/s"), 1 << 30, 7);
  }
  const std::string shard = dir / "tars/train/s-000000.tar";
  ASSERT_TRUE(fs::exists(shard)) << "write_image_shards names its shards otherwise";
  std::string bytes = read_file(shard);
  bytes[3] ^= 0x01;  // the first member's name
  write_file(shard, bytes);
  options.spec = dir / "tars";
  options.max_bad_samples = 0;
  const std::string tar_refused = error_of([&] { load_image_splits(options); });
  EXPECT_NE(tar_refused.find("s-000000.tar: the tar member header at byte 0 is damaged (its "
                             "checksum does not match)"),
            std::string::npos)
      << tar_refused;
  options.max_bad_samples = 1;
  const ImageSplits tars = load_image_splits(options);
  EXPECT_NE(tars.description.find("left out 1 damaged training image"), std::string::npos)
      << tars.description;
  EXPECT_EQ(tars.description.find("not contiguous"), std::string::npos) << tars.description;
  // A .cls of 9 among classes 0-2: 10 outputs, 6 of them without images.
  bytes[3] ^= 0x01;
  const size_t cls = bytes.find("000000001.cls");
  ASSERT_NE(cls, std::string::npos);
  bytes[cls + 512] = '9';
  write_file(shard, bytes);
  const ImageSplits gaps = load_image_splits(options);
  EXPECT_EQ(gaps.classes.size(), 10u);
  EXPECT_NE(gaps.description.find("warning: the .cls class ids are not contiguous (6 of 0-9 have "
                                  "no images, the first 3): the model gets 10 outputs"),
            std::string::npos)
      << gaps.description;
}

TEST(Images, TheRegistryDescribesTheSetFromItsFolder) {
  TempDir dir;
  write_tree(dir / "tree");
  data::DataSource source;
  source.image_size = 48;
  const data::DatasetInfo info = data::dataset_info_for("images:" + (dir / "tree"), source);
  EXPECT_EQ(info.classes, 3);
  EXPECT_EQ(info.input_shape, (std::vector<int64_t>{3, 48, 48}));
}

// --augment none: each image whole, at its own size exactly the decoded pixels (normalized);
// flip: the same pixels, some of them mirrored in training and none in evaluation.
TEST(Images, AugmentNoneIsTheWholeImageAndFlipOnlyMirrors) {
  TempDir dir;
  const Image image = test_image(40, 40, 3);
  const std::string jpeg_bytes = [&] {
    const std::string jpeg = encode_jpeg(image, 95);
    write_file(dir / "tree/train/a/0.jpg", jpeg);
    write_file(dir / "tree/train/b/0.jpg", jpeg);
    write_file(dir / "tree/val/a/0.jpg", jpeg);
    return jpeg;
  }();
  const Image decoded = decode_image(bytes_of(jpeg_bytes), jpeg_bytes.size(), "0.jpg");
  Normalize normalize;
  std::vector<float> expected(3 * 40 * 40);
  crop_resize(decoded, {0, 0, 40, 40}, 40, false, normalize, expected.data());
  const at::Tensor want = at::from_blob(expected.data(), {3, 40, 40}, at::kFloat).clone();
  ImageSetOptions options;
  options.spec = dir / "tree";
  options.size = 40;
  options.augment = "none";
  const ImageSplits none = load_image_splits(options);
  for (int epoch = 0; epoch < 3; ++epoch) {
    none.train.set_epoch(epoch);
    const data::Batch batch = none.train.get({0, 1});
    EXPECT_TRUE(at::equal(batch.inputs[0], want));
    EXPECT_TRUE(at::equal(batch.inputs[1], want));
  }
  EXPECT_TRUE(at::equal(none.test.get({0}).inputs[0], want));
  // The identity really is the image: the first pixel is the decoded one, normalized.
  EXPECT_NEAR(want[0][0][0].item<float>(),
              (decoded.rgb[0] / 255.0f - normalize.mean[0]) / normalize.std[0], 1e-5);
  options.augment = "flip";
  const ImageSplits flip = load_image_splits(options);
  EXPECT_TRUE(at::equal(flip.test.get({0}).inputs[0], want));
  int mirrored = 0;
  for (int epoch = 0; epoch < 16; ++epoch) {
    flip.train.set_epoch(epoch);
    const at::Tensor got = flip.train.get({0}).inputs[0];
    if (at::equal(got, want.flip({2}))) {
      ++mirrored;
    } else {
      EXPECT_TRUE(at::equal(got, want)) << "epoch " << epoch;
    }
  }
  EXPECT_GT(mirrored, 0);
  EXPECT_LT(mirrored, 16);
  options.augment = "crop";
  EXPECT_NE(error_of([&] {
              load_image_splits(options);
            }).find("--augment must be imagenet, flip or none, got 'crop'"),
            std::string::npos);
}
