// Megatron-LM's GPTDataset indices, built the same way so that the same corpus, context and
// seed give the same samples in the same order (megatron/core/datasets/gpt_dataset.py and
// helpers.cpp):
// - the document index: the split's documents repeated once per epoch, shuffled (numpy's
//   RandomState(seed): Mersenne Twister and its Fisher-Yates shuffle, reproduced exactly);
// - the sample index: where each sample of context + 1 tokens starts (a position in the
//   document index and an offset in that document); documents are packed back to back;
// - the shuffle index: a permutation of the samples (the last epoch shuffled apart when it is
//   under 80% full, as Megatron does).
// And the blend of several corpora by weight (Megatron's build_blending_indices: each sample
// goes to the corpus furthest below its share).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace dtrain::data::tokens {

/// numpy.random.RandomState(seed)'s integer draws and shuffle (the legacy generator): MT19937
/// seeded by init_genrand, bounded draws by masked rejection.
class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : engine_(seed) {}
  /// A uniform integer in [0, max] (numpy's random_interval).
  uint64_t interval(uint64_t max);
  /// numpy's RandomState.shuffle of a 1-D array.
  template <typename T>
  void shuffle(std::vector<T>& values) {
    for (int64_t i = static_cast<int64_t>(values.size()) - 1; i >= 1; --i) {
      const uint64_t j = interval(static_cast<uint64_t>(i));
      std::swap(values[i], values[j]);
    }
  }

 private:
  std::mt19937 engine_;
};

struct GptIndexOptions {
  /// Tokens per sample (the model's context); each sample reads context + 1.
  int64_t context = 0;
  /// Samples wanted (0: one epoch); the epochs follow from it.
  int64_t samples = 0;
  uint32_t seed = 0;
  /// Megatron keeps a last partial sample in validation sets only when asked; never here.
};

struct GptIndex {
  std::vector<int32_t> documents;  ///< document index (ids into the corpus)
  std::vector<int64_t> samples;    ///< sample index: [n + 1][2] (position, offset), flattened
  std::vector<int64_t> shuffle;    ///< shuffle index
  int64_t epochs = 0;
  int64_t size() const { return static_cast<int64_t>(shuffle.size()); }
};

/// Builds the indices over `documents` (the split's document ids) whose lengths are
/// `lengths[id]`. InputError when the split is shorter than one sample.
GptIndex build_gpt_index(const std::vector<int32_t>& lengths, const std::vector<int32_t>& documents,
                         const GptIndexOptions& options);

/// Megatron's per-corpus sample counts for a blend of `size` samples (weights normalized, a
/// surplus of 0.5%): ceil(ceil(size * w) * 1.005).
std::vector<int64_t> blend_component_sizes(const std::vector<double>& weights, int64_t size);

/// For each of `size` samples: which corpus (dataset_index) and its sample there
/// (dataset_sample_index).
void build_blend_index(const std::vector<double>& weights, int64_t size,
                       std::vector<int16_t>& dataset_index,
                       std::vector<int64_t>& dataset_sample_index);

/// NumPy's .npy files (version 1.0, little-endian, C order) for the index caches: numpy.load
/// reads them, and so does a user. `dtype` is "<i2", "<i4" or "<i8".
void save_npy(const std::string& path, const void* data, const std::string& dtype,
              const std::vector<int64_t>& shape);
/// Reads a .npy written by save_npy (or numpy) of the given dtype; false when the file is
/// missing or not of that kind (the cache is then rebuilt).
bool load_npy(const std::string& path, const std::string& dtype, std::vector<int64_t>& shape,
              std::vector<uint8_t>& data);

/// The index built once and kept in `cache_dir` (files named from a hash of `description`,
/// which must name everything the index depends on); the cache is used when present. Writing
/// is atomic, so ranks building it at once all read a complete one.
GptIndex cached_gpt_index(const std::string& cache_dir, const std::string& description,
                          const std::vector<int32_t>& lengths,
                          const std::vector<int32_t>& documents, const GptIndexOptions& options);

}  // namespace dtrain::data::tokens
