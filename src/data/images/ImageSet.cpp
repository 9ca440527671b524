// Image folders and WebDataset tar shards as a data set (registered at load as `images`), and the
// writer of tar shards.
#include "dtrain/data/images/ImageSet.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>

#include "common/Files.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/data/images/Image.h"
#include "dtrain/data/tokens/TokenFiles.h"

namespace dtrain::data::images {

namespace fs = std::filesystem;

namespace {

bool image_name(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  for (const char* ext : {".jpg", ".jpeg", ".png"}) {
    const size_t n = std::strlen(ext);
    if (lower.size() >= n && lower.compare(lower.size() - n, n, ext) == 0) return true;
  }
  return false;
}

std::vector<std::string> split_on_comma(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = text.find(',', start);
    parts.push_back(text.substr(start, at == std::string::npos ? at : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

// One image: a whole file, or a member of a mapped tar shard.
struct Item {
  int32_t file = 0;
  int64_t offset = 0;
  int64_t size = -1;  // -1: the whole file
  int32_t label = 0;
  std::string name;
};

// The images of one split.
struct Split {
  std::vector<std::string> files;
  std::vector<std::shared_ptr<tokens::MappedFile>> tars;  // by file, null for plain files
  std::vector<Item> items;
  std::vector<std::string> classes;
  // Samples found damaged while scanning (a tar member whose header fails its checksum, an
  // entry that cannot be read): each named, counted with the damaged images (drop_bad).
  std::vector<std::string> damaged;
  // What the summary line adds ("; class ids ... are not contiguous").
  std::string note;
};

// A tar header's checksum: the sum of its 512 bytes, the checksum field's 8 counted as spaces.
bool tar_checksum_ok(const uint8_t* header, int64_t recorded) {
  int64_t sum = 0;
  for (int i = 0; i < 512; ++i) sum += (i >= 148 && i < 156) ? ' ' : header[i];
  return recorded == sum;
}

int64_t tar_octal(const uint8_t* field, int length) {
  int64_t value = 0;
  for (int i = 0; i < length && field[i] != 0 && field[i] != ' '; ++i) {
    if (field[i] < '0' || field[i] > '7') return -1;
    value = value * 8 + (field[i] - '0');
  }
  return value;
}

// A tar's regular files (ustar; pax and GNU long-name records skipped) grouped by WebDataset's
// key (the path up to the first dot of its basename): KEY.jpg/.jpeg/.png and KEY.cls.
void read_tar(Split& split, const std::string& path) {
  auto tar = std::make_shared<tokens::MappedFile>(path);
  const int32_t file = static_cast<int32_t>(split.files.size());
  split.files.push_back(path);
  split.tars.push_back(tar);
  struct Member {
    int64_t offset = -1;
    int64_t size = 0;
    std::string name;
    int64_t label = -1;
  };
  std::map<std::string, Member> by_key;
  int64_t at = 0;
  while (at + 512 <= tar->size()) {
    const uint8_t* header = tar->data() + at;
    if (header[0] == 0) break;  // the end-of-archive blocks
    const int64_t size = tar_octal(header + 124, 12);
    DTRAIN_CHECK_INPUT(size >= 0 && at + 512 + size <= tar->size(), path,
                       ": a damaged tar (the member at byte ", at, " runs past the end)");
    if (!tar_checksum_ok(header, tar_octal(header + 148, 8))) {
      // Its name, size or type may be wrong: the member is a damaged sample, and the next
      // header is looked for where its size says (checked against the end above).
      split.damaged.push_back(concat(path, ": the tar member header at byte ", at,
                                     " is damaged (its checksum does not match)"));
      at += 512 + (size + 511) / 512 * 512;
      continue;
    }
    const char type = static_cast<char>(header[156]);
    std::string name(reinterpret_cast<const char*>(header),
                     strnlen(reinterpret_cast<const char*>(header), 100));
    if (std::memcmp(header + 257, "ustar", 5) == 0 && header[345] != 0) {
      name = std::string(reinterpret_cast<const char*>(header + 345),
                         strnlen(reinterpret_cast<const char*>(header + 345), 155)) +
             "/" + name;
    }
    if (type == '0' || type == '\0') {
      const size_t slash = name.rfind('/');
      const size_t dot = name.find('.', slash == std::string::npos ? 0 : slash + 1);
      if (dot != std::string::npos) {
        const std::string key = name.substr(0, dot);
        const std::string ext = name.substr(dot + 1);
        Member& m = by_key[key];
        if (image_name("." + ext)) {
          m.offset = at + 512;
          m.size = size;
          m.name = path + ":" + name;
        } else if (ext == "cls") {
          const std::string text(reinterpret_cast<const char*>(header + 512), size);
          char* end = nullptr;
          const long value = std::strtol(text.c_str(), &end, 10);
          DTRAIN_CHECK_INPUT(end != text.c_str() && value >= 0 && value < (1 << 30), path, ":",
                             name, ": the class is not a whole number >= 0");
          m.label = value;
        }
      }
    }
    at += 512 + (size + 511) / 512 * 512;
  }
  int64_t found = 0;
  for (auto& [key, m] : by_key) {
    if (m.offset < 0) continue;
    DTRAIN_CHECK_INPUT(m.label >= 0, path, ": ", key, " has an image but no ", key,
                       ".cls (its class)");
    split.items.push_back({file, m.offset, m.size, static_cast<int32_t>(m.label), m.name});
    ++found;
  }
  DTRAIN_CHECK_INPUT(found > 0, path, ": a tar shard with no images (KEY.jpg/.png + KEY.cls)");
}

// A folder of class folders, or a folder (or list) of tar shards.
Split scan_split(const std::string& path, const std::vector<std::string>* classes) {
  Split split;
  std::error_code error;
  DTRAIN_CHECK_INPUT(fs::is_directory(path, error), "images: ", path, " is not a folder");
  std::vector<std::string> tars;
  std::vector<std::string> folders;
  for (const auto& entry : fs::directory_iterator(path, error)) {
    const std::string name = entry.path().string();
    std::error_code status;
    const bool file = entry.is_regular_file(status);
    // (A symbolic link that loops or leads nowhere: what it is cannot be told.)
    DTRAIN_CHECK_INPUT(!status, "images: ", name, " cannot be read (", status.message(), ")");
    if (file && name.size() > 4 && name.compare(name.size() - 4, 4, ".tar") == 0) {
      tars.push_back(name);
    } else if (entry.is_directory(status)) {
      folders.push_back(entry.path().filename().string());
    }
  }
  std::sort(tars.begin(), tars.end());
  std::sort(folders.begin(), folders.end());
  if (!tars.empty()) {
    for (const auto& tar : tars) read_tar(split, tar);
    int32_t largest = 0;
    std::vector<bool> used;
    for (const auto& item : split.items) {
      largest = std::max(largest, item.label);
      if (used.size() <= static_cast<size_t>(item.label)) used.resize(item.label + 1, false);
      used[item.label] = true;
    }
    for (int32_t c = 0; c <= largest; ++c) split.classes.push_back(std::to_string(c));
    int64_t missing = 0;
    int32_t first_missing = -1;
    for (int32_t c = 0; c <= largest; ++c) {
      if (used[c]) continue;
      if (missing++ == 0) first_missing = c;
    }
    if (missing > 0 && classes == nullptr) {
      // A .cls of 97 among classes 0-2 makes 98 outputs, 95 of them never trained: say so.
      split.note = concat("; warning: the .cls class ids are not contiguous (", missing, " of 0-",
                          largest, " have no images, the first ", first_missing,
                          "): the model gets ", largest + 1, " outputs");
      std::fprintf(stderr,
                   "dtrain: warning: %s: the .cls class ids are not contiguous: %lld of "
                   "0-%d have no images (the first: %d), yet the model gets %d outputs\n",
                   path.c_str(), static_cast<long long>(missing), largest, first_missing,
                   largest + 1);
    }
    return split;
  }
  DTRAIN_CHECK_INPUT(!folders.empty(), "images: ", path,
                     " holds neither class folders nor .tar shards");
  split.classes = classes ? *classes : folders;
  for (const auto& folder : folders) {
    const auto known = std::find(split.classes.begin(), split.classes.end(), folder);
    DTRAIN_CHECK_INPUT(known != split.classes.end(), "images: ", path, "/", folder,
                       " is a class the training split does not have");
    const int32_t label = static_cast<int32_t>(known - split.classes.begin());
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(fs::path(path) / folder, error)) {
      if (!image_name(entry.path().filename().string())) continue;
      std::error_code status;
      const bool file = entry.is_regular_file(status);
      if (status) {
        // A symbolic link that loops or leads nowhere, a file that cannot be looked at: a
        // damaged sample, named and counted.
        split.damaged.push_back(
            concat(entry.path().string(), ": cannot be read (", status.message(), ")"));
      } else if (file) {
        files.push_back(entry.path().string());
      }
    }
    DTRAIN_CHECK_INPUT(!files.empty(), "images: ", path, "/", folder,
                       " is an empty class folder (no .jpg, .jpeg or .png files that can be "
                       "read)");
    std::sort(files.begin(), files.end());
    for (auto& file : files) {
      split.items.push_back({static_cast<int32_t>(split.files.size()), 0, -1, label, file});
      split.files.push_back(std::move(file));
      split.tars.push_back(nullptr);
    }
  }
  return split;
}

// A whole file, read at once (its size first), or its first `limit` bytes.
std::string read_bytes(const std::string& path, size_t limit = SIZE_MAX) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK_INPUT(fd >= 0, "cannot read ", path, ": ", std::strerror(errno));
  struct stat info {};
  std::string bytes;
  if (::fstat(fd, &info) == 0) bytes.resize(std::min(static_cast<size_t>(info.st_size), limit));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (got <= 0) break;
    done += static_cast<size_t>(got);
  }
  ::close(fd);
  DTRAIN_CHECK_INPUT(done == bytes.size(), "cannot read ", path, ": short read");
  return bytes;
}

class ImageSource : public SampleSource {
 public:
  ImageSource(std::shared_ptr<Split> split, bool train, int size, uint64_t seed,
              const std::string& augment)
      : split_(std::move(split)),
        train_(train),
        imagenet_(augment == "imagenet"),
        flip_(train && augment != "none"),
        size_(size),
        seed_(seed) {}

