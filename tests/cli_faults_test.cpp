// Faults a new user met on a fresh machine (issue 77), through the command line: OpenBLAS's
// generic kernel on a CPU newer than it (the launcher starts the ranks with the kernel the CPU's
// instructions guarantee, a user's OPENBLAS_CORETYPE wins, and the losses stay the same), and
// weights holding NaN or Inf refused where they are loaded, naming the tensor.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/common/Blas.h"
#include "dtrain/common/Cpu.h"
#include "dtrain/nn/SafeTensors.h"

using namespace dtrain;
using dtrain::test::TempDir;
using dtrain::test::cli::has;
using dtrain::test::cli::kDtrain;
using dtrain::test::cli::run;

namespace {

// The training losses of a metrics file, in order.
std::vector<double> losses(const std::string& path) {
  std::vector<double> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto record = nlohmann::json::parse(line, nullptr, false);
    if (record.is_object() && record.contains("loss") && record.contains("step"))
      out.push_back(record["loss"].get<double>());
  }
  return out;
}

}  // namespace

// Only what the instructions guarantee: a generic kernel on a CPU with AVX2 + FMA is Haswell's,
// with AVX-512 F/CD/BW/DQ/VL SkylakeX's, with AVX512-BF16 too Cooperlake's; a kernel OpenBLAS
// chose for the CPU, or a CPU without AVX2, is left alone.
TEST(Blas, TheBetterKernelIsWhatTheCpusInstructionsGuarantee) {
  auto cpu = [](const std::string& flags) {
    return parse_cpuinfo("processor : 0\nmodel name : a CPU\nflags : " + flags + "\n");
  };
  const std::string skx = "sse3 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl";
  const CpuInfo sapphire = cpu(skx + " avx512_bf16 amx_bf16");
  EXPECT_EQ(better_openblas_core("Prescott", sapphire), "Cooperlake");
  EXPECT_EQ(better_openblas_core("PRESCOTT", cpu(skx)), "SkylakeX");
  EXPECT_EQ(better_openblas_core("Nehalem", cpu("sse3 avx avx2 fma")), "Haswell");
  EXPECT_EQ(better_openblas_core("Sandybridge", cpu("sse3 avx avx2 fma")), "Haswell");
  EXPECT_EQ(better_openblas_core("Prescott", cpu("sse3 avx avx2")), "");  // no FMA
  EXPECT_EQ(better_openblas_core("Prescott", cpu("sse3 avx avx2 fma avx512f")), "Haswell");
  EXPECT_EQ(better_openblas_core("Prescott", cpu("sse3 avx")), "");
  for (const std::string chosen : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"})
    EXPECT_EQ(better_openblas_core(chosen, sapphire), "") << chosen;
  EXPECT_EQ(better_openblas_core("", sapphire), "");           // not OpenBLAS
  EXPECT_EQ(better_openblas_core("Prescott", CpuInfo{}), "");  // instructions unknown
}

// This build's own OpenBLAS (Debian's LibTorch 1.13), made to look as it does on a CPU newer
// than it (DTRAIN_SIMULATE_OPENBLAS_CORE=Prescott: what it detects there): the launcher starts
// the ranks with the better kernel and says so; a user's OPENBLAS_CORETYPE reaches them as it
// is. The ranks of `dtrain launch` print what they got.
TEST(Blas, TheLauncherStartsTheRanksWithTheBetterKernel) {
  if (blas_info().core.empty()) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS";
  const std::string better = better_openblas_core("Prescott", cpu_info());
  if (better.empty()) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  const std::string ranks =
      " launch --nproc-per-node 2 -- sh -c 'echo \"kernel=${OPENBLAS_CORETYPE:-none}\"'";
  auto out =
      run("env -u OPENBLAS_CORETYPE DTRAIN_SIMULATE_OPENBLAS_CORE=Prescott " + kDtrain + ranks);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "OpenBLAS chose its generic Prescott kernel on this CPU")) << out.text;
  EXPECT_TRUE(has(out, "[rank 0] kernel=" + better)) << out.text;
  EXPECT_TRUE(has(out, "[rank 1] kernel=" + better)) << out.text;
  out = run("OPENBLAS_CORETYPE=Haswell DTRAIN_SIMULATE_OPENBLAS_CORE=Prescott " + kDtrain + ranks);
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_FALSE(has(out, "OpenBLAS chose")) << out.text;
  EXPECT_TRUE(has(out, "[rank 1] kernel=Haswell")) << out.text;
  // Where OpenBLAS chose well, nothing is set.
  out = run("env -u OPENBLAS_CORETYPE -u DTRAIN_SIMULATE_OPENBLAS_CORE " + kDtrain + ranks);
  ASSERT_EQ(out.code, 0) << out.text;
  if (better_openblas_core(blas_info().core, cpu_info()).empty()) {
    EXPECT_TRUE(has(out, "[rank 0] kernel=none")) << out.text;
  }
}

