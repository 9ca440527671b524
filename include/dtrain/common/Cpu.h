// What this machine's CPU is and which of its instructions matter to training speed: bf16
// matrix instructions above all (AVX512-BF16, AMX-BF16 on x86; BF16 on Arm). Without them
// LibTorch's bf16 matrix products run through conversions and are many times slower than fp32,
// so --precision bf16-mixed, a memory and speed win where they exist, is a large loss there.
#pragma once

#include <string>

namespace dtrain {

struct CpuInfo {
  /// "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", or "unknown CPU".
  std::string model = "unknown CPU";
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  /// AVX-512 F, CD, BW, DQ and VL: what Skylake-SP's kernels (OpenBLAS's SkylakeX) use.
  bool avx512_skylake = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
  /// Arm's BF16 dot products (SVE/NEON BFDOT, BFMMLA).
  bool arm_bf16 = false;
  /// The instruction set could not be read (not Linux, no /proc/cpuinfo): nothing is claimed.
  bool unknown = true;

  /// bf16 matrix products run in hardware (or nothing is known, and no warning is due).
  bool native_bf16() const { return unknown || avx512_bf16 || amx_bf16 || arm_bf16; }
  /// "AVX-512 with AVX512-BF16 and AMX-BF16", "AVX2 only, no bf16 instructions", ...
  std::string vector_summary() const;
};

/// This machine's CPU (read once from /proc/cpuinfo; the kernel lists only what it enables).
const CpuInfo& cpu_info();

/// Parses the text of /proc/cpuinfo (its first processor's block).
CpuInfo parse_cpuinfo(const std::string& text);

}  // namespace dtrain
