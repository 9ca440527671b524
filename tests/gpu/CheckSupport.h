// What the GPU checks share (tests/gpu/gpu_check.cpp): their settings, JSON records, running a
// check in forked processes, and the GPT they train with its learnable token data.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/comm/ProcessGrid.h"
#include "dtrain/common/Device.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/parallel/Strategies.h"

namespace dtrain::gpu_check {

struct Settings {
  std::string device = "cuda";
  std::string out = "bench/results/gpu/gpu.jsonl";
  std::string python = "python3";
  std::string source_dir = ".";
  int rounds = 3;
  std::string only;  // run only the check of this name
};
inline Settings settings;

inline bool on_gpu() { return settings.device != "cpu"; }

// One JSON object, built from (key, number-or-string) pairs.
class Record {
 public:
  Record& add(const std::string& key, double value) {
    std::ostringstream v;
    v.precision(6);
    v << (std::isfinite(value) ? value : -1.0);
    fields_.emplace_back(key, v.str());
    return *this;
  }
  Record& add(const std::string& key, const std::string& value) {
    fields_.emplace_back(key, "\"" + value + "\"");
    return *this;
  }
  std::string json() const {
    std::string s = "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      s += (i ? ", \"" : "\"") + fields_[i].first + "\": " + fields_[i].second;
    }
    return s + "}";
  }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

#define CHECK_THAT(condition, ...)                                                        \
  do {                                                                                    \
    if (!(condition)) DTRAIN_THROW(Error, "check failed: " #condition ": ", __VA_ARGS__); \
  } while (0)

// Runs body(rank) in `ranks` forked processes (LOCAL_RANK, MASTER_PORT set) and returns whether
// all exited 0 within `limit`; rank 0's text result comes back through a file.
inline bool in_processes(int ranks, const std::function<std::string(int rank, int port)>& body,
                         std::string* result,
                         std::chrono::seconds limit = std::chrono::seconds(300)) {
  const int port = free_port();
  char path[] = "/tmp/dtrain-gpu-check-XXXXXX";
  const int fd = mkstemp(path);
  close(fd);
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      int code = 0;
      try {
        const std::string text = body(r, port);
        if (r == 0) std::ofstream(path) << text;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "  rank %d: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(nullptr);
      _exit(code);
    }
    children.push_back(pid);
  }
  bool ok = true;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (pid_t pid : children) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "  timed out after %lld s\n", static_cast<long long>(limit.count()));
        for (pid_t p : children) kill(p, SIGKILL);
        waitpid(pid, &status, 0);
        ok = false;
        break;
      }
      usleep(20000);
    }
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::ifstream in(path);
  result->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::remove(path);
  return ok;
}

inline comm::CommunicatorPtr world_of(int rank, int size, int port, const std::string& backend) {
  comm::InitOptions o;
  o.rank = rank;
  o.world_size = size;
  o.master_port = port;
  o.backend = backend;
  o.timeout = std::chrono::seconds(60);
  return comm::init(o);
}

inline void synchronize() {
  if (on_gpu()) c10::cuda::device_synchronize();
}

// ---- the GPT and its data ----

inline models::ModelSpec gpt_spec(int64_t layers, int64_t width, int64_t heads, int64_t context,
                                  int64_t vocab, const std::string& checkpointing = "none") {
  models::ModelSpec spec;
  spec.name = "gpt";
  spec.gpt.vocab = vocab;
  spec.gpt.layers = layers;
  spec.gpt.width = width;
  spec.gpt.heads = heads;
  spec.gpt.context = context;
  spec.checkpointing = checkpointing;
  return spec;
}

// Sequences a model can learn: each continues an arithmetic progression modulo the vocabulary.
inline data::TensorDataset token_data(int64_t examples, int64_t context, int64_t vocab,
                                      uint64_t seed) {
  at::Generator generator = at::detail::createCPUGenerator(seed);
  const at::Tensor start = at::randint(vocab, {examples, 1}, generator, at::kLong);
  const at::Tensor stride = at::randint(1, 4, {examples, 1}, generator, at::kLong);
  const at::Tensor tokens = (start + stride * at::arange(context + 1, at::kLong)).remainder(vocab);
  return data::TensorDataset(tokens.narrow(1, 0, context).contiguous(),
                             tokens.narrow(1, 1, context).contiguous());
}

struct Trained {
  parallel::StrategyPtr strategy;
  parallel::LossFn loss;
};

// A one-rank ddp strategy on the GPT, on the check's device.
inline Trained make_trained(const models::ModelSpec& spec, parallel::StrategyOptions options,
                            const comm::CommunicatorPtr& world, double lr = 1e-3) {
  options.device = resolve_device(settings.device, 0).str();
  torch::manual_seed(1);
  Model model = models::make_model(spec);
  model.module->to(parse_device(options.device));
  optim::OptimizerSpec optimizer;
  optimizer.name = "adamw";
  optimizer.lr = lr;
  Trained t{parallel::make_strategy("ddp", options),
            model.loss ? parallel::LossFn(model.loss) : parallel::cross_entropy};
  t.strategy->setup(std::move(model), optim::optimizer_factory(optimizer),
                    std::make_shared<comm::ProcessGrid>(world));
  return t;
}

inline std::vector<data::Batch> batch_of(const data::TensorDataset& data, int64_t step,
                                         int64_t size, const c10::Device& device) {
  const int64_t begin = (step * size) % (data.size() - size + 1);
  const data::Batch batch = data.slice(begin, begin + size);
  return {{to_device(batch.inputs, device), to_device(batch.targets, device)}};
}

}  // namespace dtrain::gpu_check
