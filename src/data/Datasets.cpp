// The data-set registry and the built-in sets. Adding a built-in data set: a function returning
// its DatasetInfo and one line in kBuiltIn.
#include "dtrain/data/Datasets.h"

#include <algorithm>

#include "dtrain/common/Error.h"
#include "dtrain/common/Registry.h"
#include "dtrain/data/FashionMnist.h"
#include "dtrain/data/Text.h"
#include "dtrain/data/tokens/TokenDataset.h"

namespace dtrain::data {

namespace {

constexpr int64_t kImageClasses = 10;

// The flags of the built-in sets, by the fields they set (the image sets' are in images/);
// functions, as registration may run before this file's statics are made.
FlagGroup<DataSource> data_dir_flags() {
  return {"data-dir", [](FlagSet& flags, DataSource& source) {
            flags
                .add("--data-dir", source.data_dir,
                     "Fashion-MNIST IDX files (default: $DTRAIN_DATA_DIR, else Debian's "
                     "/usr/share/datasets/fashion-mnist)")
                .show_default = false;
          }};
}

FlagGroup<DataSource> synthetic_flags() {
  return {"synthetic", [](FlagSet& flags, DataSource& source) {
            flags.add("--synthetic-examples", source.synthetic_examples,
                      "--dataset synthetic: training examples");
          }};
}

FlagGroup<DataSource> text_file_flags() {
  return {"text", [](FlagSet& flags, DataSource& source) {
            flags
                .add("--text-file", source.text_file,
                     "--dataset text: a UTF-8 text file or a directory of them (default "
                     "--data-dir, else "
                     "Debian's fortunes in /usr/share/games/fortunes)")
                .show_default = false;
          }};
}

FlagGroup<DataSource> validation_flags() {
  return {"validation", [](FlagSet& flags, DataSource& source) {
            flags.add(
                "--validation-fraction", source.validation_fraction,
                "--dataset text: share of the text (its end) held out for validation; tokens: "
                "share of each corpus's documents (its last ones)");
          }};
}

FlagGroup<DataSource> token_flags() {
  return {
      "tokens", [](FlagSet& flags, DataSource& source) {
        flags
            .add(
                "--vocab-size", source.vocabulary,
                "--dataset tokens: the vocabulary (every id must be below it; default: the largest "
                "id in the files + 1)")
            .show_default = false;
        flags
            .add("--tokenizer", source.tokenizer,
                 "--dataset tokens: the shards' tokenizer.json (default: the one beside them, as "
                 "`dtrain data prepare` leaves it); a checkpoint keeps it for `dtrain generate`")
            .show_default = false;
      }};
}

DatasetInfo fashion_mnist() {
  DatasetInfo info;
  info.name = "fashion-mnist";
  info.summary = "Zalando's 28x28 grey clothing images in 10 classes (IDX files, --data-dir)";
  info.input_shape = {1, 28, 28};
  info.classes = kImageClasses;
  info.federated = true;
  info.flags = {data_dir_flags()};
  info.check = [](const DataSource& source) {
    load_fashion_mnist(source.data_dir, Split::Test);  // the smaller split: checks the files
  };
  info.load = [](const DataSource& source) {
    LoadedData data;
    if (source.train) data.train = load_fashion_mnist(source.data_dir, Split::Train);
    if (source.test) data.test = load_fashion_mnist(source.data_dir, Split::Test);
    return data;
  };
  return info;
}

void check_synthetic(const DataSource& source) {
  DTRAIN_CHECK_INPUT(source.synthetic_examples >= 2, "--synthetic-examples must be >= 2, got ",
                     source.synthetic_examples);
}

DatasetInfo synthetic() {
  DatasetInfo info;
  info.name = "synthetic";
  info.summary =
      "Gaussian 1x28x28 inputs labelled by a random linear teacher in 10 classes "
      "(--synthetic-examples; a test split of a fifth, at least 1000)";
  info.input_shape = {1, 28, 28};
  info.classes = kImageClasses;
  info.federated = true;
  info.flags = {synthetic_flags()};
  info.check = check_synthetic;
  info.load = [shape = info.input_shape](const DataSource& source) {
    check_synthetic(source);
    LoadedData data;
    if (source.train) {
      data.train = make_synthetic(source.synthetic_examples, shape, kImageClasses, source.seed);
    }
    if (source.test) {
      data.test = make_synthetic(std::max<int64_t>(1000, source.synthetic_examples / 5), shape,
                                 kImageClasses, source.seed + 1);
    }
    return data;
  };
  return info;
}

// --text-file, else --data-dir, else Debian's fortunes.
std::string text_path(const DataSource& source) {
  if (!source.text_file.empty()) return source.text_file;
  if (!source.data_dir.empty()) return source.data_dir;
  return kFortunesDir;
}

LoadedData load_text_set(const DataSource& source) {
  DTRAIN_CHECK_INPUT(source.validation_fraction > 0 && source.validation_fraction < 1,
                     "--validation-fraction must be in (0, 1), got ", source.validation_fraction);
  TextData text = load_text(text_path(source), source.context, source.validation_fraction);
  LoadedData data;
  data.train = std::move(text.train);
  data.test = std::move(text.validation);
  data.vocabulary = text.tokenizer.size();
  data.vocabulary_utf8 = text.tokenizer.vocabulary_utf8();
  data.description =
      concat("text: ", text.origin, ", ", text.train_tokens + text.validation_tokens,
             " characters (", text.train_tokens, " for training, ", text.validation_tokens,
             " for validation), vocabulary of ", data.vocabulary);
  return data;
}

DatasetInfo text() {
  DatasetInfo info;
  info.name = "text";
  info.summary =
      "a UTF-8 text file or a folder of them (--text-file, else --data-dir, else Debian's "
      "fortunes), one token per character";
  info.language = true;
  info.token_unit = "char";
  info.flags = {data_dir_flags(), text_file_flags(), validation_flags()};
  info.check = [](const DataSource& source) { load_text_set(source); };
  info.load = load_text_set;
  return info;
}

LoadedData load_token_set(const DataSource& source) {
  tokens::TokenSetOptions options;
  options.spec = source.argument;
  options.context = source.context;
  options.train_samples = source.train_samples;
  options.epochs = source.epochs;
  options.validation_fraction = source.validation_fraction;
  options.seed = static_cast<uint32_t>(source.seed);
  options.vocabulary = source.vocabulary;
  options.tokenizer = source.tokenizer;
  tokens::TokenSplits splits = tokens::load_token_splits(options);
  LoadedData data;
  data.train = std::move(splits.train);
  data.test = std::move(splits.validation);
  data.vocabulary = splits.vocabulary;
  data.tokenizer_json = std::move(splits.tokenizer_json);
  data.description = std::move(splits.description);
  return data;
}

DatasetInfo token_shards() {
  DatasetInfo info;
  info.name = "tokens";
  info.summary =
      "token shards (Megatron .bin/.idx or llm.c .bin; tokens:PATH[,PATH...] or a blend "
      "tokens:PATH:WEIGHT,...), packed into --context windows in Megatron's GPTDataset order";
  info.language = true;
  info.flags = {validation_flags(), token_flags()};
  info.check = [](const DataSource& source) { load_token_set(source); };
  info.load = load_token_set;
  return info;
}

using InfoFn = DatasetInfo (*)();
constexpr InfoFn kBuiltIn[] = {
    fashion_mnist,
    synthetic,
    text,
    token_shards,
};

Registry<DatasetInfo>& registry() {
  static Registry<DatasetInfo> all("data set", "--dataset", [] {
    std::vector<DatasetInfo> built_in;
    for (InfoFn info : kBuiltIn) built_in.push_back(info());
    return built_in;
  }());
  return all;
}

}  // namespace

const std::deque<DatasetInfo>& datasets() { return registry().all(); }

std::vector<std::string> dataset_names() { return registry().names(); }

void declare_data_flags(FlagSet& flags, DataSource& source,
                        const std::function<bool(const DatasetInfo&)>& keep) {
  declare_flag_groups(flags, source, datasets(), keep);
}

std::string dataset_name(const std::string& flag) { return flag.substr(0, flag.find(':')); }

std::string dataset_argument(const std::string& flag) {
  const size_t colon = flag.find(':');
  return colon == std::string::npos ? std::string() : flag.substr(colon + 1);
}

const DatasetInfo& dataset_info(const std::string& name) {
  return registry().at(dataset_name(name));
}

DatasetInfo dataset_info_for(const std::string& name, const DataSource& source) {
  DatasetInfo info = dataset_info(name);
  if (info.describe) {
    DataSource with_argument = source;
    if (with_argument.argument.empty()) with_argument.argument = dataset_argument(name);
    info.describe(with_argument, info);
  }
  return info;
}

void register_dataset(DatasetInfo info) {
  DTRAIN_CHECK_INPUT(info.load, "register_dataset: a data set needs a loader");
  DTRAIN_CHECK_INPUT(info.language || (!info.input_shape.empty() && info.classes >= 2),
                     "register_dataset: a classification set needs its input shape and at "
                     "least 2 classes");
  registry().add(std::move(info));
}

std::string dataset_names_where(const std::function<bool(const DatasetInfo&)>& keep) {
  std::vector<std::string> names;
  for (const auto& info : datasets()) {
    if (keep(info)) names.push_back(info.name);
  }
  return Registry<DatasetInfo>::joined(names, " or ");
}

LoadedData load_dataset(const std::string& name, const DataSource& source) {
  DataSource with_argument = source;
  if (with_argument.argument.empty()) with_argument.argument = dataset_argument(name);
  return dataset_info(name).load(with_argument);
}

}  // namespace dtrain::data
