// Fashion-MNIST exported as JPEG files in class folders (`dtrain data export-fashion-mnist`): an
// image folder the `images` data set reads, for trying it without a data set of one's own.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "common/Files.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/data/images/Image.h"
#include "dtrain/data/images/ImageSet.h"

namespace dtrain::data::images {

namespace fs = std::filesystem;

int64_t export_fashion_mnist_jpeg(const std::string& data_dir, const std::string& out,
                                  int quality) {
  static const char* kClasses[] = {"0-tshirt", "1-trouser", "2-pullover", "3-dress", "4-coat",
                                   "5-sandal", "6-shirt",   "7-sneaker",  "8-bag",   "9-boot"};
  int64_t written = 0;
  for (int s = 0; s < 2; ++s) {
    const TensorDataset set =
        load_fashion_mnist(data_dir, s == 0 ? data::Split::Train : data::Split::Test);
    const at::Tensor pixels = set.raw_inputs().to(at::kByte).reshape({-1, 28 * 28}).contiguous();
    const at::Tensor labels = set.targets().to(at::kLong).contiguous();
    const std::string root = (fs::path(out) / (s == 0 ? "train" : "val")).string();
    for (const char* c : kClasses) fs::create_directories(fs::path(root) / c);
    const int64_t n = pixels.size(0);
    const uint8_t* p = pixels.data_ptr<uint8_t>();
    const int64_t* l = labels.data_ptr<int64_t>();
    at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
      Image image;
      image.width = 28;
      image.height = 28;
      image.rgb.resize(28 * 28 * 3);
      for (int64_t i = begin; i < end; ++i) {
        for (int k = 0; k < 28 * 28; ++k) {
          image.rgb[3 * k] = image.rgb[3 * k + 1] = image.rgb[3 * k + 2] = p[i * 28 * 28 + k];
        }
        const std::string jpeg = encode_jpeg(image, quality, true);
        char file[32];
        std::snprintf(file, sizeof(file), "%05lld.jpg", static_cast<long long>(i));
        const std::string path = (fs::path(root) / kClasses[l[i]] / file).string();
        write_file_atomically(path, jpeg.data(), jpeg.size());
      }
    });
    written += n;
  }
  return written;
}

}  // namespace dtrain::data::images
