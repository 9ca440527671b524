// Flags that mean the same thing in `dtrain train`, `dtrain fl ...` and `dtrain plan`, declared
// once here:
// each command binds them to its own fields and says what they are for in its help. (Two
// names differ in meaning between the commands and keep their names, as flags do: --dropout
// is the GPT's dropout in train, a client's chance to drop out in fl; --lr-decay is train's
// schedule, fl's per-round factor of the local rate.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "NumericOptions.h"
#include "dtrain/models/Gpt.h"

namespace dtrain::cli {

/// --dataset, --data-dir, --synthetic-examples.
inline void add_data_flags(CLI::App& app, std::string& dataset, std::string& data_dir,
                           int64_t& synthetic_examples, const std::string& datasets) {
  add(app, "--dataset", dataset, "Data set: " + datasets)->capture_default_str();
  add(app, "--data-dir", data_dir,
      "Fashion-MNIST IDX files (default: $DTRAIN_DATA_DIR, else Debian's "
      "/usr/share/datasets/fashion-mnist)");
  add(app, "--synthetic-examples", synthetic_examples, "--dataset synthetic: training examples")
      ->capture_default_str();
}

/// The decoder's shape (--model gpt, llama): --layers, --heads, --kv-heads, --width,
/// --ffn-width, --context, --rope-theta, --norm-eps, --dropout, --tied-embeddings: what
/// `dtrain train` builds and `dtrain plan` predicts, from the same flags and config files.
inline void add_decoder_flags(CLI::App& app, models::GptConfig& gpt) {
  add(app, "--layers", gpt.layers, "gpt, llama: transformer blocks")->capture_default_str();
  add(app, "--heads", gpt.heads, "gpt, llama: attention (query) heads")->capture_default_str();
  add(app, "--kv-heads", gpt.kv_heads,
      "gpt, llama: key/value heads, grouped-query attention (0 = --heads; must divide it)")
      ->capture_default_str();
  add(app, "--width", gpt.width, "gpt, llama: model width (a multiple of --heads)")
      ->capture_default_str();
  add(app, "--ffn-width", gpt.ffn_width,
      "gpt, llama: the MLP's hidden width (0 = 4 x --width for gpt; llama: 8/3 x --width "
      "rounded up to a multiple of 64)")
      ->capture_default_str();
  add(app, "--context", gpt.context, "gpt, llama: tokens per example (the attention window)")
      ->capture_default_str();
  add(app, "--rope-theta", gpt.rope_theta,
      "llama: the rotary embeddings' base (Llama 2: 10000; Llama 3: 500000)")
      ->capture_default_str();
  add(app, "--norm-eps", gpt.norm_eps, "gpt, llama: LayerNorm's / RMSNorm's epsilon")
      ->capture_default_str();
  add(app, "--dropout", gpt.dropout, "gpt, llama: dropout probability")->capture_default_str();
  app.add_flag("--tied-embeddings", gpt.tied_embeddings,
               "gpt, llama: the output layer reuses the token embedding's weight");
}

/// --image-size, --augment, --max-bad-samples (--dataset images:...). `size_note`: what the
/// size is in this command, appended to the shared first sentence.
inline void add_image_flags(CLI::App& app, int64_t& image_size, std::string& augment,
                            int64_t& max_bad_samples, const std::string& size_note) {
  add(app, "--image-size", image_size,
      "--dataset images: the side of the images the model sees" + size_note)
      ->capture_default_str();
  add(app, "--augment", augment,
      "--dataset images: the transforms: imagenet (training: random-resized-crop and flip; "
      "evaluation: resize to 256/224 of the size, center crop), flip (the whole image resized, "
      "flipped half the time) or none (the whole image resized)")
      ->capture_default_str();
  add(app, "--max-bad-samples", max_bad_samples,
      "--dataset images: damaged images to name and leave out before training (more stop it)")
      ->capture_default_str();
}

/// --model (a name of the model registry) and --hidden (the MLP's widths).
inline void add_model_flags(CLI::App& app, std::string& model, std::vector<int64_t>& hidden,
                            const std::string& models, const std::string& hidden_default) {
  add(app, "--model", model, "Model: " + models)->capture_default_str();
  add(app, "--hidden", hidden, "MLP hidden layer widths (" + hidden_default + ")")
      ->capture_default_str()
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

/// --lr, --momentum, --weight-decay of an optimizer (`whose`: "" for the trainer's, "Local"
/// for a federated client's SGD).
inline void add_sgd_flags(CLI::App& app, double& lr, double& momentum, double& weight_decay,
                          const std::string& whose) {
  const std::string prefix = whose.empty() ? "" : whose + " ";
  add(app, "--lr", lr, whose.empty() ? "Learning rate" : prefix + "learning rate")
      ->capture_default_str();
  add(app, "--momentum", momentum, prefix + "SGD momentum")->capture_default_str();
  add(app, "--weight-decay", weight_decay, prefix + "L2 weight decay")->capture_default_str();
}

/// --seed.
inline void add_seed_flag(CLI::App& app, uint64_t& seed, const std::string& what) {
  add(app, "--seed", seed, "Random seed (" + what + ")")->capture_default_str();
}

/// --threads.
inline void add_threads_flag(CLI::App& app, int& threads, const std::string& default_is) {
  add(app, "--threads", threads, "LibTorch threads per process (default: " + default_is + ")");
}

/// --checkpoint-dir, --eval-every (in the command's `unit`s) and --no-progress.
inline void add_run_flags(CLI::App& app, std::string& checkpoint_dir, int64_t& eval_every,
                          bool& progress, const std::string& checkpoints, const std::string& unit) {
  add(app, "--checkpoint-dir", checkpoint_dir, checkpoints);
  add(app, "--eval-every", eval_every, "Also evaluate every N " + unit)->capture_default_str();
  app.add_flag("!--no-progress", progress, "No progress bar");
}

}  // namespace dtrain::cli
