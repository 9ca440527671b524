// Numeric precision of training: fp32, mixed precision (16-bit compute under autocast with fp32
// master weights and optimizer state), or everything in bf16.
#pragma once

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
/// Refuses modes this build cannot run (fp16-mixed without CUDA), suggesting an alternative.
void check_supported(Precision precision);
/// The dtype autocast computes in (kFloat for Fp32).
at::ScalarType compute_dtype(Precision precision);

/// Enables CPU autocast in `dtype` for its lifetime (restores the previous state after); a no-op
/// for Fp32 and Bf16. Wrap the forward pass; run backward outside it.
class AutocastScope {
 public:
  explicit AutocastScope(Precision precision);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace dtrain::precision
