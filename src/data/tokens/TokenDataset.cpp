// Token shards as a data set: the corpora, their splits, the cached GPT indices and the blend,
// behind a SampleSource that copies each sample's tokens straight from the mapped files.
#include "dtrain/data/tokens/TokenDataset.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <memory>

#include "dtrain/common/Error.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/data/tokens/GptIndex.h"
#include "dtrain/data/tokens/TokenFiles.h"

namespace dtrain::data::tokens {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_on(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t at = text.find(separator, start);
    parts.push_back(text.substr(start, at == std::string::npos ? at : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

// One corpus, its two splits' document ids, and each split's index.
struct Corpus {
  TokenCorpus files;
  std::vector<int32_t> train_documents;
  std::vector<int32_t> validation_documents;
  GptIndex train;
  GptIndex validation;
};

int64_t split_tokens(const Corpus& corpus, const std::vector<int32_t>& documents) {
  int64_t tokens = 0;
  for (int32_t d : documents) tokens += corpus.files.document_length(d);
  return tokens;
}

bool is_validation_shard(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  return name.find("_val_") != std::string::npos || name.find("_val.") != std::string::npos;
}

// The documents of each split: llm.c's *_val_* shards when a folder has them, else the last
// validation_fraction of the documents (Megatron's split: round(fraction x documents)).
void split_documents(Corpus& corpus, const std::vector<std::string>& paths, double fraction) {
  const int64_t n = corpus.files.documents();
  // llm.c's convention: shards named *_val_* (each shard one document) are the held-out split.
  bool named = false;
  for (int64_t d = 0; d < n; ++d)
    named = named || is_validation_shard(corpus.files.document_file(d));
  if (named) {
    for (int64_t d = 0; d < n; ++d) {
      (is_validation_shard(corpus.files.document_file(d)) ? corpus.validation_documents
                                                          : corpus.train_documents)
          .push_back(static_cast<int32_t>(d));
    }
    DTRAIN_CHECK_INPUT(!corpus.train_documents.empty(), "tokens: ", paths.front(),
                       " holds only validation shards (*_val_*)");
    return;
  }
  const int64_t train_end =
      static_cast<int64_t>(std::nearbyint((1.0 - fraction) * static_cast<double>(n)));
  DTRAIN_CHECK_INPUT(train_end >= 1 && train_end < n, "tokens: ", corpus.files.origin(), " has ", n,
                     " document", n == 1 ? "" : "s", ": holding out ", fraction,
                     " of them for validation leaves ", train_end, " for training and ",
                     n - train_end,
                     " for validation (give more documents, another --validation-fraction, or "
                     "llm.c shards named *_val_* for the validation split)");
  for (int64_t d = 0; d < n; ++d) {
    (d < train_end ? corpus.train_documents : corpus.validation_documents)
        .push_back(static_cast<int32_t>(d));
  }
}

// Samples of one or more corpora: sample i is corpus `which[i]`'s sample `local[i]` (a blend),
// or corpus 0's sample i.
class TokenSamples : public SampleSource {
 public:
  TokenSamples(std::shared_ptr<std::vector<Corpus>> corpora, bool validation, int64_t context)
      : corpora_(std::move(corpora)), validation_(validation), context_(context) {}

  void set_blend(std::vector<int16_t> which, std::vector<int64_t> local) {
    which_ = std::move(which);
    local_ = std::move(local);
  }
  void set_concatenated() {
    // Validation: every corpus's held-out samples, one after another.
    for (size_t c = 0; c < corpora_->size(); ++c) {
      const int64_t n = index_of(c).size();
      for (int64_t s = 0; s < n; ++s) {
        which_.push_back(static_cast<int16_t>(c));
        local_.push_back(s);
      }
    }
  }

  int64_t size() const override {
    return which_.empty() ? index_of(0).size() : static_cast<int64_t>(which_.size());
  }
  int64_t context() const override { return context_; }
  std::vector<int64_t> input_shape() const override { return {context_}; }

  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t width = context_ + 1;
    at::Tensor tokens = at::empty({static_cast<int64_t>(indices.size()), width}, at::kLong);
    int64_t* out = tokens.data_ptr<int64_t>();
    for (size_t b = 0; b < indices.size(); ++b) {
      const int64_t i = indices[b];
      DTRAIN_CHECK(i >= 0 && i < size(), "token sample ", i, " out of range (", size(), ")");
      const size_t c = which_.empty() ? 0 : static_cast<size_t>(which_[i]);
      const int64_t s = which_.empty() ? i : local_[i];
      read_sample(c, s, out + b * width);
    }
    return {tokens.narrow(1, 0, context_).contiguous(), tokens.narrow(1, 1, context_).contiguous()};
  }

 private:
  const GptIndex& index_of(size_t c) const {
    return validation_ ? (*corpora_)[c].validation : (*corpora_)[c].train;
  }

  // gpt_dataset.py's _query_document_sample_shuffle_indices.
  void read_sample(size_t c, int64_t s, int64_t* out) const {
    const Corpus& corpus = (*corpora_)[c];
    const GptIndex& index = index_of(c);
    const int64_t j = index.shuffle[s];
    const int64_t first = index.samples[2 * j];
    const int64_t first_offset = index.samples[2 * j + 1];
    const int64_t last = index.samples[2 * j + 2];
    const int64_t last_offset = index.samples[2 * j + 3];
    int64_t written = 0;
    for (int64_t p = first; p <= last; ++p) {
      const int64_t document = index.documents[p];
      const int64_t begin = p == first ? first_offset : 0;
      const int64_t end = p == last ? last_offset + 1 : corpus.files.document_length(document);
      corpus.files.read(document, begin, end - begin, out + written);
      written += end - begin;
    }
    DTRAIN_CHECK(written == context_ + 1, "token sample ", s, " has ", written,
                 " tokens, expected ", context_ + 1);
  }

  std::shared_ptr<std::vector<Corpus>> corpora_;
  bool validation_;
  int64_t context_;
  std::vector<int16_t> which_;
  std::vector<int64_t> local_;
};

std::string default_cache_dir(const std::string& path) {
  std::error_code error;
  const fs::path p(path);
  const fs::path folder = fs::is_directory(p, error) ? p : p.parent_path();
  return ((folder.empty() ? fs::path(".") : folder) / "cache").string();
}

}  // namespace

std::vector<BlendPart> parse_token_spec(const std::string& spec) {
  DTRAIN_CHECK_INPUT(!spec.empty(),
                     "--dataset tokens needs its files: tokens:PATH[,PATH...] or "
                     "tokens:PATH:WEIGHT,PATH:WEIGHT");
  std::vector<BlendPart> parts;
  int weighted = 0;
  for (const std::string& item : split_on(spec, ',')) {
    DTRAIN_CHECK_INPUT(!item.empty(), "--dataset tokens:", spec, ": an empty path");
    BlendPart part;
    const size_t colon = item.rfind(':');
    if (colon != std::string::npos) {
      const std::string weight = item.substr(colon + 1);
      char* end = nullptr;
      const double value = std::strtod(weight.c_str(), &end);
      DTRAIN_CHECK_INPUT(!weight.empty() && end == weight.c_str() + weight.size() &&
                             std::isfinite(value) && value > 0,
                         "--dataset tokens:", spec, ": the weight '", weight, "' of ",
                         item.substr(0, colon), " is not a positive number");
      DTRAIN_CHECK_INPUT(colon > 0, "--dataset tokens:", spec, ": a weight without a path");
      part.paths = {item.substr(0, colon)};
      part.weight = value;
      ++weighted;
    } else {
      part.paths = {item};
    }
    parts.push_back(std::move(part));
  }
  if (weighted == 0) {
    BlendPart all;
    for (auto& part : parts) all.paths.push_back(part.paths.front());
    return {all};
  }
  DTRAIN_CHECK_INPUT(weighted == static_cast<int>(parts.size()), "--dataset tokens:", spec,
                     ": give every path a weight (PATH:WEIGHT), or none");
  return parts;
}

TokenSplits load_token_splits(const TokenSetOptions& options) {
  DTRAIN_CHECK_INPUT(options.context >= 2, "--dataset tokens needs a context of at least 2, got ",
                     options.context);
  DTRAIN_CHECK_INPUT(options.validation_fraction > 0 && options.validation_fraction < 1,
                     "--validation-fraction must be in (0, 1), got ", options.validation_fraction);
  const std::vector<BlendPart> parts = parse_token_spec(options.spec);
  auto corpora = std::make_shared<std::vector<Corpus>>();
  TokenSplits splits;
  std::string tokenizer_path = options.tokenizer;
  if (tokenizer_path.empty()) {
    const std::string beside =
        (fs::path(default_cache_dir(parts.front().paths.front())).parent_path() / "tokenizer.json")
            .string();
    std::error_code error;
    if (fs::is_regular_file(beside, error)) tokenizer_path = beside;
  }
  int64_t vocabulary = options.vocabulary;
  if (!tokenizer_path.empty()) {
    const tokenizer::BpeTokenizer tokenizer = tokenizer::BpeTokenizer::load(tokenizer_path);
    splits.tokenizer_json = tokenizer.to_json();
    if (vocabulary == 0) vocabulary = tokenizer.vocab_size();
  }
  int64_t largest = -1;
  std::string largest_where;
  for (const BlendPart& part : parts) {
    Corpus corpus{TokenCorpus::open(part.paths), {}, {}, {}, {}};
    const TokenCorpus::MaxToken max = corpus.files.max_token();
    if (vocabulary > 0) {
      DTRAIN_CHECK_INPUT(max.id < vocabulary, "tokens: ", max.file, ": token ", max.position,
                         " is id ", max.id, ", at or above the vocabulary of ", vocabulary,
                         tokenizer_path.empty() ? std::string(" (--vocab-size)")
                                                : concat(" (", tokenizer_path, ")"),
                         ": another tokenizer's data?");
    }
    if (max.id > largest) {
      largest = max.id;
      largest_where = max.file;
    }
    split_documents(corpus, part.paths, options.validation_fraction);
    corpora->push_back(std::move(corpus));
  }
  splits.vocabulary = vocabulary > 0 ? vocabulary : largest + 1;

  // The training size: what was asked, else `epochs` passes over every corpus.
  const int64_t context = options.context;
  int64_t one_pass = 0;
  for (const Corpus& corpus : *corpora) {
    one_pass += (split_tokens(corpus, corpus.train_documents) - 1) / context;
  }
  const int64_t wanted = options.train_samples > 0
                             ? options.train_samples
                             : one_pass * std::max<int64_t>(1, options.epochs);
  std::vector<double> weights;
  for (const auto& part : parts) weights.push_back(part.weight);
  const std::vector<int64_t> per_corpus =
      corpora->size() == 1 ? std::vector<int64_t>{wanted} : blend_component_sizes(weights, wanted);
  for (size_t c = 0; c < corpora->size(); ++c) {
    Corpus& corpus = (*corpora)[c];
    const std::string cache =
        options.cache_dir.empty() ? default_cache_dir(parts[c].paths.front()) : options.cache_dir;
    const std::string description = concat("files ", corpus.files.fingerprint());
    GptIndexOptions train{context, per_corpus[c], options.seed};
    // One epoch exactly when the run asks for one pass (Megatron's num_samples = None).
    if (corpora->size() == 1 && options.train_samples == 0 && options.epochs <= 1) {
      train.samples = 0;
    }
    corpus.train = cached_gpt_index(cache, description + "; split train",
                                    corpus.files.document_lengths(), corpus.train_documents, train);
    corpus.validation =
        cached_gpt_index(cache, description + "; split valid", corpus.files.document_lengths(),
                         corpus.validation_documents, {context, 0, options.seed});
    splits.train_tokens += split_tokens(corpus, corpus.train_documents);
    splits.validation_tokens += split_tokens(corpus, corpus.validation_documents);
  }
  auto train = std::make_shared<TokenSamples>(corpora, false, context);
  if (corpora->size() > 1) {
    std::vector<int16_t> which;
    std::vector<int64_t> local;
    build_blend_index(weights, wanted, which, local);
    train->set_blend(std::move(which), std::move(local));
  }
  auto validation = std::make_shared<TokenSamples>(corpora, true, context);
  if (corpora->size() > 1) validation->set_concatenated();
  std::string files;
  for (size_t c = 0; c < corpora->size(); ++c) {
    if (!files.empty()) files += "; ";
    files += (*corpora)[c].files.origin();
    if (corpora->size() > 1) files += concat(" (weight ", parts[c].weight, ")");
  }
  splits.description =
      concat("tokens: ", files, ": ", splits.train_tokens + splits.validation_tokens, " tokens (",
             splits.train_tokens, " for training, ", splits.validation_tokens, " held out), ",
             train->size(), " training samples of ", context, " tokens (seed ", options.seed,
             "), vocabulary of ", splits.vocabulary,
             tokenizer_path.empty() ? std::string() : concat(" (", tokenizer_path, ")"));
  splits.train = TensorDataset::from_source(train, true);
  splits.validation = TensorDataset::from_source(validation, false);
  return splits;
}

}  // namespace dtrain::data::tokens
