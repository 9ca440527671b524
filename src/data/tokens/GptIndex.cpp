// Megatron's GPTDataset and BlendedDataset index construction, reproduced step for step (the
// test compares with a NumPy re-implementation of Megatron's Python and C++).
#include "dtrain/data/tokens/GptIndex.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>

#include "common/Files.h"
#include "dtrain/common/Error.h"

namespace dtrain::data::tokens {

uint64_t NumpyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (static_cast<uint64_t>(engine_()) & mask)) > max) {
    }
  } else {
    auto next64 = [this] {
      const uint64_t high = engine_();
      return (high << 32) | static_cast<uint64_t>(engine_());
    };
    while ((value = (next64() & mask)) > max) {
    }
  }
  return value;
}

namespace {

// gpt_dataset.py's _build_document_index: the documents once per epoch, shuffled as one
// array (or the last epoch apart).
std::vector<int32_t> document_index(const std::vector<int32_t>& documents, int64_t epochs,
                                    NumpyRandomState& random, bool separate_last) {
  if (!separate_last || epochs == 1) {
    std::vector<int32_t> index;
    index.reserve(documents.size() * epochs);
    for (int64_t e = 0; e < epochs; ++e)
      index.insert(index.end(), documents.begin(), documents.end());
    random.shuffle(index);
    return index;
  }
  std::vector<int32_t> first = document_index(documents, epochs - 1, random, false);
  std::vector<int32_t> last = document_index(documents, 1, random, false);
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

// gpt_dataset.py's _build_shuffle_index.
std::vector<int64_t> shuffle_index(int64_t first, int64_t total, NumpyRandomState& random) {
  std::vector<int64_t> head(first);
  std::iota(head.begin(), head.end(), 0);
  random.shuffle(head);
  if (first == total) return head;
  std::vector<int64_t> tail(total - first);
  std::iota(tail.begin(), tail.end(), first);
  random.shuffle(tail);
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

}  // namespace

GptIndex build_gpt_index(const std::vector<int32_t>& lengths, const std::vector<int32_t>& documents,
                         const GptIndexOptions& options) {
  const int64_t context = options.context;
  DTRAIN_CHECK(context > 1, "a GPT index needs a context above 1, got ", context);
  constexpr int64_t kExtra = 1;  // add_extra_token_to_sequence: the last target
  int64_t tokens_per_epoch = 0;
  for (int32_t d : documents) tokens_per_epoch += lengths[d];
  DTRAIN_CHECK_INPUT(tokens_per_epoch >= context + kExtra, "a split of ", tokens_per_epoch,
                     " tokens is shorter than one sample of ", context, " tokens and its target");
  int64_t epochs = 1;
  if (options.samples > 0) {
    const int64_t wanted = options.samples * context + kExtra;
    for (int64_t tokens = tokens_per_epoch; tokens < wanted; tokens += tokens_per_epoch) ++epochs;
  }
  bool separate_last = false;
  if (epochs > 1) {
    const int64_t before_last = ((epochs - 1) * tokens_per_epoch - kExtra) / context;
    const int64_t from_last = options.samples - before_last;
    const int64_t per_epoch = (tokens_per_epoch - kExtra) / context;
    DTRAIN_CHECK(from_last >= 0 && from_last <= per_epoch + 1, "GPT index: bad epoch split");
    separate_last = from_last < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }
  NumpyRandomState random(options.seed);
  GptIndex index;
  index.epochs = epochs;
  index.documents = document_index(documents, epochs, random, separate_last);

  // helpers.cpp's build_sample_idx (drop_last_partial_sequence).
  const int64_t count = (epochs * tokens_per_epoch - kExtra) / context;
  index.samples.resize(2 * (count + 1));
  int64_t position = 0;
  int64_t offset = 0;
  index.samples[0] = 0;
  index.samples[1] = 0;
  const int64_t positions = static_cast<int64_t>(index.documents.size());
  for (int64_t s = 1; s <= count; ++s) {
    int64_t remaining = context + kExtra;
    while (remaining != 0) {
      const int64_t length = lengths[index.documents[position]] - offset;
      remaining -= length;
      if (remaining <= 0) {
        offset += remaining + length - kExtra;
        remaining = 0;
      } else {
        if (position == positions - 1) {
          DTRAIN_CHECK(s == count, "GPT index: ran out of documents at sample ", s);
          offset = lengths[index.documents[position]] - kExtra;
          break;
        }
        ++position;
        offset = 0;
      }
    }
    index.samples[2 * s] = position;
    index.samples[2 * s + 1] = offset;
  }
  const int64_t first =
      separate_last ? ((epochs - 1) * tokens_per_epoch - kExtra) / context : count;
  index.shuffle = shuffle_index(first, count, random);
  return index;
}

std::vector<int64_t> blend_component_sizes(const std::vector<double>& weights, int64_t size) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> sizes;
  for (double w : weights) {
    const double share = std::ceil(static_cast<double>(size) * (w / total));
    sizes.push_back(static_cast<int64_t>(std::ceil(share * 1.005)));
  }
  return sizes;
}

void build_blend_index(const std::vector<double>& weights, int64_t size,
                       std::vector<int16_t>& dataset_index,
                       std::vector<int64_t>& dataset_sample_index) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<double> normalized;
  for (double w : weights) normalized.push_back(w / total);
  std::vector<int64_t> current(weights.size(), 0);
  dataset_index.resize(size);
  dataset_sample_index.resize(size);
  for (int64_t s = 0; s < size; ++s) {
    const double at = std::max(static_cast<double>(s), 1.0);
    size_t best = 0;
    double best_error = normalized[0] * at - static_cast<double>(current[0]);
    for (size_t d = 1; d < normalized.size(); ++d) {
      const double error = normalized[d] * at - static_cast<double>(current[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[s] = static_cast<int16_t>(best);
    dataset_sample_index[s] = current[best]++;
  }
}

void save_npy(const std::string& path, const void* data, const std::string& dtype,
              const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t elements = 1;
  for (int64_t d : shape) {
    dims += concat(d, shape.size() == 1 ? "," : ", ");
    elements *= d;
  }
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header =
      concat("{'descr': '", dtype, "', 'fortran_order': False, 'shape': (", dims, "), }");
  // Magic (6) + version (2) + length (2) + header + '\n', padded to a multiple of 64.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.append(reinterpret_cast<const char*>(&length), 2);
  out += header;
  const int64_t item = dtype.back() - '0';
  out.append(static_cast<const char*>(data), static_cast<size_t>(elements * item));
  write_file_atomically(path, out.data(), out.size());
}

namespace {

// Opens a C-order .npy file of `dtype`, leaving `in` at its data; its shape and byte count out.
bool open_npy(std::ifstream& in, const std::string& dtype, std::vector<int64_t>& shape,
              int64_t& bytes) {
  if (!in) return false;
  char magic[10];
  if (!in.read(magic, 10) || std::memcmp(magic, "\x93NUMPY\x01\x00", 8) != 0) return false;
  uint16_t length;
  std::memcpy(&length, magic + 8, 2);
  std::string header(length, '\0');
  if (!in.read(header.data(), length)) return false;
  if (header.find(concat("'descr': '", dtype, "'")) == std::string::npos ||
      header.find("'fortran_order': False") == std::string::npos) {
    return false;
  }
  const size_t open = header.find("'shape': (");
  if (open == std::string::npos) return false;
  const size_t close = header.find(')', open);
  shape.clear();
  std::string dims = header.substr(open + 10, close - open - 10);
  int64_t elements = 1;
  size_t at = 0;
  while (at < dims.size()) {
    const size_t comma = dims.find(',', at);
    const std::string part = dims.substr(at, comma == std::string::npos ? comma : comma - at);
    if (part.find_first_of("0123456789") != std::string::npos) {
      shape.push_back(std::stoll(part));
      elements *= shape.back();
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  bytes = elements * (dtype.back() - '0');
  return true;
}

// Reads the data straight into `out` (a resume opens indices of many millions of samples).
template <typename T>
bool load_vector(const std::string& path, const std::string& dtype, size_t rank,
                 std::vector<T>& out) {
  std::ifstream in(path, std::ios::binary);
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  if (!open_npy(in, dtype, shape, bytes) || shape.size() != rank) return false;
  out.resize(static_cast<size_t>(bytes) / sizeof(T));
  if (!in.read(reinterpret_cast<char*>(out.data()), bytes)) return false;
  return in.peek() == std::char_traits<char>::eof();
}

}  // namespace

bool load_npy(const std::string& path, const std::string& dtype, std::vector<int64_t>& shape,
              std::vector<uint8_t>& data) {
  std::ifstream in(path, std::ios::binary);
  int64_t bytes = 0;
  if (!open_npy(in, dtype, shape, bytes)) return false;
  data.resize(static_cast<size_t>(bytes));
  if (!in.read(reinterpret_cast<char*>(data.data()), bytes)) return false;
  return in.peek() == std::char_traits<char>::eof();
}

GptIndex cached_gpt_index(const std::string& cache_dir, const std::string& description,
                          const std::vector<int32_t>& lengths,
                          const std::vector<int32_t>& documents, const GptIndexOptions& options) {
  const std::string full =
      concat(description, "; context ", options.context, "; samples ", options.samples, "; seed ",
             options.seed, "; documents ", documents.size(), "; index version 1");
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx",
                static_cast<unsigned long long>(std::hash<std::string>()(full)));
  const std::string base = concat(cache_dir, "/", hash, "-GPTDataset-");
  const std::string description_path = base + "description.txt";
  GptIndex index;
  {
    std::ifstream in(description_path);
    std::string saved((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in && saved == full &&
        load_vector(base + "document_index.npy", "<i4", 1, index.documents) &&
        load_vector(base + "sample_index.npy", "<i8", 2, index.samples) &&
        load_vector(base + "shuffle_index.npy", "<i8", 1, index.shuffle)) {
      return index;
    }
  }
  index = build_gpt_index(lengths, documents, options);
  std::error_code error;
  std::filesystem::create_directories(cache_dir, error);
  if (error) return index;  // a read-only data folder: built each time, not cached
  try {
    save_npy(base + "document_index.npy", index.documents.data(), "<i4",
             {static_cast<int64_t>(index.documents.size())});
    save_npy(base + "sample_index.npy", index.samples.data(), "<i8",
             {static_cast<int64_t>(index.samples.size() / 2), 2});
    save_npy(base + "shuffle_index.npy", index.shuffle.data(), "<i8", {index.size()});
    write_file_atomically(description_path, full.data(), full.size());
  } catch (const InputError&) {
    // Not writable: the index is rebuilt next time.
  }
  return index;
}

}  // namespace dtrain::data::tokens
