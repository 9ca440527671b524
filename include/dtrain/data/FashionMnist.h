// Fashion-MNIST (Zalando): 60k training and 10k test 28x28 grey images in 10 classes, read from
// the IDX files of Debian's dataset-fashion-mnist package or a directory of the same files.
#pragma once

#include <string>

#include "dtrain/data/Dataset.h"

namespace dtrain::data {

/// Where Debian's dataset-fashion-mnist installs the files.
constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

enum class Split { Train, Test };

/// Loads one split from `directory` ("" = $DTRAIN_DATA_DIR or the Debian location). Files may be
/// gzip'd (`*.gz`) or raw. Inputs are [N, 1, 28, 28], normalized with the training set's mean
/// and standard deviation; targets are int64 class indices.
TensorDataset load_fashion_mnist(const std::string& directory, Split split);

/// The directory that load_fashion_mnist would use for `directory`.
std::string resolve_fashion_mnist_dir(const std::string& directory);

}  // namespace dtrain::data
