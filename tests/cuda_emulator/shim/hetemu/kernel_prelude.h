// Included first in csrc/cuda/multi_tensor_cuda.cu and adamw_cuda.cu (g++ -include):
// the CUDA built-ins and launch, then the unit's real kernel header (HETEMU_ADAMW_UNIT:
// adamw.cuh) read as device code of the emulated architecture. __CUDA_ARCH__ is
// defined only while it is read: torch's headers, which come later, must stay host
// code. The kernel headers' include guards keep the .cu file's own includes of them
// from reading them again as host code.
#pragma once

#include "hetemu/runtime.h"

#define __CUDA_ARCH__ HETEMU_ARCH
#ifdef HETEMU_ADAMW_UNIT
#include "kernels/adamw.cuh"
#else
#include "kernels/multi_tensor.cuh"
#endif
#undef __CUDA_ARCH__
