// Optimizer offload (issue 80): the state in host memory or in a file, bucket by bucket, steps
// exactly as the optimizer it wraps; checkpoints see the same state; a folder that cannot hold it
// is one clear error; training runs with and without offload end with the same parameters.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/optim/Offload.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/optim/StateSize.h"

using namespace dtrain;
using dtrain::test::TempDir;

namespace {

std::vector<at::Tensor> parameters() {
  torch::manual_seed(7);
  auto options = torch::TensorOptions().dtype(torch::kFloat64).requires_grad(true);
  return {torch::randn({7, 5}, options), torch::randn({11}, options),
          torch::randn({3, 3}, options)};
}

std::vector<optim::OptimizerSpec> specs() {
  std::vector<optim::OptimizerSpec> out;
  optim::OptimizerSpec sgd;
  sgd.momentum = 0.9;
  sgd.weight_decay = 0.01;
  out.push_back(sgd);
  optim::OptimizerSpec adam = optim::optimizer_defaults("adam");
  adam.weight_decay = 0.1;
  out.push_back(adam);
  out.push_back(optim::optimizer_defaults("adamw"));
  out.push_back(optim::optimizer_defaults("adagrad"));
  optim::OptimizerSpec frozen = optim::optimizer_defaults("adam");
  frozen.freeze_variance_after = 2;
  out.push_back(frozen);
  return out;
}

// Six steps of seeded gradients (the last parameter gets none at the third; the learning rate
// changes at the fourth), then the parameters.
void train_six_steps(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>& params) {
  torch::manual_seed(11);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) optim::set_learning_rate(optimizer, 0.05);
    for (size_t k = 0; k < params.size(); ++k) {
      params[k].mutable_grad() = torch::randn_like(params[k]);
      if (step == 2 && k == 2) params[k].mutable_grad().reset();
    }
    optimizer.step();
  }
}

void expect_same_state(torch::optim::Optimizer& ours, const std::vector<at::Tensor>& our_params,
                       torch::optim::Optimizer& theirs, const std::vector<at::Tensor>& their_params,
                       const std::string& what) {
  for (size_t k = 0; k < our_params.size(); ++k) {
    EXPECT_TRUE(torch::equal(our_params[k], their_params[k])) << what << " parameter " << k;
    const optim::ParamState a = optim::get_param_state(ours, our_params[k]);
    const optim::ParamState b = optim::get_param_state(theirs, their_params[k]);
    ASSERT_EQ(a.size(), b.size()) << what;
    for (const auto& [name, value] : b) {
      ASSERT_TRUE(a.count(name)) << what << " " << name;
      EXPECT_TRUE(torch::equal(a.at(name), value)) << what << " " << name << " of " << k;
    }
  }
}

}  // namespace

TEST(Offload, StepsBitForBitAsTheOptimizerItWraps) {
  TempDir dir;
  for (const optim::OptimizerSpec& spec : specs()) {
    for (const std::string mode : {"host copies", "file", "file and host copies"}) {
      const std::string what = spec.name + " (" + mode + ")";
      std::vector<at::Tensor> theirs = parameters(), ours = parameters();
      auto reference = optim::make_optimizer(theirs, spec);
      optim::OffloadSpec offload;
      offload.enabled = true;
      offload.bucket_elements = 8;  // every parameter cut into chunks, across buckets
      offload.copy_to_host = mode != "file";
      if (mode != "host copies") offload.dir = dir / "state";
      optim::OffloadedOptimizer offloaded(ours, optim::optimizer_factory(spec), offload);
      train_six_steps(*reference, theirs);
      train_six_steps(offloaded, ours);
      expect_same_state(offloaded, ours, *reference, theirs, what);
      if (!offload.dir.empty()) {
        EXPECT_EQ(optim::optimizer_state_bytes(offloaded), 0) << what << ": state left in memory";
        EXPECT_GT(offloaded.file_bytes(), 0) << what;
      } else {
        EXPECT_EQ(optim::optimizer_state_bytes(offloaded), optim::optimizer_state_bytes(*reference))
            << what;
      }
    }
  }
  // Nothing left behind in the folder (the file is unlinked as soon as it is open).
  EXPECT_TRUE(std::filesystem::is_empty(dir / "state"));
}

