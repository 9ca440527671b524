// OpenBLAS's kernel, read through its own entry points looked up at run time (dlsym), and the
// kernel a CPU's instructions guarantee.
#include "dtrain/common/Blas.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace dtrain {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// OpenBLAS's x86 kernels that use neither AVX2 nor AVX-512: what it falls back to on a CPU it
// does not know (Prescott, SSE3), and those of CPUs before Haswell.
bool generic(const std::string& core) {
  static const char* kGeneric[] = {
      "katmai",       "coppermine",  "northwood", "prescott", "banias",    "core2",
      "penryn",       "dunnington",  "nehalem",   "atom",     "athlon",    "opteron",
      "opteron_sse3", "barcelona",   "nano",      "bobcat",   "bulldozer", "piledriver",
      "steamroller",  "sandybridge", "unknown"};
  const std::string c = lower(core);
  for (const char* name : kGeneric) {
    if (c == name) return true;
  }
  return false;
}

}  // namespace

const BlasInfo& blas_info() {
  static const BlasInfo info = [] {
    BlasInfo b;
    using Text = char* (*)();
    if (auto config = reinterpret_cast<Text>(::dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
      if (const char* text = config()) b.config = text;
    }
    if (auto core = reinterpret_cast<Text>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
      if (const char* text = core()) b.core = text;
    }
    // Tests: the kernel OpenBLAS would have detected on another CPU (what it does when
    // OPENBLAS_CORETYPE is not set); a kernel forced by OPENBLAS_CORETYPE is the real one.
    const char* simulated = std::getenv("DTRAIN_SIMULATE_OPENBLAS_CORE");
    const char* own = std::getenv("OPENBLAS_CORETYPE");
    if (!b.core.empty() && simulated != nullptr && *simulated != '\0' &&
        (own == nullptr || *own == '\0')) {
      b.core = simulated;
    }
    while (!b.config.empty() && std::isspace(static_cast<unsigned char>(b.config.back())))
      b.config.pop_back();
    return b;
  }();
  return info;
}

std::string better_openblas_core(const std::string& core, const CpuInfo& cpu) {
  if (cpu.unknown || !generic(core)) return "";
  if (cpu.avx512_skylake && cpu.avx512_bf16) return "Cooperlake";
  if (cpu.avx512_skylake) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return "Haswell";
  return "";
}

std::string openblas_core_to_set() {
  const char* own = std::getenv("OPENBLAS_CORETYPE");
  if (own != nullptr && *own != '\0') return "";
  return better_openblas_core(blas_info().core, cpu_info());
}

void warn_if_blas_slow() {
  static std::atomic<bool> warned{false};
  const BlasInfo& blas = blas_info();
  if (blas.core.empty() || warned.exchange(true)) return;
  const CpuInfo& cpu = cpu_info();
  const std::string better = better_openblas_core(blas.core, cpu);
  if (better.empty()) return;
  const char* own = std::getenv("OPENBLAS_CORETYPE");
  if (own != nullptr && *own != '\0') {
    std::fprintf(stderr,
                 "dtrain: warning: OpenBLAS runs its generic %s kernel although "
                 "OPENBLAS_CORETYPE=%s; this CPU (%s, %s) runs %s's several times faster: "
                 "OPENBLAS_CORETYPE=%s\n",
                 blas.core.c_str(), own, cpu.model.c_str(), cpu.vector_summary().c_str(),
                 better.c_str(), better.c_str());
    return;
  }
  std::fprintf(stderr,
               "dtrain: warning: OpenBLAS chose its generic %s kernel on this CPU (%s, %s): "
               "matrix products run several times slower than they can. Start this program "
               "with OPENBLAS_CORETYPE=%s (dtrain's launcher sets it for its ranks)\n",
               blas.core.c_str(), cpu.model.c_str(), cpu.vector_summary().c_str(), better.c_str());
}

}  // namespace dtrain
