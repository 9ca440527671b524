// `--dataset images:ROOT`: labelled images in ImageNet's layout (ROOT/train and ROOT/val, each a
// folder per class, torchvision's ImageFolder) or as WebDataset tar shards (ROOT/train/*.tar:
// files grouped by basename, KEY.jpg/.png with KEY.cls holding the class index). Training
// examples are decoded, random-resized-cropped and flipped (torchvision's ImageNet recipe),
// evaluation ones resized and center-cropped, normalized with ImageNet's statistics; a batch's
// images are decoded on LibTorch's threads. Every image's header is read before training: up to
// --max-bad-samples damaged ones are named and left out, more stop the run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/data/Dataset.h"

namespace dtrain::data::images {

struct ImageSetOptions {
  /// ROOT (with train/ and val/), or TRAIN,VAL.
  std::string spec;
  int size = 224;  ///< the crop's side (the model's input)
  uint64_t seed = 0;
  int64_t max_bad_samples = 0;
  /// "imagenet", "flip" or "none" (DataSource::augment).
  std::string augment = "imagenet";
  bool train = true;  ///< load the training split
  bool test = true;   ///< and the validation split
};

struct ImageSplits {
  TensorDataset train;
  TensorDataset test;
  std::vector<std::string> classes;  ///< class names (folders), or "0".."N-1" (tar shards)
  std::string description;
};

ImageSplits load_image_splits(const ImageSetOptions& options);

/// The classes of a spec's training split, without reading any image.
std::vector<std::string> image_classes(const std::string& spec);

/// Writes a folder-per-class tree as WebDataset tar shards of about `shard_bytes` each
/// (PREFIX-000000.tar, ...: KEY.jpg or KEY.png and KEY.cls, class indices in sorted folder
/// order; the order of the files shuffled with `seed`, as WebDataset's shards are). Returns the
/// shards written.
std::vector<std::string> write_image_shards(const std::string& folder, const std::string& prefix,
                                            int64_t shard_bytes, uint64_t seed);

/// Fashion-MNIST's IDX files (`data_dir`, "" = the default location) as JPEG files in
/// ImageNet's layout: `OUT/train/<class>/NNNNN.jpg` and `OUT/val/<class>/NNNNN.jpg` (grayscale,
/// quality `quality`). Returns the images written.
int64_t export_fashion_mnist_jpeg(const std::string& data_dir, const std::string& out, int quality);

}  // namespace dtrain::data::images