// Master weights in the file (zero3 with bf16-master): the parameters' values live in the file
// between steps, the update is the optimizer's own, and each bucket's values are copied, rounded,
// into the model's lower-precision tensors.
TEST(Offload, ParametersKeptInTheFileStepAsTheOptimizerAndRoundIntoTheModel) {
  TempDir dir;
  for (const optim::OptimizerSpec& spec : specs()) {
    std::vector<at::Tensor> theirs = parameters(), ours = parameters();
    std::vector<at::Tensor> rounded;
    for (const auto& p : ours) rounded.push_back(at::zeros(p.sizes(), at::kFloat));
    auto reference = optim::make_optimizer(theirs, spec);
    optim::OffloadSpec offload;
    offload.enabled = true;
    offload.bucket_elements = 8;
    offload.dir = dir / "state";
    optim::OffloadedOptimizer offloaded(ours, optim::optimizer_factory(spec), offload);
    const int64_t state_bytes = offloaded.file_bytes();
    offloaded.keep_parameters_in_file(rounded);
    EXPECT_EQ(offloaded.file_bytes(), state_bytes + 8 * (35 + 11 + 9)) << spec.name;
    {
      at::NoGradGuard no_grad;
      for (auto& p : ours) p.fill_(std::nan(""));  // the file's values are the ones stepped
    }
    train_six_steps(*reference, theirs);
    train_six_steps(offloaded, ours);
    for (size_t k = 0; k < ours.size(); ++k) {
      EXPECT_TRUE(torch::equal(rounded[k], theirs[k].to(at::kFloat))) << spec.name << " " << k;
    }
    offloaded.read_parameters();
    expect_same_state(offloaded, ours, *reference, theirs, spec.name + " (values in the file)");
    EXPECT_EQ(optim::optimizer_state_bytes(offloaded), 0) << spec.name;
  }
}

TEST(Offload, StateSetFromACheckpointAndParametersChangedOutsideCarryOn) {
  TempDir dir;
  optim::OptimizerSpec spec = optim::optimizer_defaults("adam");
  std::vector<at::Tensor> theirs = parameters(), ours = parameters();
  auto reference = optim::make_optimizer(theirs, spec);
  train_six_steps(*reference, theirs);
  // A fresh offloaded optimizer receives the reference's state and values, as a resume does.
  optim::OffloadSpec offload;
  offload.enabled = true;
  offload.bucket_elements = 8;
  offload.copy_to_host = true;
  offload.dir = dir / "state";
  optim::OffloadedOptimizer offloaded(ours, optim::optimizer_factory(spec), offload);
  EXPECT_TRUE(optim::get_param_state(offloaded, ours[0]).empty());
  const optim::ParamState form = optim::param_state_to_fill(offloaded, ours[0]);
  const optim::ParamState expected = optim::param_state_to_fill(*reference, theirs[0]);
  ASSERT_EQ(form.size(), expected.size());
  for (const auto& [name, value] : expected) {
    ASSERT_TRUE(form.count(name)) << name;
    EXPECT_EQ(form.at(name).sizes(), value.sizes()) << name;
  }
  {
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < ours.size(); ++k) {
      ours[k].copy_(theirs[k]);  // the host copies must notice
      optim::set_param_state(offloaded, ours[k], optim::get_param_state(*reference, theirs[k]));
    }
  }
  optim::set_learning_rate(offloaded, optim::learning_rate(*reference));  // the schedule's
  train_six_steps(*reference, theirs);
  train_six_steps(offloaded, ours);
  expect_same_state(offloaded, ours, *reference, theirs, "after a resume");
}

TEST(Offload, AFolderThatCannotHoldTheStateIsOneClearError) {
  TempDir dir;
  std::ofstream(dir / "file") << "not a folder";
  std::vector<at::Tensor> params = parameters();
  optim::OptimizerSpec spec = optim::optimizer_defaults("adam");
  spec.offload = "optimizer:" + (dir / "file") + "/state";
  try {
    optim::optimizer_factory(spec)(params);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "file"), std::string::npos) << e.what();
  }
  spec.offload = "optimizer;" + dir.path();
  EXPECT_THROW(optim::optimizer_factory(spec), InputError);
  if (::geteuid() != 0) GTEST_SKIP() << "a full folder needs a small tmpfs (root)";
  const std::string small = dir / "small";
  std::filesystem::create_directories(small);
  ASSERT_EQ(::mount("tmpfs", small.c_str(), "tmpfs", 0, "size=64k"), 0);
  std::vector<at::Tensor> big = {
      torch::zeros({64 * 1024}, torch::TensorOptions().requires_grad(true))};
  spec.offload = "optimizer:" + small;
  try {
    optim::optimizer_factory(spec)(big);
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(small), std::string::npos) << message;
    EXPECT_NE(message.find("cannot reserve"), std::string::npos) << message;
  }
  ::umount(small.c_str());
}

