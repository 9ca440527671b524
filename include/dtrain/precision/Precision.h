// Numeric precision of training: fp32, mixed precision (16-bit compute under autocast with fp32
// master weights and optimizer state), or everything in bf16.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace dtrain::precision {

enum class Precision {
  Fp32,       ///< everything fp32
  Bf16Mixed,  ///< forward/backward under bf16 autocast; fp32 weights, grads, optimizer state
  Fp16Mixed,  ///< as Bf16Mixed in fp16, with dynamic loss scaling (needs a CUDA device)
  Bf16,       ///< weights, activations, gradients and optimizer state in bf16
};

/// "fp32", "bf16-mixed", "fp16-mixed", "bf16"; InputError otherwise.
Precision parse_precision(const std::string& name);
std::string to_string(Precision precision);
/// Refuses modes `device` cannot run (fp16-mixed on a CPU), suggesting an alternative.
void check_supported(Precision precision, c10::Device device = c10::Device(c10::DeviceType::CPU));
/// A line saying what a 16-bit precision will cost where it runs without hardware support (bf16
/// on a CPU without bf16 matrix instructions: common/Cpu.h), "" where it runs at full speed.
/// The precision still trains correctly there; the caller says it once.
std::string cost_warning(Precision precision, c10::Device device);
/// The dtype autocast computes in (kFloat for Fp32).
at::ScalarType compute_dtype(Precision precision);

/// Enables autocast for `device`'s type (CPU or CUDA) in the precision's dtype for its lifetime
/// (restores the previous state after); a no-op for Fp32 and Bf16. Wrap the forward pass; run
/// backward outside it.
class AutocastScope {
 public:
  explicit AutocastScope(Precision precision, c10::DeviceType device = c10::DeviceType::CPU);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace dtrain::precision
