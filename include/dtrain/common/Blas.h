// Which BLAS kernel this process's matrix products run, and a better one where the BLAS chose
// badly. Debian's LibTorch 1.13 multiplies through OpenBLAS 0.3.21, which picks its kernel from
// the CPU's model number at load time; a CPU newer than the library (Sapphire Rapids for 0.3.21)
// gets the generic "Prescott" kernel (SSE3), 3-7x slower than the AVX-512 one the CPU runs.
// OPENBLAS_CORETYPE, read when OpenBLAS loads, forces a kernel: dtrain's launcher starts its
// ranks with the one the CPU's instructions guarantee (docs/guide/train.md, "The BLAS on a
// CPU").
#pragma once

#include <string>

#include "dtrain/common/Cpu.h"

namespace dtrain {

struct BlasInfo {
  /// "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64", or "" (not OpenBLAS:
  /// MKL in PyPI's LibTorch, or a BLAS that does not say).
  std::string config;
  /// OpenBLAS's kernel ("Prescott", "Haswell", "SkylakeX", "Cooperlake"), or "".
  std::string core;
};

/// This process's BLAS, as OpenBLAS reports itself (looked up at run time: nothing links it).
const BlasInfo& blas_info();

/// The OPENBLAS_CORETYPE to run on a CPU with `cpu`'s instructions where OpenBLAS chose `core`:
/// a generic kernel (one without AVX2, "Prescott", "Nehalem", "Sandybridge", ...) on a CPU with
/// AVX2 and FMA ("Haswell") or AVX-512 F/CD/BW/DQ/VL ("SkylakeX"; "Cooperlake" with
/// AVX512-BF16). Only what the instructions guarantee; "" when the kernel is fine, unknown, or
/// the CPU's instructions are.
std::string better_openblas_core(const std::string& core, const CpuInfo& cpu);

/// For this process: better_openblas_core() of its own OpenBLAS and CPU, unless the user set
/// OPENBLAS_CORETYPE (their choice always wins); "" otherwise.
std::string openblas_core_to_set();

/// Once per process: a warning on stderr where OpenBLAS runs a generic kernel that a better one
/// would replace (naming the OPENBLAS_CORETYPE that fixes it), or where the user's
/// OPENBLAS_CORETYPE was not taken. Nothing otherwise.
void warn_if_blas_slow();

}  // namespace dtrain
