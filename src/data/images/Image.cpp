// JPEG through libjpeg's own API (libjpeg-turbo: jpeg_skip_scanlines and jpeg_crop_scanline
// decode only a crop's rows and columns, DCT scaling shrinks by 2/4/8 while decoding), PNG
// through libpng's simplified API, and a separable antialiased bilinear resize with PIL's
// weights. libjpeg reports errors by longjmp: the decoding functions keep no C++ object whose
// destructor a jump could skip.
#include "dtrain/data/images/Image.h"

#include <jpeglib.h>
#include <png.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstring>

#include "dtrain/common/Error.h"

namespace dtrain::data::images {

namespace {

bool is_jpeg(const uint8_t* data, size_t size) {
  return size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF;
}

bool is_png(const uint8_t* data, size_t size) {
  return size >= 8 && png_sig_cmp(const_cast<png_bytep>(data), 0, 8) == 0;
}

struct JpegErrors {
  jpeg_error_mgr manager;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  int warnings;
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

// Corrupt data is a warning to libjpeg (it fills the rest in grey); here it is an error, as
// PIL's "image file is truncated".
void jpeg_warn(j_common_ptr cinfo, int level) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  if (level < 0 && errors->warnings++ == 0) (*cinfo->err->format_message)(cinfo, errors->message);
}

// The decoded part of a JPEG: rows [top, top + height) and columns [left, left + width) of the
// image scaled down by `scale`.
struct JpegPart {
  int scale = 1;
  int left = 0;
  int top = 0;
  int width = 0;
  int height = 0;
  int full_width = 0;
  int full_height = 0;
};

// A row of CMYK as libjpeg gives it to RGB, as PIL does: its JPEG reader takes every CMYK JPEG
// as Adobe's (inverted: 255 is no ink), and its CMYK -> RGB is (255 - K) - C (255 - K) / 255
// per channel, with its rounding (MULDIV255).
void cmyk_to_rgb(const uint8_t* cmyk, uint8_t* rgb, int width) {
  auto muldiv255 = [](int a, int b) {
    const int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
  };
  for (int x = 0; x < width; ++x, cmyk += 4, rgb += 3) {
    const int nk = cmyk[3];  // 255 - K after the inversion
    for (int c = 0; c < 3; ++c) rgb[c] = static_cast<uint8_t>(nk - muldiv255(255 - cmyk[c], nk));
  }
}

// Decodes the JPEG's rows [first, last) and columns [from, to) (in the scaled image; columns
// widened to whole iMCUs) into `out`, or with `header_only` reads its size into part->full_*.
// Returns false with `message` set on an error.
bool jpeg_decode(const uint8_t* data, size_t size, int scale, double from, double to, double first,
                 double last, JpegPart* part, std::vector<uint8_t>* out, char* message,
                 bool header_only = false) {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
  cinfo.err = jpeg_std_error(&errors.manager);
  errors.manager.error_exit = jpeg_fail;
  errors.manager.emit_message = jpeg_warn;
  errors.warnings = 0;
  errors.message[0] = '\0';
  if (setjmp(errors.jump)) {
    std::strncpy(message, errors.message, JMSG_LENGTH_MAX);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (header_only) {
    part->full_width = static_cast<int>(cinfo.image_width);
    part->full_height = static_cast<int>(cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    return true;
  }
  // CMYK and YCCK JPEGs (Photoshop's; ImageNet has some) come out as CMYK (libjpeg turns YCCK
  // into it) and are converted below as PIL does.
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = static_cast<unsigned>(scale);
  cinfo.dct_method = JDCT_ISLOW;
  jpeg_start_decompress(&cinfo);
  part->scale = scale;
  part->full_width = static_cast<int>(cinfo.output_width);
  part->full_height = static_cast<int>(cinfo.output_height);
  JDIMENSION left = static_cast<JDIMENSION>(std::max(0.0, std::floor(from)));
  JDIMENSION right = static_cast<JDIMENSION>(
      std::min<double>(cinfo.output_width, std::ceil(std::max(to, from + 1))));
  if (left > 0 || right < cinfo.output_width) {
    JDIMENSION width = right - left;
    jpeg_crop_scanline(&cinfo, &left, &width);
    right = left + width;
  }
  part->left = static_cast<int>(left);
  part->width = static_cast<int>(cinfo.output_width);
  const JDIMENSION top = static_cast<JDIMENSION>(std::max(0.0, std::floor(first)));
  const JDIMENSION bottom = static_cast<JDIMENSION>(
      std::min<double>(cinfo.output_height, std::ceil(std::max(last, first + 1))));
  if (top > 0) jpeg_skip_scanlines(&cinfo, top);
  part->top = static_cast<int>(cinfo.output_scanline);
  part->height = static_cast<int>(bottom - cinfo.output_scanline);
  out->resize(static_cast<size_t>(part->width) * part->height * 3);
  std::vector<uint8_t> four(cmyk ? static_cast<size_t>(part->width) * 4 : 0);
  while (cinfo.output_scanline < bottom) {
    uint8_t* rgb =
        out->data() + static_cast<size_t>(cinfo.output_scanline - part->top) * part->width * 3;
    JSAMPROW row = cmyk ? four.data() : rgb;
    jpeg_read_scanlines(&cinfo, &row, 1);
    if (cmyk) cmyk_to_rgb(four.data(), rgb, part->width);
  }
  if (cinfo.output_scanline < cinfo.output_height) {
    jpeg_abort_decompress(&cinfo);
  } else {
    jpeg_finish_decompress(&cinfo);
  }
  jpeg_destroy_decompress(&cinfo);
  if (errors.warnings > 0) {
    std::strncpy(message, errors.message, JMSG_LENGTH_MAX);
    return false;
  }
  return true;
}

Image decode_png(const uint8_t* data, size_t size, const std::string& origin) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  DTRAIN_CHECK_INPUT(png_image_begin_read_from_memory(&png, data, size) != 0, origin,
                     ": not a readable PNG (", png.message, ")");
  png.format = PNG_FORMAT_RGB;
  Image image;
  image.width = static_cast<int>(png.width);
  image.height = static_cast<int>(png.height);
  image.rgb.resize(PNG_IMAGE_SIZE(png));
  const int ok = png_image_finish_read(&png, nullptr, image.rgb.data(), 0, nullptr);
  const std::string problem = png.message;
  png_image_free(&png);
  DTRAIN_CHECK_INPUT(ok != 0, origin, ": a damaged PNG (", problem, ")");
  return image;
}

// PIL's resampling weights (Imaging/Resample.c, the bilinear "triangle" filter with its support
// widened by the scale when shrinking: antialiased) for `out` outputs covering [start, start +
// length) of an axis of `in` pixels.
struct Taps {
  std::vector<int> first;
  std::vector<int> count;
  std::vector<float> weights;  // out x max_taps
  int max_taps = 0;
};

Taps taps(double start, double length, int in, int out) {
  const double scale = length / out;
  const double filter_scale = std::max(scale, 1.0);
  const double support = 1.0 * filter_scale;
  Taps t;
  t.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out);
  t.count.resize(out);
  t.weights.assign(static_cast<size_t>(out) * t.max_taps, 0.0f);
  for (int o = 0; o < out; ++o) {
    const double center = start + (o + 0.5) * scale;
    int lo = static_cast<int>(std::floor(center - support + 0.5));
    int hi = static_cast<int>(std::floor(center + support + 0.5));
    lo = std::max(lo, 0);
    hi = std::min(hi, in);
    hi = std::max(hi, lo + 1);
    if (hi > in) {
      lo = in - 1;
      hi = in;
    }
    const int n = std::min(hi - lo, t.max_taps);
    double total = 0;
    float* w = &t.weights[static_cast<size_t>(o) * t.max_taps];
    for (int k = 0; k < n; ++k) {
      const double x = (lo + k - center + 0.5) / filter_scale;
      const double value = std::max(0.0, 1.0 - std::abs(x));
      w[k] = static_cast<float>(value);
      total += value;
    }
    for (int k = 0; k < n; ++k) w[k] = total > 0 ? static_cast<float>(w[k] / total) : 1.0f / n;
    t.first[o] = lo;
    t.count[o] = n;
  }
  return t;
}

inline float to_byte(float value) {
  return static_cast<float>(static_cast<int>(std::min(255.0f, std::max(0.0f, value)) + 0.5f));
}

// Resizes `region` of an RGB buffer (width x height) into size x size, flipped, normalized CHW.
void resize_rgb(const uint8_t* rgb, int width, int height, const Region& region, int size,
                bool flip, const Normalize& normalize, float* out) {
  const Taps across = taps(region.x, region.width, width, size);
  const Taps down = taps(region.y, region.height, height, size);
  int row_lo = height;
  int row_hi = 0;
  for (int o = 0; o < size; ++o) {
    row_lo = std::min(row_lo, down.first[o]);
    row_hi = std::max(row_hi, down.first[o] + down.count[o]);
  }
  // Horizontal pass over the rows the vertical pass reads: (rows x size x 3) floats.
  const int rows = row_hi - row_lo;
  std::vector<float> middle(static_cast<size_t>(rows) * size * 3);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* in = rgb + static_cast<size_t>(r + row_lo) * width * 3;
    float* m = &middle[static_cast<size_t>(r) * size * 3];
    for (int o = 0; o < size; ++o) {
      const float* w = &across.weights[static_cast<size_t>(o) * across.max_taps];
      const uint8_t* p = in + static_cast<size_t>(across.first[o]) * 3;
      float c0 = 0, c1 = 0, c2 = 0;
      for (int k = 0; k < across.count[o]; ++k) {
        c0 += w[k] * p[3 * k];
        c1 += w[k] * p[3 * k + 1];
        c2 += w[k] * p[3 * k + 2];
      }
      const int at = flip ? size - 1 - o : o;
      m[3 * at] = c0;
      m[3 * at + 1] = c1;
      m[3 * at + 2] = c2;
    }
  }
  const size_t plane = static_cast<size_t>(size) * size;
  float scale[3];
  float shift[3];
  for (int c = 0; c < 3; ++c) {
    scale[c] = 1.0f / (255.0f * normalize.std[c]);
    shift[c] = -normalize.mean[c] / normalize.std[c];
  }
  // Vertical pass a whole row at a time (contiguous: the compiler vectorizes it).
  const int width3 = size * 3;
  std::vector<float> acc(static_cast<size_t>(width3));
  for (int o = 0; o < size; ++o) {
    const float* w = &down.weights[static_cast<size_t>(o) * down.max_taps];
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < down.count[o]; ++k) {
      const float* m = &middle[static_cast<size_t>(down.first[o] - row_lo + k) * width3];
      const float wk = w[k];
      float* a = acc.data();
      for (int i = 0; i < width3; ++i) a[i] += wk * m[i];
    }
    // PIL rounds to 8 bits before ToTensor: so do we (clamped, then + 0.5 truncated: no libm
    // call per value).
    float* row0 = out + static_cast<size_t>(o) * size;
    for (int x = 0; x < size; ++x) {
      row0[x] = to_byte(acc[3 * x]) * scale[0] + shift[0];
      row0[plane + x] = to_byte(acc[3 * x + 1]) * scale[1] + shift[1];
      row0[2 * plane + x] = to_byte(acc[3 * x + 2]) * scale[2] + shift[2];
    }
  }
}

}  // namespace

