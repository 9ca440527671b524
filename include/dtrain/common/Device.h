// Where training runs: the CPU or a CUDA device, named as PyTorch names them ("cpu", "cuda",
// "cuda:N") and checked once against this build and this machine, with one line naming what is
// missing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <string>

namespace dtrain {

/// "cpu", "cuda" or "cuda:N"; InputError for any other name. Checks nothing about the machine.
c10::Device parse_device(const std::string& name);

/// The device this process trains on. "cuda" becomes cuda:(local_rank % devices), torchrun's
/// LOCAL_RANK convention. InputError when this build has no CUDA, no CUDA device is visible, or
/// N is not one of them. Makes a CUDA device the current one.
c10::Device resolve_device(const std::string& name, int local_rank);

/// Whether this build has the CUDA code paths (-DDTRAIN_CUDA=ON).
bool built_with_cuda();

/// CUDA devices visible to this process (0 in a build without CUDA).
int cuda_device_count();

/// This process's peak resident memory so far, in bytes (getrusage's maxrss; 0 if unknown).
int64_t peak_resident_bytes();

/// `tensor` on `device`: itself when it is there already; a CPU tensor headed for a GPU goes
/// through pinned memory and its copy is asynchronous (ordered on the current stream).
at::Tensor to_device(const at::Tensor& tensor, c10::Device device);

}  // namespace dtrain