// One process, no launcher: `dtrain train` starts itself again with the better kernel; the
// losses are those of the generic kernel's run (the same arithmetic, other instructions: equal
// to float32's rounding).
TEST(Blas, OneProcessRunsTheBetterKernelToTheSameLosses) {
  if (blas_info().core.empty()) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS";
  const std::string better = better_openblas_core("Prescott", cpu_info());
  if (better.empty()) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  TempDir dir;
  const std::string train =
      " train --model mlp --hidden 64 --threads 1 --batch-size 32 --max-steps 20 --log-every 1 "
      "--no-progress --seed 3 --metrics ";
  const auto generic = run("OPENBLAS_CORETYPE=Prescott " + kDtrain + train + (dir / "a.jsonl"));
  ASSERT_EQ(generic.code, 0) << generic.text;
  EXPECT_TRUE(has(generic, "OpenBLAS runs its generic")) << generic.text;  // the user's choice
  const auto fixed = run("env -u OPENBLAS_CORETYPE DTRAIN_SIMULATE_OPENBLAS_CORE=Prescott " +
                         kDtrain + train + (dir / "b.jsonl"));
  ASSERT_EQ(fixed.code, 0) << fixed.text;
  EXPECT_TRUE(has(fixed, "running with OPENBLAS_CORETYPE=" + better)) << fixed.text;
  EXPECT_FALSE(has(fixed, "warning: OpenBLAS")) << fixed.text;
  const auto a = losses(dir / "a.jsonl");
  const auto b = losses(dir / "b.jsonl");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4 * std::abs(a[i])) << i;
}

// --init-from weights that hold NaN or Inf: exit 2 naming the tensor, the value and the first
// index (it loaded without a word, and the run said "training diverged" 6 steps later);
// --allow-non-finite-weights loads them.
TEST(Cli, NonFiniteWeightsAreRefusedNamingTheTensor) {
  TempDir dir;
  auto out = run(kDtrain +
                 " train --model mlp --hidden 16 --threads 1 --max-steps 1 "
                 "--no-progress --checkpoint-dir " +
                 (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "hf"));
  ASSERT_EQ(out.code, 0) << out.text;
  const auto file = nn::SafeTensorsFile::open(dir / "hf/model.safetensors");
  for (const double bad : {NAN, INFINITY}) {
    nn::NamedTensors tensors;
    std::string victim;
    for (const auto& name : file.names()) {
      at::Tensor t = file.get(name).clone();
      if (victim.empty() && t.dim() == 2) {
        victim = name;
        t.view({-1})[5] = bad;
        t.view({-1})[9] = bad;
      }
      tensors.emplace_back(name, t);
    }
    nn::save_safetensors(dir / "bad.safetensors", tensors);
    const std::string flags =
        " train --model mlp --hidden 16 --threads 1 --max-steps 1 "
        "--no-progress --init-from " +
        (dir / "bad.safetensors");
    out = run(kDtrain + flags);
    EXPECT_EQ(out.code, 2) << out.text;
    EXPECT_TRUE(has(out, "bad.safetensors: " + victim + " holds " +
                             (std::isnan(bad) ? "NaN" : "Inf") +
                             " (2 of its values are not finite, the first at index 5)"))
        << out.text;
    EXPECT_TRUE(has(out, "--allow-non-finite-weights")) << out.text;
    out = run(kDtrain + flags + " --allow-non-finite-weights");
    EXPECT_FALSE(has(out, "not finite")) << out.text;
  }
}