void image_size(const uint8_t* data, size_t size, const std::string& origin, int* width,
                int* height) {
  if (is_jpeg(data, size)) {
    char message[JMSG_LENGTH_MAX] = {0};
    JpegPart part;
    DTRAIN_CHECK_INPUT(jpeg_decode(data, size, 1, 0, 0, 0, 0, &part, nullptr, message, true),
                       origin, ": a damaged JPEG (", message, ")");
    *width = part.full_width;
    *height = part.full_height;
  } else if (is_png(data, size)) {
    png_image png;
    std::memset(&png, 0, sizeof(png));
    png.version = PNG_IMAGE_VERSION;
    const bool ok = png_image_begin_read_from_memory(&png, data, size) != 0;
    const std::string problem = png.message;
    *width = static_cast<int>(png.width);
    *height = static_cast<int>(png.height);
    png_image_free(&png);
    DTRAIN_CHECK_INPUT(ok, origin, ": a damaged PNG (", problem, ")");
  } else {
    DTRAIN_CHECK_INPUT(false, origin, ": not a JPEG or PNG image");
  }
  DTRAIN_CHECK_INPUT(*width > 0 && *height > 0, origin, ": an empty image");
}

Image decode_image(const uint8_t* data, size_t size, const std::string& origin) {
  if (is_png(data, size)) return decode_png(data, size, origin);
  DTRAIN_CHECK_INPUT(is_jpeg(data, size), origin, ": not a JPEG or PNG image");
  Image image;
  JpegPart part;
  char message[JMSG_LENGTH_MAX] = {0};
  DTRAIN_CHECK_INPUT(jpeg_decode(data, size, 1, 0, 1e9, 0, 1e9, &part, &image.rgb, message), origin,
                     ": a damaged JPEG (", message, ")");
  image.width = part.width;
  image.height = part.height;
  return image;
}

