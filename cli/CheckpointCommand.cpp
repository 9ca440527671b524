// `dtrain ckpt consolidate|export|verify|inspect`: checkpoints of any strategy and world size,
// joined into one file or exported as safetensors (Hugging Face's layout for a Llama), checked
// against their checksums, or described.
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "Command.h"
#include "dtrain/common/Error.h"
#include "dtrain/train/Checkpoint.h"
#include "dtrain/train/Weights.h"

namespace dtrain::cli {

namespace {

// `dtrain ckpt verify PATH`: one line per checkpoint; exit 2 when any does not verify.
int verify_checkpoints(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> directories;
  if (fs::exists(path + "/meta.json")) {
    directories.push_back(path);
  } else {
    for (const auto& name : dtrain::train::list_checkpoints(path)) {
      directories.push_back(path + "/" + name);
    }
    DTRAIN_CHECK_INPUT(!directories.empty(), path,
                       " is neither a checkpoint (no meta.json) nor a directory of checkpoints");
  }
  int damaged = 0;
  for (const auto& directory : directories) {
    bool unverifiable = false;
    const std::string problem = dtrain::train::verify_checkpoint(directory, &unverifiable);
    if (!problem.empty()) {
      ++damaged;
      std::printf("DAMAGED  %s: %s\n", directory.c_str(), problem.c_str());
    } else {
      std::printf("%s %s%s\n", unverifiable ? "NO SUMS " : "ok      ", directory.c_str(),
                  unverifiable ? " (written before dtrain recorded checksums)" : "");
    }
  }
  if (damaged > 0) {
    std::fprintf(stderr, "dtrain: error: %d of %zu checkpoints do not verify\n", damaged,
                 directories.size());
    return kInputErrorExit;
  }
  return 0;
}

class CheckpointCommand final : public Command {
 public:
  explicit CheckpointCommand(CLI::App& app) {
    auto* ckpt = app.add_subcommand("ckpt", "Inspect and convert checkpoints");
    ckpt->require_subcommand(1);
    consolidate_ = ckpt->add_subcommand(
        "consolidate",
        "Join a checkpoint's shards (any strategy, any world size) into one full-model "
        "file for C++ (dtrain::train::load_consolidated) and Python torch.load(file)");
    consolidate_
        ->add_option("checkpoint", path_, "A checkpoint, or a checkpoint directory (its newest)")
        ->required();
    consolidate_->add_option("-o,--output", output_,
                             "File to write (default CHECKPOINT/"
                             "consolidated.pt)");
    export_ = ckpt->add_subcommand(
        "export",
        "Write a checkpoint's full model (any strategy, world size, layout) as safetensors: "
        "a Llama as Hugging Face's transformers names it, with config.json and tokenizer.json "
        "(a folder from_pretrained loads); other models under dtrain's names");
    export_->add_option("checkpoint", path_, "A checkpoint, or a checkpoint directory (its newest)")
        ->required();
    export_->add_option("-o,--output", output_, "The folder to write")->required();
    export_->add_option("--format", format_, "safetensors (the only one)")->capture_default_str();
    export_
        ->add_option("--shard-bytes", shard_bytes_,
                     "Cut the weights into shards of at most this many bytes "
                     "(model.safetensors.index.json)")
        ->capture_default_str();
    verify_ = ckpt->add_subcommand(
        "verify",
        "Check every file of a checkpoint (or of every checkpoint under a checkpoint "
        "directory) against the checksums recorded when it was saved; exit 2 if any is "
        "damaged");
    verify_->add_option("checkpoint", path_, "A checkpoint, or a checkpoint directory")->required();
    inspect_ = ckpt->add_subcommand("inspect", "Print a checkpoint's metadata and tensors");
    inspect_
        ->add_option("checkpoint", path_, "A checkpoint, or a checkpoint directory (its newest)")
        ->required();
  }
  bool parsed() const override {
    return consolidate_->parsed() || export_->parsed() || verify_->parsed() || inspect_->parsed();
  }
  int run(const std::vector<std::string>&) override {
    if (consolidate_->parsed()) {
      const std::string checkpoint = dtrain::train::resolve_checkpoint(path_);
      if (output_.empty()) output_ = checkpoint + "/consolidated.pt";
      const auto count = dtrain::train::consolidate_checkpoint(checkpoint, output_);
      std::printf(
          "wrote %lld tensors of %s to %s (C++: dtrain::train::load_consolidated(module, "
          "file); Python: torch.load(file).state_dict())\n",
          static_cast<long long>(count), checkpoint.c_str(), output_.c_str());
      return 0;
    }
    if (export_->parsed()) {
      DTRAIN_CHECK_INPUT(format_ == "safetensors", "--format must be safetensors, got '", format_,
                         "'");
      DTRAIN_CHECK_INPUT(shard_bytes_ > 0, "--shard-bytes must be > 0, got ", shard_bytes_);
      const auto files = dtrain::train::export_safetensors(path_, output_, shard_bytes_);
      for (const auto& file : files) std::printf("wrote %s\n", file.c_str());
      return 0;
    }
    if (verify_->parsed()) return verify_checkpoints(path_);
    if (inspect_->parsed()) {
      const std::string checkpoint = dtrain::train::resolve_checkpoint(path_);
      const auto meta = dtrain::train::read_meta(checkpoint);
      int64_t elements = 0;
      for (const auto& t : meta.tensors) {
        int64_t n = 1;
        for (auto d : t.shape) n *= d;
        elements += n;
      }
      std::printf(
          "%s\n  strategy %s, world %d (dp %d x pp %d x tp %d%s), step %lld, epoch %lld, "
          "seed %llu, global batch %lld\n  %zu tensors, %lld elements\n",
          checkpoint.c_str(), meta.strategy.c_str(), meta.world_size, meta.dp, meta.pp, meta.tp,
          meta.ep > 1 ? concat(", experts over ", meta.ep).c_str() : "",
          static_cast<long long>(meta.step), static_cast<long long>(meta.epoch),
          static_cast<unsigned long long>(meta.seed), static_cast<long long>(meta.global_batch),
          meta.tensors.size(), static_cast<long long>(elements));
      // How it was made (checkpoints of dtrain train since issue 78): the command, the options
      // given, what the model's recipe set, and a language model's shape.
      const auto extra = [&](const char* key) {
        const auto found = meta.extras.find(key);
        return found == meta.extras.end() ? std::string() : found->second;
      };
      if (!extra("model").empty()) std::printf("  model: %s\n", extra("model").c_str());
      if (!extra("command").empty()) std::printf("  command: %s\n", extra("command").c_str());
      if (!extra("recipe").empty()) std::printf("  recipe: %s\n", extra("recipe").c_str());
      if (!extra("plan").empty()) {
        std::printf("  plan (dtrain train --print-plan; `--config` reads it back):\n");
        std::istringstream lines(extra("plan"));
        for (std::string line; std::getline(lines, line);) {
          if (line.rfind("# ", 0) == 0 && line.rfind("# the plan", 0) != 0 &&
              line.rfind("# batches", 0) != 0 && line.rfind("# data", 0) != 0 &&
              line.rfind("# launch", 0) != 0) {
            continue;  // (the options' own comments)
          }
          if (line.rfind("# ", 0) == 0) std::printf("    %s\n", line.c_str() + 2);
        }
      }
      if (!extra("config").empty()) {
        std::printf("  options given (config.toml):\n");
        std::istringstream lines(extra("config"));
        for (std::string line; std::getline(lines, line);) {
          if (!line.empty()) std::printf("    %s\n", line.c_str());
        }
      }
      for (const auto& t : meta.tensors) {
        std::string shape;
        for (size_t i = 0; i < t.shape.size(); ++i)
          shape += (i ? "x" : "") + std::to_string(t.shape[i]);
        std::printf("  %-40s %-14s %s\n", t.name.c_str(), shape.c_str(), t.dtype.c_str());
      }
      return 0;
    }
    return 0;
  }

 private:
  CLI::App* consolidate_ = nullptr;
  CLI::App* export_ = nullptr;
  std::string format_ = "safetensors";
  int64_t shard_bytes_ = 5LL << 30;
  CLI::App* verify_ = nullptr;
  CLI::App* inspect_ = nullptr;
  std::string path_, output_;
};

}  // namespace

std::unique_ptr<Command> checkpoint_command(CLI::App& app) {
  return std::make_unique<CheckpointCommand>(app);
}

}  // namespace dtrain::cli
