// `dtrain generate`: samples text from a language-model checkpoint (--model gpt --dataset text
// or tokens), decoded with the tokenizer the checkpoint keeps.
#include <cstdio>

#include "Command.h"
#include "ConfigFile.h"
#include "NumericOptions.h"
#include "dtrain/train/Generate.h"

namespace dtrain::cli {

namespace {

class GenerateCommand final : public Command {
 public:
  explicit GenerateCommand(CLI::App& app) {
    app_ = app.add_subcommand(
        "generate",
        "Sample text from a language-model checkpoint (--model gpt --dataset text or tokens)");
    app_->add_option("--checkpoint", options_.checkpoint,
                     "A checkpoint, or a checkpoint directory (its newest)")
        ->required();
    app_->add_option("--prompt", options_.prompt, "Text to continue");
    add(*app_, "--tokens", options_.tokens, "Tokens to generate")->capture_default_str();
    add(*app_, "--temperature", options_.temperature,
        "Sampling temperature (0 = always the most likely token)")
        ->capture_default_str();
    add(*app_, "--top-k", options_.top_k, "Sample among the k most likely tokens only (0 = all)")
        ->capture_default_str();
    add(*app_, "--seed", options_.seed, "Random seed")->capture_default_str();
    add(*app_, "--threads", options_.threads, "Threads (default: all cores)");
    app_->add_flag("--ignore-eos", options_.ignore_eos,
                   "Go on past the tokenizer's end-of-text token (sampling stops at it by "
                   "default, as transformers' generate() at eos_token_id)");
    add_config_option(*app_);
  }
  std::vector<std::string> expand(const std::vector<std::string>& args) override {
    return expand_config(args, *app_, {"generate"});
  }
  bool parsed() const override { return app_->parsed(); }
  int run(const std::vector<std::string>&) override {
    dtrain::train::generate_text(options_, [](const std::string& piece) {
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
    });
    std::fputs("\n", stdout);
    return 0;
  }

 private:
  CLI::App* app_ = nullptr;
  dtrain::train::GenerateOptions options_;
};

}  // namespace

std::unique_ptr<Command> generate_command(CLI::App& app) {
  return std::make_unique<GenerateCommand>(app);
}

}  // namespace dtrain::cli