void crop_resize(const Image& image, const Region& region, int size, bool flip,
                 const Normalize& normalize, float* out) {
  resize_rgb(image.rgb.data(), image.width, image.height, region, size, flip, normalize, out);
}

void decode_crop_resize(const uint8_t* data, size_t bytes, const std::string& origin,
                        const Region& region, int size, bool flip, const Normalize& normalize,
                        float* out) {
  if (!is_jpeg(data, bytes)) {
    crop_resize(decode_image(data, bytes, origin), region, size, flip, normalize, out);
    return;
  }
  // The largest DCT scale that still leaves the region at least the output's size.
  int scale = 1;
  while (scale < 8 && region.width / (scale * 2) >= size && region.height / (scale * 2) >= size) {
    scale *= 2;
  }
  const double s = scale;
  const double margin = 2;  // the filter's reach past the region's edge, in scaled pixels
  JpegPart part;
  std::vector<uint8_t> rgb;
  char message[JMSG_LENGTH_MAX] = {0};
  DTRAIN_CHECK_INPUT(jpeg_decode(data, bytes, scale, region.x / s - margin,
                                 (region.x + region.width) / s + margin, region.y / s - margin,
                                 (region.y + region.height) / s + margin, &part, &rgb, message),
                     origin, ": a damaged JPEG (", message, ")");
  const Region local{region.x / s - part.left, region.y / s - part.top, region.width / s,
                     region.height / s};
  resize_rgb(rgb.data(), part.width, part.height, local, size, flip, normalize, out);
}