  int64_t size() const override { return static_cast<int64_t>(split_->items.size()); }
  std::vector<int64_t> input_shape() const override { return {3, size_, size_}; }
  void set_epoch(int64_t epoch) const override { epoch_ = epoch; }
  at::Tensor labels() const override {
    at::Tensor labels = at::empty({size()}, at::kLong);
    int64_t* out = labels.data_ptr<int64_t>();
    for (const Item& item : split_->items) *out++ = item.label;
    return labels;
  }

  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t n = static_cast<int64_t>(indices.size());
    at::Tensor inputs = at::empty({n, 3, size_, size_}, at::kFloat);
    at::Tensor targets = at::empty({n}, at::kLong);
    float* out = inputs.data_ptr<float>();
    int64_t* labels = targets.data_ptr<int64_t>();
    const int64_t per_image = 3LL * size_ * size_;
    const int64_t epoch = epoch_;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::string buffer;
      for (int64_t b = begin; b < end; ++b) {
        const Item& item = split_->items[indices[b]];
        labels[b] = item.label;
        const uint8_t* data;
        size_t bytes;
        if (item.size >= 0) {
          data = split_->tars[item.file]->data() + item.offset;
          bytes = static_cast<size_t>(item.size);
        } else {
          buffer = read_bytes(split_->files[item.file]);
          data = reinterpret_cast<const uint8_t*>(buffer.data());
          bytes = buffer.size();
        }
        int width = 0;
        int height = 0;
        image_size(data, bytes, item.name, &width, &height);
        Region region{0, 0, static_cast<double>(width), static_cast<double>(height)};
        bool flip = false;
        if (train_ && flip_) {
          // Each example's own draw per epoch: the same at any world size and after a resume.
          std::seed_seq seq{seed_, static_cast<uint64_t>(epoch), static_cast<uint64_t>(indices[b])};
          std::mt19937_64 random(seq);
          if (imagenet_) region = random_resized_crop(width, height, random);
          flip = (random() & 1) != 0;
        } else if (imagenet_) {
          region = center_crop(width, height, static_cast<int>(std::lround(size_ * 256.0 / 224.0)),
                               size_);
        }
        decode_crop_resize(data, bytes, item.name, region, size_, flip, normalize_,
                           out + b * per_image);
      }
    });
    return {inputs, targets};
  }

 private:
  std::shared_ptr<Split> split_;
  bool train_;
  bool imagenet_;  // random-resized-crop (training) or center crop (evaluation)
  bool flip_;      // a random horizontal flip (training)
  int size_;
  uint64_t seed_;
  Normalize normalize_;
  mutable std::atomic<int64_t> epoch_{0};
};

