#include "dtrain/common/Device.h"

#include <sys/resource.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdlib>
#include <optional>

#include "dtrain/common/Error.h"

namespace dtrain {

c10::Device parse_device(const std::string& name) {
  std::optional<c10::Device> device;
  try {
    device = c10::Device(name);
  } catch (const c10::Error&) {
  }
  DTRAIN_CHECK_INPUT(device && (device->is_cpu() || device->is_cuda()) &&
                         !(device->is_cpu() && device->has_index()),
                     "unknown device '", name, "' (expected cpu, cuda or cuda:N)");
  return *device;
}

bool built_with_cuda() {
#ifdef DTRAIN_CUDA
  return true;
#else
  return false;
#endif
}

int64_t peak_resident_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux: kilobytes
}

int cuda_device_count() { return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0; }

c10::Device resolve_device(const std::string& name, int local_rank) {
  c10::Device device = parse_device(name);
  if (device.is_cpu()) return device;
#ifndef DTRAIN_CUDA
  DTRAIN_THROW(InputError, "--device ", name,
               ": this dtrain was built without CUDA (build it against a CUDA LibTorch with "
               "-DDTRAIN_CUDA=ON: scripts/build --torch pip); use --device cpu");
#endif
  const int devices = cuda_device_count();
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  DTRAIN_CHECK_INPUT(devices > 0, "--device ", name, ": no CUDA device is visible to rank ",
                     local_rank, " (CUDA_VISIBLE_DEVICES='", visible ? visible : "",
                     "'; is the NVIDIA driver loaded?); use --device cpu");
  if (!device.has_index()) {
    device =
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local_rank % devices));
  }
  DTRAIN_CHECK_INPUT(device.index() < devices, "--device ", name, ": this machine shows ", devices,
                     " CUDA device", devices == 1 ? "" : "s", " (cuda:0 to cuda:", devices - 1,
                     ")");
  c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(device);
  return device;
}

at::Tensor to_device(const at::Tensor& tensor, c10::Device device) {
  if (!tensor.defined() || tensor.device() == device) return tensor;
  if (tensor.is_cpu() && device.is_cuda()) {
    const at::Tensor pinned = tensor.is_pinned() ? tensor : tensor.pin_memory();
    return pinned.to(device, /*non_blocking=*/true);
  }
  return tensor.to(device);
}

}  // namespace dtrain
