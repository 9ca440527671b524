# Finds LibTorch for dtrain and for projects that use an installed dtrain (dtrainConfig.cmake
# includes this file): Debian's 1.13 (/usr) or LibTorch 2.x from a PyPI torch wheel
# (CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path). What the wheel needs settled:
#   - it is a CUDA build, and its CMake package needs the CUDA toolkit even for CPU code;
#   - its TorchConfig looks for libc10 on the system paths before its own (Debian's would win);
#   - its libraries find NCCL, cuDNN, cuBLAS in the wheel's nvidia/ folders, which the linker
#     must see before the local toolkit's (an older NCCL there lacks symbols).
# DTRAIN_CUDA (ON: the toolkit is required, and a CUDA LibTorch).

find_path(DTRAIN_TORCH_CONFIG_DIR TorchConfig.cmake PATH_SUFFIXES Torch share/cmake/Torch
          NO_DEFAULT_PATH PATHS ${CMAKE_PREFIX_PATH})
find_program(DTRAIN_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
if(DTRAIN_TORCH_CONFIG_DIR)
  get_filename_component(dtrain_torch_prefix "${DTRAIN_TORCH_CONFIG_DIR}/../../.." ABSOLUTE)
  if(EXISTS "${dtrain_torch_prefix}/lib/libtorch_cuda.so" AND NOT DTRAIN_NVCC)
    message(FATAL_ERROR "LibTorch in ${dtrain_torch_prefix} is a CUDA build: its CMake package "
                        "needs the CUDA toolkit (nvcc), which is not on PATH, in $CUDA_HOME/bin "
                        "or /usr/local/cuda/bin")
  endif()
  # Its own libc10 before the system's (TorchConfig's find_library searches /usr/lib first).
  if(EXISTS "${dtrain_torch_prefix}/lib/libc10.so")
    set(c10_LIBRARY "${dtrain_torch_prefix}/lib/libc10.so" CACHE FILEPATH "" FORCE)
  endif()
endif()
if(DTRAIN_CUDA)
  if(NOT DTRAIN_NVCC)
    message(FATAL_ERROR "-DDTRAIN_CUDA=ON needs the CUDA toolkit (nvcc and the CUDA headers): "
                        "no nvcc on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin; install the "
                        "toolkit matching LibTorch's CUDA or configure with -DDTRAIN_CUDA=OFF")
  endif()
endif()
if(DTRAIN_NVCC AND NOT CMAKE_CUDA_COMPILER)
  set(CMAKE_CUDA_COMPILER "${DTRAIN_NVCC}")
endif()

find_package(Torch REQUIRED)
message(STATUS "dtrain: LibTorch ${Torch_VERSION} in ${TORCH_INSTALL_PREFIX}")

if(DTRAIN_CUDA AND NOT TORCH_CUDA_LIBRARIES)
  message(FATAL_ERROR "-DDTRAIN_CUDA=ON needs a CUDA build of LibTorch; the one found "
                      "(${TORCH_INSTALL_PREFIX}) has no CUDA")
endif()

# A wheel's CUDA libraries: seen by the linker of whatever links torch (at run time
# libtorch_cuda's own RUNPATH finds them).
file(GLOB dtrain_wheel_cuda_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib"
     "${TORCH_INSTALL_PREFIX}/../nvidia/*/*/lib")
foreach(dir ${dtrain_wheel_cuda_libs})
  set_property(TARGET torch APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${dir}")
endforeach()