// What the header check reads of each file first: a JPEG's frame header follows its JFIF/EXIF
// segments (a thumbnail can reach tens of KB), a PNG's IHDR comes first.
constexpr size_t kHeaderBytes = 64 << 10;

// Reads every image's header: damaged ones are named; up to max_bad are left out.
std::string drop_bad(Split& split, int64_t max_bad, const std::string& which) {
  const int64_t n = static_cast<int64_t>(split.items.size());
  std::vector<std::string> problems(n);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::string buffer;
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = split.items[i];
      try {
        const uint8_t* data;
        size_t bytes;
        if (item.size >= 0) {
          data = split.tars[item.file]->data() + item.offset;
          bytes = static_cast<size_t>(item.size);
        } else {
          // The header's part of the file (the whole file only when that is not enough: a
          // header behind large metadata): start-up does not read the data set.
          buffer = read_bytes(split.files[item.file], kHeaderBytes);
          data = reinterpret_cast<const uint8_t*>(buffer.data());
          bytes = buffer.size();
        }
        int width = 0;
        int height = 0;
        try {
          image_size(data, bytes, item.name, &width, &height);
        } catch (const InputError&) {
          if (item.size >= 0 || buffer.size() < kHeaderBytes) throw;
          buffer = read_bytes(split.files[item.file]);
          image_size(reinterpret_cast<const uint8_t*>(buffer.data()), buffer.size(), item.name,
                     &width, &height);
        }
      } catch (const InputError& e) {
        problems[i] = e.message();
      }
    }
  });
  std::vector<Item> kept;
  int64_t bad = static_cast<int64_t>(split.damaged.size());
  std::string first = bad > 0 ? split.damaged.front() : std::string();
  for (int64_t i = 0; i < n; ++i) {
    if (problems[i].empty()) {
      kept.push_back(std::move(split.items[i]));
    } else {
      if (bad++ == 0) first = problems[i];
    }
  }
  DTRAIN_CHECK_INPUT(bad <= max_bad, "images: ", bad, " damaged image", bad == 1 ? "" : "s",
                     " in the ", which, " split, more than --max-bad-samples ", max_bad,
                     "; the first: ", first);
  split.items = std::move(kept);
  DTRAIN_CHECK_INPUT(!split.items.empty(), "images: the ", which, " split has no images");
  return bad == 0 ? std::string()
                  : concat("; left out ", bad, " damaged ", which, " image", bad == 1 ? "" : "s",
                           " (the first: ", first, ")");
}

