// Numeric precision of training: fp32, mixed precision (16-bit compute under autocast with fp32
// weights and optimizer state), a bf16 model with fp32 master weights in the optimizer
// (Megatron's and DeepSpeed's layout), or everything in bf16.
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
  /// The model's weights and activations in bf16 (no per-micro-batch casts); gradients
  /// accumulated and reduced in fp32; the optimizer updates fp32 master weights (sharded with
  /// ZeRO) and copies them into the model; checkpoints hold the fp32 master weights.
  Bf16Master,
};

/// "fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-master"; InputError otherwise.
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
/// The dtype the model's parameters (and a batch's floating inputs) are held in: bf16 for Bf16
/// and Bf16Master, fp32 otherwise.
at::ScalarType parameter_dtype(Precision precision);
/// Whether the optimizer updates fp32 master copies of 16-bit model weights (Bf16Master).
inline bool has_master_weights(Precision precision) { return precision == Precision::Bf16Master; }

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
