// `dtrain data`: a user's text to token shards, images to tar shards, and tokenizers.
//   dtrain data prepare INPUT... --tokenizer FILE --output PREFIX [--format megatron|llmc]
//   dtrain data prepare --images FOLDER --output PREFIX   (WebDataset tar shards)
//   dtrain data tokenizer train INPUT... --vocab-size N --output FILE
//   dtrain data export-fashion-mnist --output DIR         (JPEG files in ImageNet's layout)
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "Command.h"
#include "NumericOptions.h"
#include "dtrain/common/Printed.h"
#include "dtrain/data/tokenizer/BpeTokenizer.h"
#include "dtrain/data/tokens/Prepare.h"
#ifdef DTRAIN_IMAGES
#include "dtrain/data/images/ImageSet.h"
#endif

namespace dtrain::cli {

namespace {

// A progress line: redrawn in place on a terminal, every 10% otherwise.
class ProgressLine {
 public:
  explicit ProgressLine(std::string what) : what_(std::move(what)) {}
  void update(double done, double total, const std::string& unit, double scale) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double fraction = total > 0 ? std::min(1.0, done / total) : 1.0;
    const int tenth = static_cast<int>(fraction * 10);
    if (!terminal_ && tenth == last_tenth_) return;
    last_tenth_ = tenth;
    const int width = 30;
    const int filled = static_cast<int>(fraction * width);
    const double eta = fraction > 0 ? seconds * (1 - fraction) / fraction : 0;
    std::fprintf(stderr, "%s%s [%s%s] %3.0f%% %.1f %s/s, %.0f s left%s", terminal_ ? "\r" : "",
                 what_.c_str(), std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), fraction * 100,
                 done / scale / std::max(seconds, 1e-9), unit.c_str(), eta, terminal_ ? "" : "\n");
    std::fflush(stderr);
  }
  void done() {
    if (terminal_) std::fputs("\n", stderr);
  }

 private:
  std::string what_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  bool terminal_ = ::isatty(fileno(stderr)) != 0;
  int last_tenth_ = -1;
};

void add_source_flags(CLI::App& app, data::tokens::TextSource& source, bool required = true) {
  auto* inputs = app.add_option("inputs", source.inputs,
                                "Text files or folders (their .txt, .md, .rst, .html, .jsonl, ... "
                                "files and files without an extension); .jsonl/.ndjson: one "
                                "document per line");
  if (required) inputs->required();
  app.add_option("--json-field", source.json_field, "JSON Lines: the field holding the text")
      ->capture_default_str();
}

class DataCommand final : public Command {
 public:
  explicit DataCommand(CLI::App& app) {
    app_ = app.add_subcommand("data", "Prepare a corpus of your own: tokenizers and token shards");
    app_->require_subcommand(1);

    prepare_ = app_->add_subcommand(
        "prepare",
        "Tokenize text into token shards (Megatron's .bin/.idx or llm.c's .bin) on every core, "
        "for `dtrain train --dataset tokens:PREFIX`; the tokenizer is copied beside them");
    add_source_flags(*prepare_, prepare_options_.source, false);
    prepare_->add_option("--tokenizer", prepare_options_.tokenizer,
                         "A Hugging Face tokenizer.json (byte-level BPE), or a folder with one");
    prepare_->add_option("--images", images_,
                         "Instead of text: a folder of class folders (JPEG/PNG) to write as "
                         "WebDataset tar shards PREFIX-000000.tar, ... (for --dataset images)");
    add(*prepare_, "--shard-bytes", shard_bytes_, "--images: bytes per tar shard")
        ->capture_default_str();
    prepare_
        ->add_option("--output", prepare_options_.output,
                     "Path prefix of the shards (megatron: PREFIX.bin + PREFIX.idx; llmc: "
                     "PREFIX_000000.bin, ...)")
        ->required();
    prepare_->add_option("--format", prepare_options_.format, "megatron or llmc")
        ->capture_default_str();
    add(*prepare_, "--shard-tokens", prepare_options_.shard_tokens, "llmc: tokens per shard")
        ->capture_default_str();
    prepare_->add_flag("--no-eod", no_eod_,
                       "Do not put the tokenizer's end-of-text token after each document");
    add(*prepare_, "--threads", prepare_options_.threads, "Threads (default: every core)");

    auto* tokenizer = app_->add_subcommand("tokenizer", "Tokenizers");
    tokenizer->require_subcommand(1);
    train_ = tokenizer->add_subcommand(
        "train",
        "Train a byte-level BPE (GPT-2's pre-tokenization) and save it as a tokenizer.json that "
        "Hugging Face tokenizers loads");
    add_source_flags(*train_, train_source_);
    add(*train_, "--vocab-size", train_options_.vocab_size,
        "Tokens in all: the 256 bytes, the merges and <|endoftext|>")
        ->capture_default_str();
    add(*train_, "--min-frequency", train_options_.min_frequency,
        "Pairs seen fewer times are not merged")
        ->capture_default_str();
    train_->add_option("--output", train_output_, "The tokenizer.json to write")->required();
    add(*train_, "--threads", train_options_.threads, "Threads (default: every core)");

    export_ = app_->add_subcommand(
        "export-fashion-mnist",
        "Write Fashion-MNIST (--data-dir's IDX files) as JPEG files in ImageNet's layout "
        "(OUT/train/<class>/*.jpg, OUT/val/<class>/*.jpg): an image folder to try --dataset "
        "images on");
    export_->add_option("--output", export_output_, "The folder to write")->required();
    export_->add_option("--data-dir", export_data_dir_,
                        "Fashion-MNIST IDX files (default: $DTRAIN_DATA_DIR, else Debian's)");
    add(*export_, "--quality", export_quality_, "JPEG quality (1-100)")->capture_default_str();
  }

