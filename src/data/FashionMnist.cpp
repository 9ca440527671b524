// Locates and loads the Fashion-MNIST IDX files.
#include "dtrain/data/FashionMnist.h"

#include <ATen/ATen.h>

#include <sys/stat.h>
#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/data/Idx.h"

namespace dtrain::data {

namespace {

bool exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

std::string find_file(const std::string& directory, const std::string& stem) {
  for (const std::string& candidate : {directory + "/" + stem + ".gz", directory + "/" + stem}) {
    if (exists(candidate)) return candidate;
  }
  DTRAIN_THROW(InputError, "Fashion-MNIST file ", stem, "[.gz] not found in ", directory,
               " (install Debian's dataset-fashion-mnist or pass --data-dir)");
}

// Statistics of the 60k training images, so train and test are normalized alike.
constexpr double kMean = 0.2860;
constexpr double kStd = 0.3530;

}  // namespace

std::string resolve_fashion_mnist_dir(const std::string& directory) {
  if (!directory.empty()) return directory;
  if (const char* env = std::getenv("DTRAIN_DATA_DIR")) return env;
  return kFashionMnistDefaultDir;
}

TensorDataset load_fashion_mnist(const std::string& directory, Split split) {
  const std::string dir = resolve_fashion_mnist_dir(directory);
  DTRAIN_CHECK_INPUT(exists(dir), "Fashion-MNIST directory ", dir,
                     " does not exist (install Debian's dataset-fashion-mnist or pass "
                     "--data-dir)");
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::string image_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string label_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  at::Tensor images = read_idx(image_path, 3);
  at::Tensor labels = read_idx(label_path, 1);
  DTRAIN_CHECK_INPUT(images.size(1) == 28 && images.size(2) == 28, image_path, ": images are ",
                     images.size(1), "x", images.size(2), ", expected 28x28");
  DTRAIN_CHECK_INPUT(images.size(0) == labels.size(0), image_path, " has ", images.size(0),
                     " images but ", label_path, " has ", labels.size(0), " labels");
  DTRAIN_CHECK_INPUT(labels.max().item<int>() <= 9, label_path, ": label ",
                     labels.max().item<int>(), " is outside the 10 classes");
  images = images.unsqueeze(1);  // [N, 1, 28, 28]
  return TensorDataset(images, labels.to(at::kLong), [](const at::Tensor& pixels) {
    return pixels.to(at::kFloat).div_(255.0).sub_(kMean).div_(kStd);
  });
}

}  // namespace dtrain::data