std::pair<std::string, std::string> split_paths(const std::string& spec) {
  DTRAIN_CHECK_INPUT(!spec.empty(),
                     "--dataset images needs its folder: images:ROOT (with "
                     "train/ and val/) or images:TRAIN,VAL");
  const auto parts = split_on_comma(spec);
  if (parts.size() == 2) return {parts[0], parts[1]};
  DTRAIN_CHECK_INPUT(parts.size() == 1, "--dataset images:", spec, ": give ROOT or TRAIN,VAL");
  fs::path root = fs::path(spec).lexically_normal();
  if (!root.has_filename()) root = root.parent_path();  // "DIR/train/"
  std::error_code error;
  if (!fs::is_directory(root / "train", error)) {
    // The split itself given as ROOT (images:DIR/train): say which form fits.
    const fs::path parent = root.parent_path();
    const std::string hint =
        fs::is_directory(root, error) && root.filename() == "train" &&
                fs::is_directory(parent / "val", error)
            ? concat(" (did you mean --dataset images:", parent.string(), "?)")
        : fs::is_directory(root, error)
            ? concat(
                  " (for a training folder of its own, give its validation folder too: "
                  "--dataset images:",
                  spec, ",VAL)")
            : std::string();
    DTRAIN_THROW(InputError, "--dataset images:", spec, ": ", (root / "train").string(),
                 " is not a folder: ROOT must hold train/ and val/ (in each a folder per class, "
                 "or .tar shards), or give the two folders as images:TRAIN,VAL",
                 hint);
  }
  return {(root / "train").string(), (root / "val").string()};
}

