// Stand-in for c10/cuda/CUDAGuard.h: there is one emulated device, nothing to switch.
#pragma once

#include <c10/core/Device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device /*device*/) {}
};

}  // namespace c10::cuda