Region random_resized_crop(int width, int height, std::mt19937_64& random, double scale_min,
                           double scale_max) {
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(3.0 / 4.0);
  const double log_hi = std::log(4.0 / 3.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (scale_min + (scale_max - scale_min) * unit(random));
    const double ratio = std::exp(log_lo + (log_hi - log_lo) * unit(random));
    const int w = static_cast<int>(std::lround(std::sqrt(target * ratio)));
    const int h = static_cast<int>(std::lround(std::sqrt(target / ratio)));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      const int x = static_cast<int>(random() % static_cast<uint64_t>(width - w + 1));
      const int y = static_cast<int>(random() % static_cast<uint64_t>(height - h + 1));
      return {static_cast<double>(x), static_cast<double>(y), static_cast<double>(w),
              static_cast<double>(h)};
    }
  }
  // Fallback: the central crop at the nearest allowed ratio.
  const double in_ratio = static_cast<double>(width) / height;
  double w = width;
  double h = height;
  if (in_ratio < 3.0 / 4.0) {
    h = std::lround(w / (3.0 / 4.0));
  } else if (in_ratio > 4.0 / 3.0) {
    w = std::lround(h * (4.0 / 3.0));
  }
  return {std::floor((width - w) / 2), std::floor((height - h) / 2), w, h};
}

Region center_crop(int width, int height, int resize, int crop) {
  // The shorter side to `resize`, then `crop` x `crop` from the middle: in source pixels.
  const double scale = static_cast<double>(std::min(width, height)) / resize;
  const double side = std::min<double>(crop * scale, std::min(width, height));
  return {(width - side) / 2, (height - side) / 2, side, side};
}

std::string encode_jpeg(const Image& image, int quality, bool gray) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr errors;
  cinfo.err = jpeg_std_error(&errors);
  jpeg_create_compress(&cinfo);
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = static_cast<JDIMENSION>(image.width);
  cinfo.image_height = static_cast<JDIMENSION>(image.height);
  cinfo.input_components = gray ? 1 : 3;
  cinfo.in_color_space = gray ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  std::vector<uint8_t> row(static_cast<size_t>(image.width) * 3);
  while (cinfo.next_scanline < cinfo.image_height) {
    const uint8_t* src =
        image.rgb.data() + static_cast<size_t>(cinfo.next_scanline) * image.width * 3;
    if (gray) {
      for (int x = 0; x < image.width; ++x) row[x] = src[3 * x];
    } else {
      std::memcpy(row.data(), src, row.size());
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

}  // namespace dtrain::data::images