// A user's run: ZeRO-3 on two ranks with Adam, its state in files, ends where the same run
// without offload ends, also when stopped and resumed halfway. With --precision bf16-master the
// fp32 master weights live in the file too: the model's bf16 shard, its fp32 gradient and nothing
// of the optimizer stay in memory between steps.
TEST(Offload, Zero3RunsEqualWithTheStateInFiles) {
  using namespace dtrain::test::cli;
  for (const std::string precision : {"fp32", "bf16-master"}) {
    SCOPED_TRACE(precision);
    TempDir dir;
    const std::string job =
        " train --nproc 2 --strategy zero3 --dataset synthetic --threads 1 "
        "--no-progress --optimizer adam --lr 0.01 --batch-size 16 --max-steps 6 --precision " +
        precision + " ";
    auto out = run(kDtrain + job + "--checkpoint-dir " + (dir / "plain"));
    ASSERT_EQ(out.code, 0) << out.text;
    const std::string offload = "--offload optimizer:" + (dir / "swap") + " --offload-bucket-mb 1 ";
    out = run(kDtrain + job + offload + "--checkpoint-dir " + (dir / "offloaded") + " --metrics " +
              (dir / "offloaded.jsonl"));
    ASSERT_EQ(out.code, 0) << out.text;
    // The summary: no optimizer state in memory, the file's size (Adam: twice the rank's shard;
    // with master weights, three times its elements in fp32: six times its bf16 bytes).
    std::ifstream metrics(dir / "offloaded.jsonl");
    nlohmann::json summary;
    for (std::string line; std::getline(metrics, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.value("event", "") == "summary") summary = record;
    }
    ASSERT_FALSE(summary.is_null());
    EXPECT_EQ(summary["optimizer_bytes"], 0);
    EXPECT_EQ(summary["optimizer_file_bytes"].get<int64_t>(),
              (precision == "fp32" ? 2 : 6) * summary["parameter_bytes"].get<int64_t>());
    const auto plain = final_parameters(dir / "plain");
    EXPECT_EQ(max_difference(plain, final_parameters(dir / "offloaded")), 0.0);
    out = run(kDtrain + job + offload + "--stop-at-step 3 --checkpoint-dir " + (dir / "resumed"));
    ASSERT_EQ(out.code, 0) << out.text;
    out = run(kDtrain + job + offload + "--checkpoint-dir " + (dir / "resumed"));
    ASSERT_EQ(out.code, 0) << out.text;
    EXPECT_EQ(max_difference(plain, final_parameters(dir / "resumed")), 0.0);
    if (precision != "fp32") {  // the checkpoint holds the fp32 master, not its bf16 rounding
      double unrounded = 0;
      for (const auto& [name, value] : plain) {
        unrounded += value.ne(value.to(at::kBFloat16).to(at::kFloat)).sum().item<double>();
      }
      EXPECT_GT(unrounded, 0);
      continue;
    }
    // An unwritable folder: one line naming it, exit 2, the checkpoints as they were.
    out = run(kDtrain + job + "--offload optimizer:/proc/dtrain --checkpoint-dir " +
              (dir / "resumed"));
    EXPECT_EQ(out.code, 2) << out.text;
    EXPECT_TRUE(has(out, "--offload optimizer:/proc/dtrain")) << out.text;
    EXPECT_EQ(max_difference(plain, final_parameters(dir / "resumed")), 0.0);
  }
}

// --dry-run: the run's memory per rank against this machine's, before anything is built: Llama
// 3.1 8B's shape on two ranks does not fit (exit 2, both figures named, in a few seconds and
// little memory); a small model fits.
TEST(Offload, DryRunSaysWhetherTheRunFitsBeforeBuildingIt) {
  using namespace dtrain::test::cli;
  TempDir dir;
  auto out = run("/usr/bin/time -f 'peak %M KiB' " + kDtrain +
                 " train --config " DTRAIN_SOURCE_DIR
                 "/configs/llama-8b.toml --dataset text "
                 "--nproc 2 --strategy ddp --dry-run --no-run-dir");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "does not fit: each rank needs")) << out.text;
  EXPECT_TRUE(has(out, "GiB per rank")) << out.text;
  const auto peak = out.text.find("peak ");
  ASSERT_NE(peak, std::string::npos) << out.text;
  EXPECT_LT(std::stod(out.text.substr(peak + 5)), 2.0 * 1024 * 1024) << out.text;  // < 2 GiB
  out = run(kDtrain +
            " train --dataset synthetic --nproc 2 --strategy zero3 --optimizer adam "
            "--offload optimizer:" +
            (dir / "swap") + " --dry-run --no-run-dir");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "fits              yes")) << out.text;
  EXPECT_TRUE(has(out, "offloaded")) << out.text;
}
