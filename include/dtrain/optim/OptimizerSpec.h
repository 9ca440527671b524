// Which optimizer and its hyper-parameters, by name: plain data, light to include (a model's
// training recipe, a job's options); Optimizers.h builds it.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::optim {

struct OptimizerSpec {
  /// "sgd", "adam", "adamw" or "adagrad".
  std::string name = "sgd";
  double lr = 0.01;
  double momentum = 0.0;  // sgd
  bool nesterov = false;  // sgd
  double weight_decay = 0.0;
  double beta1 = 0.9;  // adam, adamw
  double beta2 = 0.999;
  double eps = 1e-8;  // adam, adamw; adagrad uses 1e-10 unless set
  /// adam, adamw: the second moment stays as it is after this many steps (0 = never).
  int64_t freeze_variance_after = 0;
  /// Where the state lives (Offload.h): "none", "optimizer" (host memory: for parameters on a
  /// GPU) or "optimizer:DIR" (a file under DIR, bucket by bucket), and the bucket's size.
  std::string offload = "none";
  int64_t offload_bucket_mb = 64;
};

/// The named optimizer's own defaults, as PyTorch's (a learning rate and weight decay for it,
/// not for another optimizer): what a job that names an optimizer other than its model's
/// recipe's trains at unless told. An unknown name keeps OptimizerSpec's (make_optimizer names it).
OptimizerSpec optimizer_defaults(const std::string& name);

}  // namespace dtrain::optim
