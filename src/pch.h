// Precompiled header for the library, CLI, tests and benchmarks: LibTorch's heavy headers are
// parsed once per build instead of once per file.
#pragma once
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