  bool parsed() const override { return app_->parsed(); }

  int run(const std::vector<std::string>&) override {
    if (prepare_->parsed()) return images_.empty() ? prepare() : prepare_images();
    if (export_->parsed()) return export_fashion_mnist();
    return train();
  }

 private:
#ifdef DTRAIN_IMAGES
  int prepare_images() {
    DTRAIN_CHECK_INPUT(prepare_options_.source.inputs.empty() && prepare_options_.tokenizer.empty(),
                       "--images writes image shards: give no text inputs or --tokenizer");
    const auto shards =
        data::images::write_image_shards(images_, prepare_options_.output, shard_bytes_, 0);
    for (const auto& shard : shards) std::printf("wrote %s\n", shard.c_str());
    return 0;
  }

  int export_fashion_mnist() {
    DTRAIN_CHECK_INPUT(export_quality_ >= 1 && export_quality_ <= 100,
                       "--quality must be in [1, 100], got ", export_quality_);
    const int64_t n =
        data::images::export_fashion_mnist_jpeg(export_data_dir_, export_output_, export_quality_);
    std::printf("wrote %lld JPEG images under %s (train/ and val/, a folder per class)\n",
                static_cast<long long>(n), export_output_.c_str());
    return 0;
  }
#else
  int prepare_images() {
    DTRAIN_CHECK_INPUT(false, "this dtrain was built without libjpeg/libpng: no image data");
    return 2;
  }
  int export_fashion_mnist() { return prepare_images(); }
#endif

  int prepare() {
    DTRAIN_CHECK_INPUT(!prepare_options_.source.inputs.empty(),
                       "data prepare: give the text files or folders to tokenize (or --images)");
    DTRAIN_CHECK_INPUT(!prepare_options_.tokenizer.empty(),
                       "data prepare: --tokenizer is required for text");
    prepare_options_.append_eod = !no_eod_;
    ProgressLine line("tokenizing");
    prepare_options_.progress = [&line](int64_t done, int64_t total) {
      line.update(static_cast<double>(done), static_cast<double>(total), "MB", 1e6);
    };
    const auto result = data::tokens::prepare_tokens(prepare_options_);
    line.done();
    std::printf(
        "%lld documents, %.1f MB of text -> %lld tokens (%.2f bytes per token) in %.1f s "
        "(%.1f MB/s)\n",
        static_cast<long long>(result.documents), result.bytes / 1e6,
        static_cast<long long>(result.tokens),
        static_cast<double>(result.bytes) / std::max<int64_t>(1, result.tokens), result.seconds,
        result.bytes / 1e6 / std::max(result.seconds, 1e-9));
    for (const auto& file : result.files) std::printf("wrote %s\n", file.c_str());
    return 0;
  }

  int train() {
    data::tokenizer::check_train_options(train_options_);
    int64_t total = 0;
    data::tokens::source_files(train_source_, &total);
    std::vector<std::string> texts;
    ProgressLine reading("reading");
    data::tokens::for_each_document(
        train_source_, [&](const std::string& origin, std::string text, int64_t done) {
          texts.push_back(std::move(text));
          train_options_.origins.push_back(origin);
          reading.update(static_cast<double>(done), static_cast<double>(total), "MB", 1e6);
        });
    reading.done();
    ProgressLine merging("merging");
    train_options_.progress = [&merging](int64_t done, int64_t wanted) {
      merging.update(static_cast<double>(done), static_cast<double>(wanted), "merges", 1);
    };
    const auto start = std::chrono::steady_clock::now();
    const data::tokenizer::BpeTokenizer tokenizer =
        data::tokenizer::train_bpe(texts, train_options_);
    merging.done();
    tokenizer.save(train_output_);
    std::printf("trained a byte-level BPE of %lld tokens on %.1f MB in %.1f s: %s\n",
                static_cast<long long>(tokenizer.vocab_size()), total / 1e6,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                train_output_.c_str());
    return 0;
  }

  CLI::App* app_ = nullptr;
  CLI::App* prepare_ = nullptr;
  CLI::App* train_ = nullptr;
  CLI::App* export_ = nullptr;
  std::string images_;
  int64_t shard_bytes_ = 256 << 20;
  std::string export_output_;
  std::string export_data_dir_;
  int export_quality_ = 90;
  data::tokens::PrepareOptions prepare_options_;
  bool no_eod_ = false;
  data::tokens::TextSource train_source_;
  data::tokenizer::BpeTrainOptions train_options_;
  std::string train_output_;
};

}  // namespace

std::unique_ptr<Command> data_command(CLI::App& app) { return std::make_unique<DataCommand>(app); }

}  // namespace dtrain::cli
