// The dtrain command line: argument parsing only; the work is in the library. One file per
// subcommand (Command.h):
//   dtrain train  [flags | --config FILE.toml]   train a model (optionally on --nproc local ranks)
//   dtrain launch --nproc-per-node N -- PROGRAM  start N ranks of any program (torchrun-style)
//   dtrain ckpt consolidate|verify|inspect CKPT  convert / check / describe checkpoints
//   dtrain generate --checkpoint DIR --prompt P  sample text from a language-model checkpoint
//   dtrain data prepare|tokenizer train ...      token shards and tokenizers from your text
//   dtrain plan --model M --cluster C ...        predict a layout's step time and memory (--search)
//   dtrain ps serve --shard I/N                  a parameter-server shard
//   dtrain fl simulate|serve|client ...          federated learning
#include <torch/version.h>

#include <cstdio>
#include <exception>

#include "Command.h"
#include "Help.h"
#include "Suggest.h"
#include "dtrain/common/Cpu.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"

namespace {

// What --version prints, and what benchmark records are stamped with (bench/report.py): this
// build (dtrain, LibTorch, CUDA, services) and this machine's CPU.
std::string version_text() {
  const dtrain::CpuInfo& cpu = dtrain::cpu_info();
  return dtrain::concat("dtrain ", DTRAIN_VERSION, "\nLibTorch ", TORCH_VERSION,
                        dtrain::built_with_cuda() ? " with CUDA" : " (CPU only)",
#ifdef DTRAIN_SERVICES
                        ", gRPC services",
#else
                        ", no gRPC services",
#endif
                        "\nCPU ", cpu.model, " (", cpu.vector_summary(), ")");
}

std::string g_command_line;

}  // namespace

namespace dtrain::cli {

const std::string& command_line() { return g_command_line; }

void set_command_line(int argc, char** argv) {
  g_command_line.clear();
  for (int i = 0; i < argc; ++i) {
    const std::string word = argv[i];
    const bool plain = !word.empty() && word.find_first_not_of(
                                            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                            "0123456789-_./=:,+@%") == std::string::npos;
    if (i > 0) g_command_line += ' ';
    if (plain) {
      g_command_line += word;
      continue;
    }
    g_command_line += '\'';
    for (const char c : word)
      g_command_line += c == '\'' ? std::string("'\\''") : std::string(1, c);
    g_command_line += '\'';
  }
}

}  // namespace dtrain::cli

int main(int argc, char** argv) {
  using dtrain::cli::kInputErrorExit;
  CLI::App app{"dtrain: distributed training for LibTorch", "dtrain"};
  app.require_subcommand(1);
  dtrain::cli::use_short_help(app);  // before the subcommands: they inherit it
  app.set_version_flag("--version", version_text(),
                       "Print dtrain's and LibTorch's versions and the CPU, then exit");
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return dtrain::concat("dtrain: error: ", e.what(), " (see --help)\n");
  });
  std::vector<std::unique_ptr<dtrain::cli::Command>> commands;  // in --help's order
  commands.push_back(dtrain::cli::train_command(app));
  commands.push_back(dtrain::cli::launch_command(app));
  commands.push_back(dtrain::cli::checkpoint_command(app));
  commands.push_back(dtrain::cli::generate_command(app));
  commands.push_back(dtrain::cli::data_command(app));
  commands.push_back(dtrain::cli::plan_command(app));
  commands.push_back(dtrain::cli::status_command(app));
#ifdef DTRAIN_SERVICES  // -DDTRAIN_SERVICES=OFF: the training core without gRPC
  commands.push_back(dtrain::cli::ps_command(app));
  commands.push_back(dtrain::cli::federated_command(app));
#endif

  dtrain::cli::set_command_line(argc, argv);
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    for (const auto& command : commands) args = command->expand(args);
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app.parse(reversed);  // CLI11 takes the arguments in reverse order
  } catch (const dtrain::InputError& e) {
    std::fprintf(stderr, "dtrain: error: %s\n", e.message().c_str());
    return kInputErrorExit;
  } catch (const CLI::ParseError& e) {
    // An unknown flag or command (CLI11: arguments not expected; a subcommand required when the
    // command itself is unknown): named, with the nearest one there is.
    const bool unknown = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr ||
                         (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
                          app.get_subcommands().empty() && !app.remaining().empty());
    const std::string said = unknown ? dtrain::cli::explain_unexpected(app) : "";
    if (!said.empty()) {
      std::fprintf(stderr, "dtrain: error: %s\n", said.c_str());
      return kInputErrorExit;
    }
    const int code = app.exit(e);
    return code == 0 ? 0 : kInputErrorExit;
  }
  try {
    for (const auto& command : commands) {
      if (command->parsed()) return command->run(args);
    }
  } catch (const dtrain::InputError& e) {
    std::fprintf(stderr, "dtrain: error: %s\n", e.message().c_str());
    return kInputErrorExit;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
