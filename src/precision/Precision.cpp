// Precision names and the autocast scope (CPU or CUDA; the API's versions: common/TorchCompat.h).
#include "dtrain/precision/Precision.h"

#include <ATen/autocast_mode.h>

#include "common/TorchCompat.h"
#include "dtrain/common/Cpu.h"
#include "dtrain/common/Error.h"

namespace dtrain::precision {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::Fp32;
  if (name == "bf16-mixed") return Precision::Bf16Mixed;
  if (name == "fp16-mixed") return Precision::Fp16Mixed;
  if (name == "bf16") return Precision::Bf16;
  if (name == "bf16-master") return Precision::Bf16Master;
  DTRAIN_THROW(InputError, "unknown precision '", name,
               "' (expected fp32, bf16-mixed, fp16-mixed, bf16 or bf16-master)");
}

std::string to_string(Precision precision) {
  switch (precision) {
    case Precision::Fp32:
      return "fp32";
    case Precision::Bf16Mixed:
      return "bf16-mixed";
    case Precision::Fp16Mixed:
      return "fp16-mixed";
    case Precision::Bf16:
      return "bf16";
    case Precision::Bf16Master:
      return "bf16-master";
  }
  return "?";
}

void check_supported(Precision precision, c10::Device device) {
  // LibTorch 1.13 has no fp16 matmul/convolution kernels on CPU (2.x's are slow and its CPU
  // autocast does not cast to fp16): fp16 autocast would fail deep inside the first Linear.
  DTRAIN_CHECK_INPUT(precision != Precision::Fp16Mixed || device.is_cuda(),
                     "precision fp16-mixed needs a CUDA device (--device cuda): LibTorch has no "
                     "fp16 matmul on CPU; use --precision bf16-mixed (same memory savings, no "
                     "loss scaling needed)");
}

std::string cost_warning(Precision precision, c10::Device device) {
  if (compute_dtype(precision) != at::kBFloat16) return "";
  const CpuInfo& cpu = cpu_info();
  if (!device.is_cpu() || cpu.native_bf16()) return "";
  return concat("--precision ", to_string(precision), " on a CPU without bf16 instructions (",
                cpu.model, ": ", cpu.vector_summary(),
                "): LibTorch converts every bf16 matrix product, so steps are slower than in fp32 "
                "(the quick start's job: 1.6x on an AVX-512 Xeon without BF16, 11x on an AVX2 "
                "EPYC; README, 'Precision on a CPU'): --precision fp32 is faster on this machine");
}

at::ScalarType compute_dtype(Precision precision) {
  switch (precision) {
    case Precision::Fp32:
      return at::kFloat;
    case Precision::Fp16Mixed:
      return at::kHalf;
    case Precision::Bf16Mixed:
    case Precision::Bf16:
    case Precision::Bf16Master:
      return at::kBFloat16;
  }
  return at::kFloat;
}

at::ScalarType parameter_dtype(Precision precision) {
  return precision == Precision::Bf16 || precision == Precision::Bf16Master ? at::kBFloat16
                                                                            : at::kFloat;
}

AutocastScope::AutocastScope(Precision precision, c10::DeviceType device) : device_(device) {
  if (precision != Precision::Bf16Mixed && precision != Precision::Fp16Mixed) return;
  active_ = true;
  const compat::AutocastState previous = compat::autocast_state(device_);
  previous_enabled_ = previous.enabled;
  previous_dtype_ = previous.dtype;
  compat::set_autocast_state(device_, {true, compute_dtype(precision)});
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // Leaving the outermost scope drops autocast's cache of casted weights (they change each step).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_state(device_, {previous_enabled_, previous_dtype_});
}

}  // namespace dtrain::precision
