// PowerSGD (Vogels et al. 2019): low-rank gradient compression with error feedback, for one
// bucket of the DDP Reducer. Each gradient matrix M (a parameter's gradient as rows x the rest)
// is sent as two thin factors: P = M Q (allreduced, then orthonormalized) and Q = M^T P
// (allreduced); the bucket then holds P Q^T, the rank-r approximation of the mean gradient. What
// the approximation leaves out of this rank's M stays in an error buffer and is added to the
// next step's gradient; Q is warm-started from the previous step (one power iteration per step
// is enough then). Vectors (biases, norms) and matrices not worth compressing travel uncompressed
// in the first allreduce. PyTorch's powerSGD_hook does the same per bucket.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/Communicator.h"
#include "dtrain/parallel/ddp/Reducer.h"

namespace dtrain::parallel::ddp {

/// "powersgd:RANK[:START_STEP[:MIN_RATE[:WIRE]]]" -> options (WIRE: fp16 or bf16); anything
/// else: InputError naming `flag`.
PowerSgdOptions parse_powersgd(const std::string& text, const std::string& flag);

class PowerSgdBucket {
 public:
  /// `shapes[i]` is the shape of the gradient at element `offsets[i]` of the bucket's flat
  /// buffer `flat` (its dtype and device are the factors'); `bucket_index` varies the seed.
  PowerSgdBucket(const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes,
                 const std::vector<int64_t>& offsets, const PowerSgdOptions& options,
                 int64_t bucket_index);

  /// Phase 1: adds the error to the compressed gradients, P = M Q; allreduces the Ps together
  /// with the uncompressed gradients (in the wire dtype: the factors are computed in the
  /// gradients' dtype and rounded to it only to travel).
  comm::WorkPtr start(comm::Communicator& comm);
  /// Phase 2 (phase 1's work done): orthonormalizes each P, Q = M^T P, keeps M - P Q^T as the
  /// error; allreduces the Qs (nullptr when nothing is compressed).
  comm::WorkPtr middle(comm::Communicator& comm);
  /// Phase 3 (phase 2's work done): the bucket gets P Q^T and the reduced uncompressed part.
  void finish();

  /// Bytes each step's two allreduces carry (against the bucket's bytes uncompressed).
  int64_t wire_bytes() const { return p_wire_.nbytes() + q_wire_.nbytes(); }
  /// Matrices compressed in this bucket.
  size_t compressed() const { return matrices_.size(); }

 private:
  struct Matrix {
    at::Tensor m;      // the gradient in the bucket, rows x cols
    at::Tensor p, q;   // views of p_buffer_ / q_buffer_
    at::Tensor error;  // view of error_
  };
  struct Plain {
    at::Tensor grad;  // flat view of the gradient in the bucket
    at::Tensor wire;  // its place in p_buffer_
  };
  std::vector<Matrix> matrices_;
  std::vector<Plain> plain_;
  at::Tensor p_buffer_, q_buffer_, error_;
  // What the allreduces carry: p_buffer_ / q_buffer_ themselves, or 16-bit copies of them.
  at::Tensor p_wire_, q_wire_;
};

}  // namespace dtrain::parallel::ddp
