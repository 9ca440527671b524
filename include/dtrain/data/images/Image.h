// Images for training: JPEG (libjpeg-turbo) and PNG (libpng) decoded to RGB, and the
// transforms of ImageNet training as torchvision defines them: random-resized-crop
// (torchvision's sampling of area and aspect ratio), horizontal flip, resize of the shorter side
// and center crop for evaluation, normalization into float CHW. A JPEG is decoded only as far as
// the crop needs: rows above and below it are skipped, columns cut at the nearest iMCU, and the
// DCT scales it down by 2, 4 or 8 when the crop is that much larger than the output.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace dtrain::data::images {

struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  ///< height x width x 3
};

/// A region of an image, in its pixels.
struct Region {
  double x = 0;
  double y = 0;
  double width = 0;
  double height = 0;
};

/// Width and height from the header (InputError naming `origin` when it is not a JPEG or PNG,
/// or is damaged).
void image_size(const uint8_t* data, size_t size, const std::string& origin, int* width,
                int* height);

/// Decodes a JPEG or PNG (told apart by content) to RGB. InputError naming `origin`.
Image decode_image(const uint8_t* data, size_t size, const std::string& origin);

/// A JPEG quality `quality` (1-100) of `image`; gray when `gray` (one channel of the RGB).
std::string encode_jpeg(const Image& image, int quality, bool gray = false);

/// torchvision's RandomResizedCrop.get_params: 10 tries at an area in [scale_min, scale_max] of
/// the image and a log-uniform aspect ratio in [3/4, 4/3], else the whole image cropped to the
/// ratio's bounds, centered.
Region random_resized_crop(int width, int height, std::mt19937_64& random, double scale_min = 0.08,
                           double scale_max = 1.0);

/// Resize(resize) then CenterCrop(crop), as one region of the source image.
Region center_crop(int width, int height, int resize, int crop);

/// Per-channel normalization (ImageNet's by default).
struct Normalize {
  float mean[3] = {0.485f, 0.456f, 0.406f};
  float std[3] = {0.229f, 0.224f, 0.225f};
};

/// The `region` of an encoded image resized to size x size (antialiased bilinear, as PIL's),
/// mirrored when `flip`, normalized, written as float CHW to `out` (3 x size x size). Decodes
/// only what the region needs (JPEG).
void decode_crop_resize(const uint8_t* data, size_t bytes, const std::string& origin,
                        const Region& region, int size, bool flip, const Normalize& normalize,
                        float* out);

/// The same from a decoded image.
void crop_resize(const Image& image, const Region& region, int size, bool flip,
                 const Normalize& normalize, float* out);

}  // namespace dtrain::data::images