LoadedData load_images(const DataSource& source) {
  ImageSetOptions options;
  options.spec = source.argument;
  options.size = static_cast<int>(source.image_size);
  options.seed = source.seed;
  options.max_bad_samples = source.max_bad_samples;
  options.augment = source.augment;
  options.train = source.train;
  options.test = source.test;
  ImageSplits splits = load_image_splits(options);
  LoadedData data;
  data.train = std::move(splits.train);
  data.test = std::move(splits.test);
  data.description = std::move(splits.description);
  return data;
}

FlagGroup<DataSource> image_flags() {
  return {
      "images", [](FlagSet& flags, DataSource& source) {
        flags.add("--image-size", source.image_size,
                  "--dataset images: the side of the images the model sees");
        flags.add("--augment", source.augment,
                  "--dataset images: the transforms: imagenet (training: random-resized-crop and "
                  "flip; evaluation: resize to 256/224 of the size, center crop), flip (the whole "
                  "image resized, flipped half the time) or none (the whole image resized)");
        flags.add("--max-bad-samples", source.max_bad_samples,
                  "--dataset images: damaged images to name and leave out before training (more "
                  "stop it)");
      }};
}

DatasetInfo images_info() {
  DatasetInfo info;
  info.name = "images";
  info.summary =
      "labelled JPEG/PNG images of your own: images:ROOT with ROOT/train and ROOT/val, each a "
      "folder per class or WebDataset .tar shards (--image-size, --max-bad-samples)";
  info.input_shape = {3, 224, 224};
  info.classes = 2;
  info.describe = [](const DataSource& source, DatasetInfo& described) {
    described.input_shape = {3, source.image_size, source.image_size};
    described.classes = static_cast<int64_t>(image_classes(source.argument).size());
  };
  info.flags = {image_flags()};
  info.check = [](const DataSource& source) { load_images(source); };
  info.load = load_images;
  return info;
}

// Registered when the library loads (builds without libjpeg/libpng leave this file out).
const bool kRegistered = [] {
  register_dataset(images_info());
  return true;
}();

}  // namespace

std::vector<std::string> image_classes(const std::string& spec) {
  const auto [train, val] = split_paths(spec);
  std::error_code error;
  DTRAIN_CHECK_INPUT(fs::is_directory(train, error), "images: ", train, " is not a folder");
  std::vector<std::string> folders;
  bool tars = false;
  for (const auto& entry : fs::directory_iterator(train, error)) {
    if (entry.is_directory()) folders.push_back(entry.path().filename().string());
    tars = tars || entry.path().extension() == ".tar";
  }
  if (tars) return scan_split(train, nullptr).classes;
  std::sort(folders.begin(), folders.end());
  return folders;
}

