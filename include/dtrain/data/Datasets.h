// The data-set registry: each data set's name, what its examples are (a classification set's
// input shape and classes, or a language set's token windows), how its files are checked and
// how it is loaded. `dtrain train`, `dtrain fl` and the job's checks ask it; no code above
// data/ compares a data set's name (scripts/check-layers enforces it).
//
// Adding a data set: a function returning its DatasetInfo (a loader in data/) and one line in
// kBuiltIn (src/data/Datasets.cpp); code outside the library calls register_dataset.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/common/Flags.h"
#include "dtrain/common/OwnOptions.h"
#include "dtrain/data/Dataset.h"

namespace dtrain::data {

/// What a data set may read: the data flags of `dtrain train` and `dtrain fl`.
struct DataSource {
  /// What follows the set's name in --dataset NAME:ARGUMENT (tokens: the files).
  std::string argument;
  /// --data-dir ("" = the set's default location).
  std::string data_dir;
  /// --text-file: a language set's corpus (before --data-dir).
  std::string text_file;
  /// --synthetic-examples: a generated set's training examples.
  int64_t synthetic_examples = 8192;
  /// A language set's window length (the model's context).
  int64_t context = 0;
  /// A language set's share held out for validation (its end).
  double validation_fraction = 0.1;
  /// Passes over the data the run makes (--epochs), and the training samples it reads when it
  /// stops by steps instead (--max-steps x the global batch; 0: by epochs). A set that fixes
  /// its order over every epoch in advance (tokens) sizes it from these.
  int64_t epochs = 1;
  int64_t train_samples = 0;
  /// A language set's vocabulary (--vocab-size; 0: the set's own).
  int64_t vocabulary = 0;
  /// A token set's tokenizer.json (--tokenizer; "": the one beside its files, if any).
  std::string tokenizer;
  /// An image set's crop side (--image-size) and the damaged images it may leave out
  /// (--max-bad-samples).
  int64_t image_size = 224;
  int64_t max_bad_samples = 0;
  /// An image set's transforms (--augment): "imagenet" (training: random-resized-crop and flip;
  /// evaluation: resize to 256/224 of the side, center crop), "flip" (the whole image resized,
  /// flipped half the time in training) or "none" (the whole image resized, as it is).
  std::string augment = "imagenet";
  /// A generated set's seed: the training split draws from it, the test split from seed + 1.
  uint64_t seed = 0;
  /// The splits to load (a federated client needs one): a split not asked for stays empty.
  bool train = true;
  bool test = true;
  /// A registered set's own options (own.of<ItsOptions>()), set by its flags.
  OwnOptions own{};
};

/// A loaded data set.
struct LoadedData {
  TensorDataset train;
  TensorDataset test;
  /// Language sets: the tokenizer's vocabulary size and its saved form (what a checkpoint keeps
  /// for `dtrain generate`); 0 and "" otherwise.
  int64_t vocabulary = 0;
  std::string vocabulary_utf8;
  /// Or its tokenizer.json (a BPE tokenizer's; what `dtrain generate` decodes with).
  std::string tokenizer_json;
  /// One line saying what was read (rank 0 prints it); "" for nothing to say.
  std::string description;
};

struct DatasetInfo {
  std::string name;
  /// One line for --help.
  std::string summary;
  /// Windows of tokens trained by next-token prediction (a language model's set), rather than
  /// labelled examples.
  bool language = false;
  /// A language set's token ("character" for one token per character), for messages.
  std::string token_unit = "token";
  /// Classification sets: one example's shape and the number of classes.
  std::vector<int64_t> input_shape;
  int64_t classes = 0;
  /// Federated learning can partition it over clients (a classification set).
  bool federated = false;
  /// A set whose examples' shape or classes depend on its source (an image folder's classes,
  /// --image-size) sets them here; nullptr: input_shape and classes above hold for any source.
  std::function<void(const DataSource&, DatasetInfo&)> describe;
  /// Checks the source (files present and well-formed, values in range) before any rank
  /// starts, as cheaply as it can: InputError naming the flag or file. nullptr: load() is the
  /// check.
  std::function<void(const DataSource&)> check;
  /// Loads the splits asked for; refuses what check() refuses (it is called without it).
  std::function<LoadedData(const DataSource&)> load;
  /// The flags that set what it reads, as groups of DataSource's fields (sets that read the
  /// same fields list the same group: every language set's --validation-fraction). `dtrain
  /// train` and `dtrain fl` declare the groups of their sets from here.
  std::vector<FlagGroup<DataSource>> flags;
};

/// Declares the flag groups of the registered sets for which `keep` holds (each group once, in
/// the registry's order), bound to `source`'s fields.
void declare_data_flags(FlagSet& flags, DataSource& source,
                        const std::function<bool(const DatasetInfo&)>& keep);

/// NAME of --dataset NAME[:ARGUMENT], and the ARGUMENT ("" without one).
std::string dataset_name(const std::string& flag);
std::string dataset_argument(const std::string& flag);

/// Every registered data set, built-in ones first.
const std::deque<DatasetInfo>& datasets();
std::vector<std::string> dataset_names();
/// InputError naming the registered data sets for an unknown name (NAME:ARGUMENT is NAME's).
const DatasetInfo& dataset_info(const std::string& name);
/// The set's description for this source (describe() applied).
DatasetInfo dataset_info_for(const std::string& name, const DataSource& source);
/// Adds a data set (InputError when the name is taken); for code outside the library, before
/// it is used.
void register_dataset(DatasetInfo info);

/// The names of the sets for which `keep` holds, "a, b or c" (for messages and --help).
std::string dataset_names_where(const std::function<bool(const DatasetInfo&)>& keep);

/// Checks then loads the named set (InputError naming what is wrong).
LoadedData load_dataset(const std::string& name, const DataSource& source);

}  // namespace dtrain::data