ImageSplits load_image_splits(const ImageSetOptions& options) {
  DTRAIN_CHECK_INPUT(options.size >= 8 && options.size <= 4096,
                     "--image-size must be in [8, 4096], got ", options.size);
  DTRAIN_CHECK_INPUT(options.max_bad_samples >= 0, "--max-bad-samples must be >= 0");
  DTRAIN_CHECK_INPUT(
      options.augment == "imagenet" || options.augment == "flip" || options.augment == "none",
      "--augment must be imagenet, flip or none, got '", options.augment, "'");
  const auto [train_path, val_path] = split_paths(options.spec);
  auto train = std::make_shared<Split>(scan_split(train_path, nullptr));
  auto val = std::make_shared<Split>(scan_split(val_path, &train->classes));
  DTRAIN_CHECK_INPUT(train->classes.size() >= 2, "images: ", train_path,
                     " has one class; a classifier needs at least 2");
  std::string notes;
  if (options.train) notes += drop_bad(*train, options.max_bad_samples, "training");
  if (options.test) notes += drop_bad(*val, options.max_bad_samples, "validation");
  for (const auto& item : val->items) {
    DTRAIN_CHECK_INPUT(item.label < static_cast<int32_t>(train->classes.size()), item.name,
                       ": class ", item.label, " is not one of the training split's ",
                       train->classes.size());
  }
  ImageSplits splits;
  splits.classes = train->classes;
  splits.description = concat("images: ", train->items.size(), " for training (", train_path, "), ",
                              val->items.size(), " for validation (", val_path, "), ",
                              train->classes.size(), " classes, ", options.size, "x", options.size,
                              ", --augment ", options.augment, train->note, notes);
  if (options.train) {
    splits.train = TensorDataset::from_source(
        std::make_shared<ImageSource>(train, true, options.size, options.seed, options.augment),
        false);
  }
  if (options.test) {
    splits.test = TensorDataset::from_source(
        std::make_shared<ImageSource>(val, false, options.size, options.seed, options.augment),
        false);
  }
  return splits;
}

std::vector<std::string> write_image_shards(const std::string& folder, const std::string& prefix,
                                            int64_t shard_bytes, uint64_t seed) {
  DTRAIN_CHECK_INPUT(shard_bytes > 0, "--shard-bytes must be > 0");
  Split split = scan_split(folder, nullptr);
  DTRAIN_CHECK_INPUT(split.tars.empty() || !split.tars.front(), folder,
                     " already holds tar shards");
  std::mt19937_64 random(seed);
  std::shuffle(split.items.begin(), split.items.end(), random);
  const fs::path parent = fs::path(prefix).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  std::vector<std::string> written;
  std::string tar;
  auto member = [&tar](const std::string& name, const std::string& bytes) {
    DTRAIN_CHECK_INPUT(name.size() < 100, "a tar member name over 99 bytes: ", name);
    char header[512] = {0};
    std::memcpy(header, name.data(), name.size());
    std::snprintf(header + 100, 8, "%07o", 0644);
    std::snprintf(header + 108, 8, "%07o", 0);
    std::snprintf(header + 116, 8, "%07o", 0);
    std::snprintf(header + 124, 12, "%011llo", static_cast<unsigned long long>(bytes.size()));
    std::snprintf(header + 136, 12, "%011o", 0);
    header[156] = '0';
    std::memcpy(header + 257, "ustar", 6);
    std::memcpy(header + 263, "00", 2);
    std::memset(header + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < 512; ++i) sum += static_cast<unsigned char>(header[i]);
    std::snprintf(header + 148, 8, "%06o", sum);
    tar.append(header, 512);
    tar += bytes;
    tar.append((512 - bytes.size() % 512) % 512, '\0');
  };
  auto flush = [&] {
    if (tar.empty()) return;
    tar.append(1024, '\0');
    char name[32];
    std::snprintf(name, sizeof(name), "-%06zu.tar", written.size());
    write_file_atomically(prefix + name, tar.data(), tar.size());
    written.push_back(prefix + name);
    tar.clear();
  };
  int64_t key = 0;
  for (const Item& item : split.items) {
    const std::string bytes = read_bytes(split.files[item.file]);
    std::string ext = fs::path(split.files[item.file]).extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), ::tolower);
    char base[32];
    std::snprintf(base, sizeof(base), "%09lld", static_cast<long long>(key++));
    member(std::string(base) + (ext == ".png" ? ".png" : ".jpg"), bytes);
    member(std::string(base) + ".cls", std::to_string(item.label));
    if (static_cast<int64_t>(tar.size()) >= shard_bytes) flush();
  }
  flush();
  return written;
}

}  // namespace dtrain::data::images
